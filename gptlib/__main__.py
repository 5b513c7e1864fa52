"""Command line: python -m gptlib {tokenize, train, sample, ...} --help."""

from __future__ import annotations

import argparse
import sys


class CLIError(Exception):
    pass


def _add_tokenize(sub) -> None:
    p = sub.add_parser("tokenize", help="pre-tokenize text into token shards + meta.json",
                       description="Pre-tokenize .txt / .jsonl / parquet files into a gptlib data directory "
                                   "(token shards + tokenizer.json + meta.json). Re-running the same command "
                                   "resumes an interrupted run or reuses the finished dataset.")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="text/jsonl/parquet files, directories or globs")
    p.add_argument("--tokenizer", default="char", choices=["char", "bpe"], help="tokenizer kind (default: char)")
    p.add_argument("--vocab-size", type=int, default=32768, help="BPE vocabulary size (default 32768)")
    p.add_argument("--tokenizer-file", metavar="PATH", help="reuse this trained tokenizer.json instead of training")
    p.add_argument("--text-column", metavar="NAME", help="jsonl field / parquet column holding the text "
                   "(default: text)")
    p.add_argument("--out", required=True, metavar="DATA_DIR", help="output data directory")
    p.add_argument("--val-fraction", type=float, default=0.1, help="fraction held out for validation (default 0.1)")
    p.add_argument("--split", default="auto", choices=["auto", "document", "tail"],
                   help="validation split: per document (hash) or the tail of each text file (default: auto)")
    p.add_argument("--train-mb", type=float, default=1000.0,
                   help="train the BPE on about this many MB of the corpus; 0 = all of it (default 1000)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    p.add_argument("--overwrite", action="store_true", help="replace a different dataset already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=cmd_tokenize)


def cmd_tokenize(args) -> int:
    from .prepare import prepare

    # With --tokenizer-file the file decides the kind (char or BPE); --tokenizer is then ignored.
    prepare(args.input, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
            tokenizer_file=args.tokenizer_file, text_column=args.text_column, val_fraction=args.val_fraction,
            split=args.split, shard_tokens=args.shard_tokens,
            train_max_bytes=int(args.train_mb * 1e6) if args.train_mb > 0 else None,
            overwrite=args.overwrite, verbose=not args.quiet)
    return 0


def _add_fetch(sub) -> None:
    p = sub.add_parser("fetch-shakespeare", help="download (or verify a local copy of) Tiny Shakespeare",
                       description="Print the path of a checksum-verified Tiny Shakespeare file, downloading it "
                                   "into the cache if needed.")
    p.add_argument("--local", metavar="PATH", help="use this local copy (verified) instead of downloading")
    p.add_argument("--cache-dir", metavar="DIR", help="download cache (default ~/.cache/gptlib or $GPTLIB_CACHE)")
    p.add_argument("--url", help="download from this URL instead of the canonical one")
    p.set_defaults(func=cmd_fetch)


def cmd_fetch(args) -> int:
    from .download import TINYSHAKESPEARE_URL, fetch_tinyshakespeare

    print(fetch_tinyshakespeare(cache_dir=args.cache_dir, url=args.url or TINYSHAKESPEARE_URL, local_path=args.local))
    return 0


def _add_train(sub) -> None:
    from .config import PRESETS

    p = sub.add_parser("train", help="train or resume a GPT on a data directory",
                       description="Train a GPT; re-running the same command resumes from the run directory's "
                                   "newest valid checkpoint.")
    p.add_argument("--data", required=True, metavar="DATA_DIR", help="data directory from `tokenize`")
    p.add_argument("--preset", default="phase1", choices=list(PRESETS), help="model/training preset")
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
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    from .train import train

    overrides = list(args.set)
    for field in ("save_every_steps", "save_every_minutes", "keep_last"):  # flags named as the config fields
        v = getattr(args, field)
        if v is not None:
            overrides.append(f"{field}={v}")
    compile_flag = None if args.compile is None else ("on" if args.compile else "off")
    r = train(args.data, args.run_dir, preset=args.preset, overrides=overrides, max_steps=args.max_steps,
              max_minutes=args.max_minutes, seed=args.seed, device=args.device, compile=compile_flag,
              progress=not args.quiet, mirror_dir=args.mirror_dir)
    val = f"{r.val_loss:.4f}" if r.val_loss is not None else "n/a"
    print(f"done: step {r.step:,}, val loss {val}, {r.tokens_per_s:,.0f} tokens/s, "
          f"{r.elapsed_s:.1f}s ({r.stopped_by}) -> {r.run_dir}")
    return 0


def _add_sample(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a run's checkpoint",
                       description="Generate text from a checkpoint of a run directory (KV-cached engine).")
    p.add_argument("--run-dir", required=True, metavar="RUN_DIR")
    p.add_argument("--checkpoint", default="latest", metavar="latest|best|STEP",
                   help="which checkpoint: the newest, the best validation loss, or a step number (default latest)")
    p.add_argument("--prompt", action="append", default=None,
                   help="text to continue (repeatable: several prompts run as one batch; default a newline)")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy decoding")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (default 1 = off)")
    p.add_argument("--stop", action="append", default=[], help="stop a sample at this text (repeatable)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--stream", action="store_true", help="print text as it is generated (samples run one by one)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps | auto")
    p.add_argument("--compile", action="store_true",
                   help="compile the decode step (CUDA graphs on a GPU): faster tokens after a one-time compile")
    p.set_defaults(func=cmd_sample)


def cmd_sample(args) -> int:
    from .generate import Engine, GenerationError, SamplingConfig

    if args.num_samples < 1:
        raise CLIError(f"--num-samples {args.num_samples} must be >= 1")
    # A literal backslash-n typed in a shell means a newline.
    prompts = [pr.replace("\\n", "\n") for pr in (args.prompt or ["\n"])]
    jobs = [pr for pr in prompts for _ in range(args.num_samples)]
    try:
        cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                             stop=[st.replace("\\n", "\n") for st in args.stop],
                             seed=args.seed).validate()
        eng = Engine.from_run(args.run_dir, args.checkpoint, device=args.device, compile=args.compile)
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
    except GenerationError as e:
        raise CLIError(str(e)) from None
    return 0


def _add_export(sub) -> None:
    p = sub.add_parser("export-hf", help="export a checkpoint as a Hugging Face GPT2LMHeadModel folder",
                       description="Write config.json, model.safetensors and tokenizer files that transformers "
                                   "loads with GPT2LMHeadModel.from_pretrained / AutoTokenizer.from_pretrained.")
    p.add_argument("--run-dir", required=True, metavar="RUN_DIR")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--checkpoint", default="latest", metavar="latest|best|STEP")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from .export import ExportError, export_hf

    try:
        out = export_hf(args.run_dir, args.out, args.checkpoint, overwrite=args.overwrite)
    except ExportError as e:
        raise CLIError(str(e)) from None
    print(f"exported to {out}: " + ", ".join(sorted(f.name for f in out.iterdir())))
    return 0


def _add_bench(sub) -> None:
    from .config import PRESETS

    p = sub.add_parser("bench", help="measure speed: the optimization ladder, or a preset's tokens/s and MFU",
                       description="`bench ladder`: the optimization ladder (memmap + per-sample loop -> RAM preload "
                                   "-> vectorised batches -> compile -> bf16 -> flash attention) with step time, "
                                   "speedup and MFU per rung. `bench train`: tokens/s, MFU, time split and ETA of a "
                                   "preset on the fast path, on synthetic tokens or --data.")
    p.add_argument("what", choices=["ladder", "train"])
    p.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="model preset (ladder default: gpt2-small at 64 x 512 on CUDA, a small model on CPU; "
                        "train default: gpt2-small)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--steps", type=int, default=None, help="timed steps (ladder 10, train 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warmup steps, compile included (ladder 3, train 5)")
    p.add_argument("--batch-size", type=int, default=None, help="ladder: sequences per micro-batch")
    p.add_argument("--accum", type=int, default=None, help="ladder: micro-batches per step (default 4 on CUDA, 1 on CPU)")
    p.add_argument("--data", metavar="DATA_DIR", default=None, help="real token shards instead of synthetic tokens")
    p.add_argument("--compile-backend", default="inductor", help="ladder: torch.compile backend (default inductor)")
    p.add_argument("--rungs", default=None, help="ladder: comma-separated rung numbers to run (default all)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="train: torch.compile")
    p.add_argument("--auto-batch", action="store_true", help="train: probe the largest micro-batch that fits")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override config fields")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from . import bench
    from .config import get_preset

    print(bench.machine_info())
    if args.what == "ladder":
        model_cfg = None
        if args.preset or args.set:
            cfg = get_preset(args.preset or "gpt2-small").apply_overrides(args.set).validate()
            model_cfg = cfg.model
        rungs = [int(r) for r in args.rungs.split(",")] if args.rungs else None
        bench.run_ladder(model_cfg, batch_size=args.batch_size, device=args.device, steps=args.steps or 10,
                         warmup=3 if args.warmup is None else args.warmup, data_dir=args.data,
                         compile_backend=args.compile_backend, rungs=rungs, accum=args.accum)
    else:
        bench.bench_train(args.preset or "gpt2-small", args.set, device=args.device, steps=args.steps or 20,
                          warmup=5 if args.warmup is None else args.warmup, compile=args.compile,
                          auto_batch=args.auto_batch, data_dir=args.data)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gptlib", description="Train GPT-style models from scratch.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_fetch(sub)
    _add_tokenize(sub)
    _add_train(sub)
    _add_sample(sub)
    _add_export(sub)
    _add_bench(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except _user_errors() as e:  # evaluated only when an exception is being handled
        print(f"error: {e}", file=sys.stderr)
        return 2


# Errors that are the user's to fix: printed as one line, exit status 2.
_USER_ERRORS = (("bench", "MicroBatchOOM"), ("checkpoint", "CheckpointError"), ("config", "ConfigError"),
                ("download", "DownloadError"), ("prepare", "PrepareError"), ("shards", "DataFormatError"),
                ("tokenizer", "TokenizerError"))


def _user_errors() -> tuple:
    """The user-error classes of the gptlib modules the command imported (a module it did not import
    cannot have raised): so `tokenize` never imports torch, via bench/checkpoint, just to name errors."""
    found = [CLIError]
    for mod, name in _USER_ERRORS:
        m = sys.modules.get(f"gptlib.{mod}")
        if m is not None and hasattr(m, name):
            found.append(getattr(m, name))
    return tuple(found)


if __name__ == "__main__":
    sys.exit(main())
