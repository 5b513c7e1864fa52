"""Command line: python -m gptlib {tokenize, train, sample, chat, ...} --help."""

from __future__ import annotations

import argparse
import errno
import inspect
import sys

from gptlib import share
from gptlib.errors import GptlibError


class CLIError(GptlibError):
    """A bad combination of command-line arguments."""


def _command(sub, name: str, func, help: str) -> argparse.ArgumentParser:
    """A subcommand that runs func(args), described in --help by func's docstring."""
    p = sub.add_parser(name, help=help, description=inspect.cleandoc(func.__doc__ or ""))
    p.set_defaults(func=func)
    return p


def _add_tokenize(sub) -> None:
    p = _command(sub, "tokenize", cmd_tokenize, help="pre-tokenize text into token shards + meta.json")
    p.add_argument("--input", nargs="+", metavar="URL_OR_PATH",
                   help="text/jsonl/parquet files, directories, globs or fsspec URLs, e.g. "
                        "hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT/*.parquet")
    p.add_argument("--hf-dataset", metavar="OWNER/NAME", help="a Hugging Face Hub dataset through the Hub's parquet "
                   "conversion (to name its files: --input hf://datasets/OWNER/NAME/path/*.parquet); a token from "
                   "HF_TOKEN or Colab's secrets")
    p.add_argument("--hf-config", metavar="C", help="the config of --hf-dataset (default: default, or the only one)")
    p.add_argument("--hf-split", metavar="S", help="the split of --hf-dataset (default: train, or the only one)")
    p.add_argument("--format", default="text", choices=["text", "chat"],
                   help="text: documents; chat: conversations (a messages/conversations list per record), rendered "
                        "with role tokens, assistant spans stored beside the shards (default: text)")
    p.add_argument("--max-tokens", type=_count, metavar="N", help="stop after N tokens (train + val) at a document "
                   "boundary, e.g. 2.8e9 or 2.8B")
    p.add_argument("--tokenizer", default=None, choices=["char", "bpe"],
                   help="tokenizer kind (default: char; bpe with --format chat)")
    p.add_argument("--vocab-size", type=int, default=32768, help="BPE vocabulary size (default 32768)")
    p.add_argument("--tokenizer-from", "--tokenizer-file", metavar="RUN_DIR", help="reuse the tokenizer of a run "
                   "directory, a data directory or a tokenizer.json (with --format chat the chat tokens are added if "
                   "missing)")
    p.add_argument("--text-column", metavar="NAME", help="jsonl field / parquet column holding the text "
                   "(default: text; with --format chat: messages, else conversations)")
    p.add_argument("--out", required=True, metavar="DATA_DIR", help="output data directory")
    p.add_argument("--val-fraction", type=float, default=0.1, help="fraction held out for validation (default 0.1)")
    p.add_argument("--split", default="auto", choices=["auto", "document", "tail"],
                   help="validation split: per document (hash) or the tail of each text file (default: auto)")
    p.add_argument("--train-mb", type=float, default=1000.0,
                   help="train the BPE on about this many MB of the corpus; 0 = all of it (default 1000)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    p.add_argument("--overwrite", action="store_true", help="replace a different dataset already in --out")
    p.add_argument("--take-over", action="store_true",
                   help="take --out over from another tokenize that holds its lease (one writer per data directory)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")


def _count(s: str) -> int:
    """A token count: 2800000000, 2.8e9, 2.8B, 500M, 20K."""
    from gptlib.data.catalog import parse_count

    try:
        n = parse_count(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n is None or n < 1:
        raise argparse.ArgumentTypeError(f"{s!r} must be at least 1")
    return n


def cmd_tokenize(args) -> int:
    """Pre-tokenize .txt / .jsonl / parquet files, local or behind URLs (file://, memory://,
    hf://datasets/OWNER/NAME[/glob]), into a gptlib data directory (token shards + tokenizer.json + meta.json).
    Re-running the same command resumes an interrupted run or reuses the finished dataset. One tokenize writes a
    data directory at a time; Ctrl-C stops it (exit status 130) keeping the completed shards.
    """
    from gptlib.data.prepare import prepare

    inputs = list(args.input or [])
    if args.hf_dataset:
        inputs.append(f"hf://datasets/{args.hf_dataset.strip().strip('/')}")
    if not inputs:
        raise CLIError("tokenize needs --input URL_OR_PATH... or --hf-dataset OWNER/NAME")
    if (args.hf_config or args.hf_split) and not any(str(i).startswith("hf://") for i in inputs):
        raise CLIError("--hf-config / --hf-split choose among a Hub dataset's files: give --hf-dataset OWNER/NAME "
                       "or an hf://datasets/ input")
    # With a reused tokenizer the file decides the kind (char or BPE); --tokenizer is then ignored.
    tokenizer = args.tokenizer or ("bpe" if args.format == "chat" else "char")
    try:
        prepare(inputs, args.out, tokenizer=tokenizer, vocab_size=args.vocab_size,
                tokenizer_from=args.tokenizer_from, text_column=args.text_column,
                val_fraction=args.val_fraction, split=args.split, shard_tokens=args.shard_tokens,
                train_max_bytes=int(args.train_mb * 1e6) if args.train_mb > 0 else None,
                overwrite=args.overwrite, verbose=not args.quiet, format=args.format, max_tokens=args.max_tokens,
                hf_config=args.hf_config, hf_split=args.hf_split, take_over=args.take_over)
    except KeyboardInterrupt:  # Ctrl-C: prepare said in one line what is kept and how to go on
        return 130  # the shell's status for a process stopped by SIGINT
    return 0


def _add_fetch(sub) -> None:
    p = _command(sub, "fetch-shakespeare", cmd_fetch, help="download (or verify a local copy of) Tiny Shakespeare")
    p.add_argument("--local", metavar="PATH", help="use this local copy (verified) instead of downloading")
    p.add_argument("--cache-dir", metavar="DIR", help="download cache (default ~/.cache/gptlib or $GPTLIB_CACHE)")
    p.add_argument("--url", help="download from this URL instead of the canonical one")


def cmd_fetch(args) -> int:
    """Print the path of a checksum-verified Tiny Shakespeare file, downloading it into the cache if needed."""
    from gptlib.data.download import TINYSHAKESPEARE_URL, fetch_tinyshakespeare

    print(fetch_tinyshakespeare(cache_dir=args.cache_dir, url=args.url or TINYSHAKESPEARE_URL, local_path=args.local))
    return 0


def _add_train(sub) -> None:
    from gptlib.config import PRESETS, RECIPES

    p = _command(sub, "train", cmd_train, help="train or resume a GPT on a data directory")
    p.add_argument("--data", required=True, metavar="DATA_DIR", help="data directory from `tokenize`")
    p.add_argument("--preset", default="phase1", choices=list(PRESETS), help="model/training preset")
    p.add_argument("--recipe", choices=list(RECIPES), default=None,
                   help="gpt2: the 2019 recipe; modern: rotary, RMSNorm, QK-norm, SwiGLU, untied, Muon, WSD schedule "
                        "(default: a resumed run's or --init-from base's own, else gpt2)")
    p.add_argument("--run-dir", required=True, metavar="RUN_DIR", help="where checkpoints, metrics, plots go")
    p.add_argument("--mirror-dir", metavar="DIR", help="also copy each verified checkpoint here in the background "
                   "(e.g. a Google Drive folder); resume takes the newest valid one of both")
    p.add_argument("--max-steps", type=int, help="optimizer steps (the LR schedule ends here)")
    p.add_argument("--max-minutes", type=float, help="stop gracefully with a checkpoint after this many minutes")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N | mps")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on for CUDA, off for CPU)")
    p.add_argument("--save-every-steps", type=int, help="checkpoint every N steps (default: at each validation)")
    p.add_argument("--save-every-minutes", type=float, help="also checkpoint every M minutes")
    p.add_argument("--keep-last", type=int, help="checkpoints kept besides the best (at least 2)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any config field, e.g. --set n_layer=6 --set learning_rate=3e-4 (repeatable)")
    p.add_argument("--init-from", metavar="RUN_DIR[:latest|best|STEP]",
                   help="start a new run from these weights (fresh optimizer and schedule), e.g. a run made by "
                        "import-hf; the model's shape comes from it (use --preset finetune)")
    p.add_argument("--take-over", action="store_true",
                   help="take the run over from another training process that holds its lease (see README)")
    p.add_argument("--skip-unreadable", action="store_true",
                   help="go on although newer checkpoints (on a slow or hung Drive) could not be read in time; they "
                        "are kept (by default training waits a while, then stops and says so)")
    p.add_argument("--allow-data-change", action="store_true",
                   help="resume on other tokens than the run was trained on (same tokenizer); recorded in the run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def cmd_train(args) -> int:
    """Train a GPT; re-running the same command resumes from the run directory's newest valid checkpoint."""
    from gptlib.training.loop import train

    overrides = list(args.set)
    for field in ("save_every_steps", "save_every_minutes", "keep_last"):  # flags named as the config fields
        v = getattr(args, field)
        if v is not None:
            overrides.append(f"{field}={v}")
    compile_flag = None if args.compile is None else ("on" if args.compile else "off")
    r = train(args.data, args.run_dir, preset=args.preset, overrides=overrides, max_steps=args.max_steps,
              max_minutes=args.max_minutes, seed=args.seed, device=args.device, compile=compile_flag,
              progress=not args.quiet, mirror_dir=args.mirror_dir, take_over=args.take_over,
              init_from=args.init_from, skip_unreadable=args.skip_unreadable,
              allow_data_change=args.allow_data_change, recipe=args.recipe)
    print(r.summary())
    return 130 if r.stopped_by == "interrupt" else 0  # Ctrl-C: the shell's status for a process stopped by SIGINT


def _add_generation(p: argparse.ArgumentParser) -> None:
    """The arguments sample and chat share: which checkpoint, and how to sample from it."""
    p.add_argument("--run-dir", required=True, metavar="RUN_DIR")
    p.add_argument("--checkpoint", default="latest", metavar="latest|best|STEP",
                   help="which checkpoint: the newest, the best validation loss, or a step number (default latest)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="longest output in tokens (chat: at most half "
                   "the context)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy decoding")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (default 1 = off)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps | auto")


def _sampling(args, **extra):
    from gptlib.inference.sampling import SamplingConfig

    return SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                          **extra).validate()


def _add_sample(sub) -> None:
    p = _command(sub, "sample", cmd_sample, help="generate text from a run's checkpoint")
    _add_generation(p)
    p.add_argument("--prompt", action="append", default=None,
                   help="text to continue (repeatable: several prompts run as one batch; default a newline)")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--stop", action="append", default=[], help="stop a sample at this text (repeatable)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated (samples run one by one)")


def cmd_sample(args) -> int:
    """Generate text from a checkpoint of a run directory (KV-cached engine)."""
    from gptlib.inference.engine import Engine

    if args.num_samples < 1:
        raise CLIError(f"--num-samples {args.num_samples} must be >= 1")
    # A literal backslash-n typed in a shell means a newline.
    prompts = [pr.replace("\\n", "\n") for pr in (args.prompt or ["\n"])]
    jobs = [pr for pr in prompts for _ in range(args.num_samples)]
    cfg = _sampling(args, stop=[st.replace("\\n", "\n") for st in args.stop])
    eng = Engine.from_run(args.run_dir, args.checkpoint, device=args.device)
    print(f"# {eng.source} (step {eng.step})", file=sys.stderr)
    many = len(jobs) > 1
    if args.stream:
        for i, pr in enumerate(jobs):
            if many:
                print(f"\n--- sample {i + 1}/{len(jobs)} ---")
            print(pr, end="", flush=True)
            cfg.seed = args.seed + i
            eng.generate(pr, cfg, stream=lambda _, piece: print(piece, end="", flush=True))
            print()
    else:
        for i, c in enumerate(eng.generate(jobs, cfg)):
            if many:
                print(f"\n--- sample {i + 1}/{len(jobs)} ---")
            print(c.prompt + c.text)
    return 0


def _add_chat(sub) -> None:
    p = _command(sub, "chat", cmd_chat,
                 help="talk to a chat-tuned run: an interactive chat, or one turn with --message")
    _add_generation(p)
    p.add_argument("--message", default=None, metavar="TEXT", help="one user message: print only the reply and exit")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system prompt, kept through the conversation")


def cmd_chat(args) -> int:
    """Chat with a run fine-tuned on conversations (tokenize --format chat, then train --init-from). Without
    --message: an interactive chat in the terminal (/reset clears the history, /quit or Ctrl-D ends). With
    --message: one turn, and only the reply is printed. The history is kept within the context window: the oldest
    exchanges are dropped first (see gptlib/inference/chat.py).
    """
    from gptlib.inference.chat import ChatSession, chat_loop

    cfg = _sampling(args)
    session = ChatSession.from_run(args.run_dir, args.checkpoint, device=args.device, system=args.system)
    if args.message is None:
        return chat_loop(session, cfg)
    print(session.reply(args.message, cfg))  # stdout holds the reply only; notices went to stderr
    return 0


def _add_export(sub) -> None:
    p = _command(sub, "export-hf", cmd_export,
                 help="export a checkpoint as a Hugging Face model folder (GPT-2; Qwen3/Llama for --recipe modern)")
    p.add_argument("--run-dir", required=True, metavar="RUN_DIR")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--checkpoint", default="latest", metavar="latest|best|STEP")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")


def cmd_export(args) -> int:
    """Write config.json, model.safetensors and tokenizer files that transformers loads with
    AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained: a GPT2LMHeadModel for the gpt2 recipe, a
    Qwen3ForCausalLM (LlamaForCausalLM without QK-norm) for the modern recipe.
    """
    from gptlib.inference.export import export_hf

    out = export_hf(args.run_dir, args.out, args.checkpoint, overwrite=args.overwrite)
    print(f"exported to {out}: " + ", ".join(sorted(f.name for f in out.iterdir())))
    return 0


def _add_eval(sub) -> None:
    p = _command(sub, "eval", cmd_eval, help="evaluate checkpoints: HellaSwag accuracy or validation bits per byte")
    p.add_argument("--run-dir", required=True, metavar="RUN_DIR")
    p.add_argument("--task", required=True, metavar="hellaswag|bpb",
                   help="hellaswag: accuracy on the 10,042 validation items; bpb: bits per byte on the val split")
    p.add_argument("--data", metavar="FILE|DATA_DIR", default=None,
                   help="hellaswag: a local hellaswag_val.jsonl (default: the canonical file, downloaded once, "
                        "sha256-checked, cached); bpb: the data directory (default: the one the checkpoint "
                        "recorded)")
    p.add_argument("--checkpoint", default="latest", metavar="latest|best|STEP|all",
                   help="which checkpoint(s): the newest, the best validation loss, a step, several separated by "
                        "commas, or all of them oldest first (default latest)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="hellaswag: N items, evenly spaced over the file; bpb: N windows of block_size tokens, "
                        "evenly spaced over the split (default: all)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--batch-tokens", type=int, default=None, metavar="N",
                   help="padded tokens per forward (default 65536 on a GPU, 8192 on a CPU)")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="append the rows to FILE instead of RUN_DIR/eval.jsonl (e.g. for a read-only run directory)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def cmd_eval(args) -> int:
    """Score one or all checkpoints of a run on HellaSwag (validation, zero-shot, completion style: acc and
    acc_norm) or on the run's validation split in bits per byte. Prints a table and appends one row per checkpoint
    to RUN_DIR/eval.jsonl (or --out FILE); nothing else in the run directory changes. Rows that cannot be appended
    (a read-only run directory) lose no score: the table is printed, then a warning line (exit status 0).
    """
    from gptlib.evaluation.evaluate import evaluate_run, format_table
    from gptlib.layout import EVAL_FILE

    if args.batch_tokens is not None and args.batch_tokens < 1:
        raise CLIError(f"--batch-tokens {args.batch_tokens} must be >= 1")
    unsaved: list[str] = []  # said after the table: the scores first
    rows = evaluate_run(args.run_dir, args.task, args.checkpoint, data=args.data, limit=args.limit,
                        device=args.device, batch_tokens=args.batch_tokens, progress=not args.quiet, out=args.out,
                        warn=unsaved.append)
    print(format_table(rows), flush=True)  # before the lines on stderr, also when both go to one file
    for line in unsaved:
        print(line, file=sys.stderr)
    if not unsaved:
        print(f"appended {len(rows)} row(s) to {args.out or f'{args.run_dir}/{EVAL_FILE}'}", file=sys.stderr)
    return 0


def _add_import(sub) -> None:
    p = _command(sub, "import-hf", cmd_import,
                 help="make a gptlib run directory from a Hugging Face GPT-2 (or an exported Qwen3/Llama) model")
    p.add_argument("--model", required=True, metavar="NAME_OR_DIR", help="a Hub model id (gpt2) or a local folder")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="the new run directory (must not exist or be empty)")


def cmd_import(args) -> int:
    """Turn a GPT2LMHeadModel (gpt2, gpt2-medium from the Hub when online, or any local folder), or a Qwen3 / Llama
    folder of the modern recipe's shape (what export-hf writes for it), into a run directory: sample, eval and
    export-hf work on it, and train --init-from RUN_DIR fine-tunes it.
    """
    from gptlib.inference.hf_import import import_hf

    import_hf(args.model, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gptlib", description="Train GPT-style models from scratch.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_fetch(sub)
    _add_tokenize(sub)
    _add_train(sub)
    _add_sample(sub)
    _add_chat(sub)
    _add_export(sub)
    _add_import(sub)
    _add_eval(sub)
    share.add_commands(sub, _command)  # export-gguf, push
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except GptlibError as e:  # the user's to fix (gptlib.errors): one line, exit status 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in _DISK_ERRORS:
            raise
        # a full, read-only or forbidden disk met outside the places that explain it: still one line
        print(f"error: {e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}; free space or choose a "
              f"writable directory", file=sys.stderr)
        return 2


_DISK_ERRORS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}


if __name__ == "__main__":
    sys.exit(main())
