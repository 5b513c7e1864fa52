"""python -m gptlib COMMAND: cmd_X(args) -> exit status (None: 0); its --help is its help, then its docstring.
gptlib/cli.py registers the commands and runs the one asked for."""

from __future__ import annotations

import argparse
import sys

from gptlib.cli import arg, command, run
from gptlib.config import PRESETS, RECIPES
from gptlib.errors import PrepareError


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


@command(
    "fetch-shakespeare",
    "download (or verify a local copy of) Tiny Shakespeare",
    arg("--local", metavar="PATH", help="use this local copy (verified) instead of downloading"),
    arg(
        "--cache-dir",
        metavar="DIR",
        help="download cache (default ~/.cache/gptlib or $GPTLIB_CACHE)",
    ),
)
def cmd_fetch(args) -> None:
    from gptlib.data.download import fetch_tinyshakespeare

    print(fetch_tinyshakespeare(cache_dir=args.cache_dir, local_path=args.local))


# What tokenize reads: files or URLs, or a Hub dataset by name (_inputs makes them prepare's inputs)
INPUTS = (
    arg(
        "--input",
        nargs="+",
        action="extend",  # --input a --input b: both (it kept only b)
        metavar="URL_OR_PATH",
        help="text/jsonl/parquet files, folders, globs or URLs",
    ),
    arg(
        "--hf-dataset",
        metavar="OWNER/NAME",
        help="a Hub dataset, through the Hub's parquet conversion",
    ),
    arg(
        "--hf-config",
        metavar="C",
        help="the config of --hf-dataset (default: default, or the only one)",
    ),
    arg("--hf-split", metavar="S", help="--hf-dataset's split (default: train, or the only one)"),
)


def _inputs(args) -> list[str]:
    """--input's files, folders, globs and URLs, then --hf-dataset as an hf://datasets/ URL."""
    inputs = list(args.input or [])
    if args.hf_dataset:
        inputs.append(f"hf://datasets/{args.hf_dataset.strip().strip('/')}")
    if not inputs:
        raise PrepareError("tokenize needs --input URL_OR_PATH... or --hf-dataset OWNER/NAME")
    if (args.hf_config or args.hf_split) and not any(i.startswith("hf://") for i in inputs):
        raise PrepareError(
            "--hf-config / --hf-split choose among a Hub dataset's files: give --hf-dataset OWNER/NAME "
            "or an hf://datasets/ input"
        )
    return inputs


@command(
    "tokenize",
    "pre-tokenize text into token shards + meta.json",
    *INPUTS,
    arg(
        "--format",
        choices=["text", "chat"],
        help="documents, or conversations (default: chat if the records have a messages or conversations "
        "field and no text field, else text)",
    ),
    arg(
        "--max-tokens",
        type=_count,
        metavar="N",
        help="stop after N tokens at a document boundary, e.g. 2.8B",
    ),
    arg(
        "--tokenizer",
        choices=["char", "bpe"],
        help="tokenizer kind (default: char; bpe for conversations)",
    ),
    arg("--vocab-size", type=int, default=32768, help="BPE vocabulary size (default 32768)"),
    arg(
        "--tokenizer-from",
        "--tokenizer-file",
        metavar="RUN_DIR",
        help="reuse this run's/data's tokenizer",
    ),
    arg("--text-column", metavar="NAME", help="the jsonl field / parquet column read"),
    arg("--out", required=True, metavar="DATA_DIR", help="output data directory"),
    arg(
        "--val-fraction",
        type=float,
        default=0.1,
        help="fraction held out for validation (default 0.1)",
    ),
    arg(
        "--split",
        default="auto",
        choices=["auto", "document", "tail"],
        help="validation: by document or tail",
    ),
    arg(
        "--train-mb",
        type=float,
        default=1000.0,
        help="train the BPE on this many MB; 0 = all (default 1000)",
    ),
    arg("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)"),
    arg(
        "--overwrite",
        action="store_true",
        help="replace the dataset in --out (kept whole until the new one is complete)",
    ),
    arg("--quiet", action="store_true", help="no progress bar or summary"),
)
def cmd_tokenize(args) -> None:
    """The same command resumes an interrupted run; Ctrl-C keeps the completed shards."""
    from gptlib.data.prepare import prepare

    prepare(
        _inputs(args),
        args.out,
        # None: prepare's choice once the format is known, char for text and bpe for chat
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        tokenizer_from=args.tokenizer_from,
        text_column=args.text_column,
        val_fraction=args.val_fraction,
        split=args.split,
        shard_tokens=args.shard_tokens,
        train_max_bytes=int(args.train_mb * 1e6) if args.train_mb > 0 else None,
        overwrite=args.overwrite,
        verbose=not args.quiet,
        format=args.format or "auto",
        max_tokens=args.max_tokens,
        hf_config=args.hf_config,
        hf_split=args.hf_split,
    )


# how a training call starts: gptlib.StartOptions
STARTING = (
    arg("--init-from", metavar="RUN_DIR[:latest|best|STEP]", help="a new run from these weights"),
    arg(
        "--take-over",
        action="store_true",
        help="take the run over from another process holding its lease",
    ),
    arg(
        "--skip-unreadable",
        action="store_true",
        help="go on without newer checkpoints Drive cannot read now",
    ),
    arg(
        "--allow-data-change",
        action="store_true",
        help="resume on other tokens (same tokenizer); recorded",
    ),
)


@command(
    "train",
    "train or resume a GPT on a data directory",
    arg("--data", required=True, metavar="DATA_DIR", help="data directory from `tokenize`"),
    arg("--preset", default="phase1", choices=list(PRESETS), help="model/training preset"),
    arg(
        "--recipe",
        choices=list(RECIPES),
        help="default: a resumed run's or --init-from base's own, else gpt2",
    ),
    arg("--run-dir", required=True, metavar="RUN_DIR", help="where checkpoints, metrics, plots go"),
    arg("--mirror-dir", metavar="DIR", help="also copy each checkpoint here (e.g. Google Drive)"),
    arg("--max-steps", type=int, help="optimizer steps (the LR schedule ends here)"),
    arg(
        "--max-minutes",
        type=float,
        help="stop gracefully with a checkpoint after this many minutes",
    ),
    arg("--seed", type=int),
    arg("--device", help="auto | cpu | cuda | cuda:N | mps"),
    arg(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="torch.compile (default: on for big CUDA runs)",
    ),
    arg(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="e.g. keep_last=3 (repeatable)",
    ),
    *STARTING,
    arg("--quiet", action="store_true", help="no progress bar"),
)
def cmd_train(args) -> int:
    """Re-running the same command resumes from the run directory's newest valid checkpoint."""
    from gptlib.training.loop import train
    from gptlib.training.resume import StartOptions

    r = train(
        args.data,
        args.run_dir,
        preset=args.preset,
        overrides=args.set,
        recipe=args.recipe,
        options=StartOptions(
            args.init_from, args.take_over, args.skip_unreadable, args.allow_data_change
        ),
        mirror_dir=args.mirror_dir,
        max_steps=args.max_steps,
        max_minutes=args.max_minutes,
        seed=args.seed,
        device=args.device,
        compile=None if args.compile is None else ("on" if args.compile else "off"),
        progress=not args.quiet,
    )
    # max_minutes, Ctrl-C, SIGTERM: how to go on, once
    early = r.stopped_by not in ("max_steps", "finished")
    print(r.summary("--max-steps") + ("; re-run the same command to continue" if early else ""))
    if r.stopped_by == "interrupt":
        return 130  # Ctrl-C: the status of a process stopped by SIGINT
    # the summary says why: a script must not take the run for safe
    return 1 if r.not_on_drive is not None else 0


# the arguments sample and chat share: how to sample
GENERATION = (
    arg(
        "--max-new-tokens",
        type=int,
        default=200,
        help="longest output in tokens (chat: at most half the context)",
    ),
    arg("--temperature", type=float, default=0.8, help="0 = greedy decoding"),
    arg("--top-k", type=int, help="sample among the k most likely tokens"),
    arg("--top-p", type=float, help="nucleus sampling threshold in (0, 1]"),
    arg(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 1 discourages repeats (default 1 = off)",
    ),
    arg("--seed", type=int, default=1337),
    arg("--device", default="cpu", help="cpu | cuda | cuda:N | mps | auto"),
)


def _sampling(args, **extra):
    from gptlib.inference.engine import SamplingConfig

    return SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        **extra,
    ).validate()


@command(
    "sample",
    "generate text from a run's checkpoint",
    *GENERATION,
    arg(
        "--prompt",
        action="append",
        help="text to continue (repeatable: one batch; default a newline)",
    ),
    arg("--num-samples", type=_count, default=1, help="samples per prompt (default 1)"),
    arg("--stop", action="append", default=[], help="stop a sample at this text (repeatable)"),
    arg(
        "--stream",
        action="store_true",
        help="print text as it is generated (samples run one by one)",
    ),
    checkpoint="latest",
)
def cmd_sample(args) -> None:
    """With a KV cache; several prompts or samples run as one batch (with --stream, one by one)."""
    from gptlib.inference.engine import Engine

    # A literal backslash-n typed in a shell means a newline.
    prompts = [pr.replace("\\n", "\n") for pr in (args.prompt or ["\n"])]
    jobs = [pr for pr in prompts for _ in range(args.num_samples)]
    cfg = _sampling(args, stop=[st.replace("\\n", "\n") for st in args.stop])
    eng = Engine.from_run(args.run_dir, args.checkpoint, device=args.device)
    print(f"# {eng.source} (step {eng.step})", file=sys.stderr)
    n = len(jobs)
    heading = [f"\n--- sample {i + 1}/{n} ---\n" if n > 1 else "" for i in range(n)]
    if not args.stream:  # one batch
        for head, c in zip(heading, eng.generate(jobs, cfg)):
            print(head + c.prompt + c.text)
        return
    for i, pr in enumerate(jobs):  # one by one
        print(heading[i] + pr, end="", flush=True)
        cfg.seed = args.seed + i
        eng.generate(pr, cfg, stream=lambda _, piece: print(piece, end="", flush=True))
        print()


@command(
    "chat",
    "talk to a chat-tuned run: an interactive chat, or one turn with --message",
    *GENERATION,
    arg("--message", metavar="TEXT", help="one user message: print only the reply and exit"),
    arg("--system", metavar="TEXT", help="a system prompt, kept through the conversation"),
    checkpoint="latest",
)
def cmd_chat(args) -> int | None:
    """/reset clears the history, /quit or Ctrl-D ends; the oldest exchanges go first when the context is full."""
    from gptlib.inference.chat import ChatSession, chat_loop

    cfg = _sampling(args)
    session = ChatSession.from_run(
        args.run_dir, args.checkpoint, device=args.device, system=args.system
    )
    if args.message is None:
        return chat_loop(session, cfg)
    print(session.reply(args.message, cfg))  # stdout holds the reply only; notices went to stderr


@command(
    "export-hf",
    "export a checkpoint as a Hugging Face model folder (GPT-2; Qwen3/Llama for --recipe modern)",
    arg("--out", required=True, metavar="DIR", help="output folder"),
    arg("--overwrite", action="store_true", help="replace a previous export there"),
    checkpoint="latest",
)
def cmd_export(args) -> None:
    from gptlib.inference.export import export_hf

    out = export_hf(args.run_dir, args.out, args.checkpoint, overwrite=args.overwrite)
    print(f"exported to {out}: " + ", ".join(sorted(f.name for f in out.iterdir())))


@command(
    "export-gguf",
    "export a checkpoint as a GGUF file (llama.cpp, Ollama)",
    arg("--out", required=True, metavar="FILE.gguf"),
    arg(
        "--dtype",
        default="f16",
        metavar="f32|f16|q8_0",
        help="exact | half the size | a quarter (default f16)",
    ),
    arg("--overwrite", action="store_true", help="replace an existing file"),
    checkpoint="latest",
)
def cmd_export_gguf(args) -> None:
    from gptlib.inference.export import export_gguf

    out = export_gguf(
        args.run_dir, args.out, args.checkpoint, dtype=args.dtype, overwrite=args.overwrite
    )
    print(f"exported to {out} ({out.stat().st_size / 1e6:,.1f} MB, {args.dtype})")


@command(
    "import-hf",
    "make a gptlib run directory from a Hugging Face GPT-2 (or an exported Qwen3/Llama) model",
    arg(
        "--model",
        required=True,
        metavar="NAME_OR_DIR",
        help="a Hub model id (gpt2) or a local folder",
    ),
    arg(
        "--out",
        required=True,
        metavar="RUN_DIR",
        help="the new run directory (must not exist or be empty)",
    ),
)
def cmd_import(args) -> None:
    """The new run directory works with sample, chat, eval, export-hf and train --init-from."""
    from gptlib.inference.hf_import import import_hf

    import_hf(args.model, args.out)


@command(
    "push",
    "upload a checkpoint to the Hugging Face Hub with a model card",
    arg(
        "--repo",
        required=True,
        metavar="USER/NAME",
        help="the model repository (created if missing)",
    ),
    arg("--private", action="store_true", help="create the repository private"),
    arg("--gguf", action="store_true", help="add an f16 GGUF file (llama.cpp, Ollama, LM Studio)"),
    arg("--license", default="apache-2.0", help="the card's license (default apache-2.0)"),
    arg(
        "--hardware", default="", help="what it was trained on, for the card (e.g. '1x A100 40GB')"
    ),
    arg("--dry-run", metavar="DIR", help="write the commit's files into DIR and upload nothing"),
    checkpoint="best",
)
def cmd_push(args) -> None:
    """In one commit; the token: HF_TOKEN, Colab's secret HF_TOKEN or a saved `hf auth login`."""
    from gptlib.share import push

    where = push(
        args.run_dir,
        args.repo,
        args.checkpoint,
        private=args.private,
        gguf=args.gguf,
        dry_run=args.dry_run,
        license=args.license,
        hardware=args.hardware,
    )
    print(f"{'wrote the commit files to' if args.dry_run else 'pushed to'} {where}")


@command(
    "eval",
    "evaluate checkpoints: HellaSwag accuracy or validation bits per byte",
    arg("--run-dir", required=True, metavar="RUN_DIR"),
    arg(
        "--task",
        required=True,
        metavar="hellaswag|bpb",
        help="HellaSwag accuracy, or val bits per byte",
    ),
    arg(
        "--data",
        metavar="FILE|DATA_DIR",
        help="hellaswag_val.jsonl | data dir (default: canonical | run's)",
    ),
    arg(
        "--checkpoint",
        default="latest",
        metavar="latest|best|STEP|all",
        help="one, several (a,b), or all",
    ),
    arg("--limit", type=int, metavar="N", help="N items or windows, evenly spaced (default: all)"),
    arg("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)"),
    arg("--batch-tokens", type=_count, metavar="N", help="padded tokens per forward"),
    arg("--out", metavar="FILE", help="append the rows to FILE instead of RUN_DIR/eval.jsonl"),
    arg("--quiet", action="store_true", help="no progress bar"),
)
def cmd_eval(args) -> None:
    """Prints a table and appends a row per checkpoint to RUN_DIR/eval.jsonl (or --out FILE)."""
    from gptlib.evaluation.evaluate import evaluate_run, format_table
    from gptlib.layout import EVAL_FILE

    unsaved: list[str] = []  # said after the table: the scores first
    rows = evaluate_run(
        args.run_dir,
        args.task,
        args.checkpoint,
        data=args.data,
        limit=args.limit,
        device=args.device,
        batch_tokens=args.batch_tokens,
        progress=not args.quiet,
        out=args.out,
        warn=unsaved.append,
    )
    # before the lines on stderr, also when both go to one file
    print(format_table(rows), flush=True)
    appended = f"appended {len(rows)} row(s) to {args.out or f'{args.run_dir}/{EVAL_FILE}'}"
    print("\n".join(unsaved) or appended, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """`python -m gptlib` and the installed `gptlib` script (argv None): a reader of a run's checkpoints runs in a
    child process (gptlib/cli.py's detached); main([...]) runs in this one."""
    return run(sys.argv[1:], detach=True) if argv is None else run(argv)


if __name__ == "__main__":
    sys.exit(main())
