"""What the GGUF and push tests share (test_gguf, test_llama_cpp, test_push, test_notebook_04): a small BPE data
directory, short runs of both recipes on it, and a digest of a directory tree (to show a refusal changed nothing)."""

from __future__ import annotations

import hashlib
from pathlib import Path

# Small shapes: n_embd a multiple of 32, so every q8_0 row quantizes (llama.cpp's blocks are 32 wide).
SHAPE = [
    "block_size=64",
    "n_layer=2",
    "n_head=2",
    "n_embd=64",
    "batch_size=16",
    "eval_batches=2",
    "log_interval=10",
    "sample_tokens=8",
    "warmup_steps=5",
    "save_every_minutes=0",
]


def bpe_data(text_file: Path, out: Path, vocab_size: int = 400) -> Path:
    from gptlib.data.prepare import prepare_text

    prepare_text([text_file], out, tokenizer="bpe", vocab_size=vocab_size, verbose=False)
    return out


def bpe_run(data: Path, run_dir: Path, recipe: str = "gpt2", steps: int = 4, extra=()) -> Path:
    """A run of `recipe` on data, `steps` optimizer steps (validation and a checkpoint at the end)."""
    from gptlib.training.loop import train

    train(
        data,
        run_dir,
        overrides=SHAPE + [f"eval_interval={steps}", *extra],
        max_steps=steps,
        recipe=recipe,
        device="cpu",
        progress=False,
        log=lambda s: None,
    )
    return run_dir


def tree_digest(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(d).rglob("*"))
        if p.is_file()
    }
