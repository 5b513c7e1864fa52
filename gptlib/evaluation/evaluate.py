"""eval: HellaSwag accuracy, and bits per byte (the validation loss in a unit no tokenizer can bend)."""

from __future__ import annotations

import math
import re
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import numpy as np
import torch

from gptlib import colab
from gptlib.batches import MemmapSplit, _to_ids
from gptlib.checkpoint.format import DRIVE_READ_STALL_S, model_sha256
from gptlib.data.shards import read_meta
from gptlib.data.tokenizer import Tokenizer, check_identity
from gptlib.errors import EvalError, GptlibError, in_notebook, loud
from gptlib.evaluation import hellaswag as hs
from gptlib.fsutil import append_jsonl, call_with_timeout, copy_rows, read_jsonl
from gptlib.inference.loading import (
    load_run,
    read_state_and_tokenizer,
    resolve_checkpoint,
    select_steps,
)
from gptlib.layout import EVAL_FILE, checkpoint_name, checkpoints_dir
from gptlib.runtime import resolve_device, resolve_dtype, unwrap_model

TASKS = ("hellaswag", "bpb")


def token_bytes(tok: Tokenizer) -> np.ndarray:
    """UTF-8 bytes of each token id's text, (vocab_size,) int64; 0 for special tokens. A byte-level BPE token is
    counted in symbols of GPT-2's byte alphabet: decoding a piece of a multi-byte character gives U+FFFD."""
    if tok.kind == "char":
        return np.array([len(ch.encode("utf-8")) for ch in tok.chars], dtype=np.int64)
    from tokenizers import pre_tokenizers

    out = np.zeros(tok.vocab_size, dtype=np.int64)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    special = {t.content for t in tok._tk.get_added_tokens_decoder().values()}
    for token, i in tok._tk.get_vocab(with_added_tokens=True).items():
        if token in special or i >= len(out):
            continue
        # a byte-level symbol string, else (another BPE flavour) its decoded text
        if all(c in alphabet for c in token):
            out[i] = len(token)
        else:
            out[i] = len(tok.decode([i]).encode("utf-8"))
    return out


def window_starts(n_tokens: int, block: int, limit: int | None) -> np.ndarray:
    """Starts of the non-overlapping windows (block inputs + 1 target): all, or `limit` evenly spaced ones."""
    n = (n_tokens - 1) // block
    if n <= 0:
        raise EvalError(
            f"the validation split has {n_tokens:,} tokens, fewer than one window of "
            f"block_size + 1 = {block + 1}"
        )
    return np.asarray(hs.select(n, limit), dtype=np.int64) * block


def evaluate_bpb(
    model,
    tok: Tokenizer,
    val_tokens,
    device,
    dtype=None,
    limit: int | None = None,
    batch_tokens: int | None = None,
    progress: bool = False,
) -> dict:
    """{bpb, bpb_se, loss, tokens, bytes, windows}: bpb = nats / ln 2 / UTF-8 bytes, special tokens (no bytes) left
    out of both sums, as nanochat does; bpb_se its standard error over the windows; loss = the mean nats over all
    targets. Each window's sums stay on the device until the end; each batch's windows are a blocking copy, so on a
    GPU the host waits once per batch."""
    device = torch.device(device)
    block = unwrap_model(model).config.block_size
    starts = torch.from_numpy(window_starts(len(val_tokens), block, limit))
    memmap = isinstance(val_tokens, MemmapSplit)
    ids = None if memmap else torch.as_tensor(np.asarray(val_tokens, dtype=np.int64))
    # every position goes through the output layer here: (B*T, V) float32 logits, so a quarter of the tokens
    per_batch = max(1, (batch_tokens or hs.default_batch_tokens(device) // 4) // block)
    tb = torch.from_numpy(token_bytes(tok)).to(device)
    # each window's nats (counted: of targets with bytes, all) and bytes
    sums = torch.zeros(3, len(starts), dtype=torch.float64, device=device)
    with hs.scoring(model, progress, total=len(starts), desc="bpb", unit="window") as (m, bar):
        for i, chunk in zip(range(0, len(starts), per_batch), starts.split(per_batch)):
            # (B, T + 1): each window and the token after it, read from disk or from memory
            # on Drive: each read within its time limit (a hung mount held the cell for good)
            if memmap:
                read = partial(val_tokens.gather_raw, chunk, block + 1)
                raw = call_with_timeout(read, DRIVE_READ_STALL_S, what="reading the val split")
                rows = _to_ids(raw).to(device)
            else:
                rows = ids[chunk[:, None] + torch.arange(block + 1)].to(device)
            y = rows[:, 1:]  # (B, T)
            nll, nb = hs.scored_nll(m, rows[:, :-1], y, dtype=dtype).double().view_as(y), tb[y]
            counted = (nll * (nb > 0)).sum(1)
            sums[:, i : i + len(chunk)] = torch.stack([counted, nll.sum(1), nb.sum(1).double()])
            bar.update(len(chunk))
    bits, nats_all, nbytes = sums.cpu().numpy()
    bits, total_bytes, tokens = bits / math.log(2), int(nbytes.sum()), len(starts) * block
    if total_bytes == 0:
        raise EvalError("the scored validation tokens carry no bytes (all special tokens?)")
    bpb, n = bits.sum() / total_bytes, len(starts)
    # a ratio of sums over windows: the standard error of the mean of bits - bpb x bytes, over the mean bytes
    se = np.std(bits - bpb * nbytes, ddof=1) / n**0.5 / nbytes.mean() if n > 1 else None
    return {
        "bpb": float(bpb),
        "bpb_se": None if se is None else float(se),
        "loss": float(nats_all.sum()) / tokens,
        "tokens": tokens,
        "bytes": total_bytes,
        "windows": n,
    }


def make_row(task: str, step: int, tokens_seen: int | None, result: dict, **extra) -> dict:
    """One eval.jsonl row (also training's)."""
    return {
        "task": task,
        "step": step,
        "tokens_seen": tokens_seen,
        **result,
        **extra,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _prepare(
    run_dir: Path, task: str, data, step: int, limit: int | None, file_option: str
) -> dict:
    """What can fail on bad input, checked before any model runs."""
    info = resolve_checkpoint(run_dir, step)
    # within a time limit: the run may be on Drive
    state, cfg, tok = read_state_and_tokenizer(run_dir, info.path)
    if task == "hellaswag":
        if data is not None and Path(data).is_dir():
            msg = f"{data} is a directory; for hellaswag give the jsonl file ({file_option})"
            raise EvalError(msg)
        # tokenized once, for every checkpoint of the run:
        items, file = hs.load_items(data, file_option=file_option)
        chosen = [items[i] for i in hs.select(len(items), limit)]
        # a run keeps its model config
        r = hs.render(chosen, tok, cfg.model.block_size)
        same = dict(data_sha256=file["sha256"], n=r.n, skipped=r.skipped)
        return {"file": file, "rendered": r, "same": same}
    if not (where := data or state.data_dir):
        raise EvalError(f"{info.path} records no data directory; pass --data DATA_DIR")
    # on Drive (the notebooks' datasets): each look and read within its time limit, as the checkpoint's
    timed = partial(call_with_timeout, timeout=DRIVE_READ_STALL_S, what=f"reading {where}")
    if data is not None and timed(Path(data).is_file):
        msg = f"--data {data} is a file; for bpb give the data directory (from `tokenize`)"
        raise EvalError(msg)
    # an older run's record: relative to the folder training ran in; else gone (deleted, a reset Colab VM's disk)
    if not data and not timed((d := Path(state.data_dir)).is_dir):
        gone, nb = d.is_absolute(), in_notebook()
        why = "which is gone: tokenize it there again" if gone else "relative to where training ran"
        # RUN/data, notebook 02's before 0.3.0: no notebook makes it again (02 makes the dataset RUN_NAME now)
        if gone and nb and d.name == "data" and d.parent.parent.name == "runs":
            why = "which is gone (notebook 02 before gptlib 0.3.0 kept it in the run, on Colab on the VM's disk): "
            why += "train the run on in notebook 02 (a larger MAX_STEPS), which keeps its data on Drive now, then "
            why += "evaluate again"
        # notebook 04's evaluate cell has no data setting: --data is the command line's way out only
        how = "" if gone and nb else f"{', or' if gone else ';'} pass --data DATA_DIR"
        raise EvalError(f"{info.path} records its data directory as {state.data_dir!r}, {why}{how}")
    meta = timed(partial(read_meta, where))
    needs = f"{meta.data_dir} (bits per byte needs {info.path}'s own validation data)"
    check_identity(tok, meta.tokenizer, needs)
    val, block = timed(partial(MemmapSplit, meta, "val")), cfg.model.block_size
    # its tokens, not the folder's path (Drive's, a VM's copy): one tokenized again holds others (BPB_WINDOWS: as many)
    same = dict(tokens_sha256=meta.identity()["tokens_sha256"])
    same["windows"] = len(window_starts(len(val), block, limit))
    return {"meta": meta, "val": val, "same": same}


def _rows_file(run_dir: Path, out, warn) -> tuple[Path, Path | None]:
    """RUN_DIR/eval.jsonl, else `out`: a new file or one of eval rows; and the Drive mirror to copy it to, as
    training's mirror does: a run on Colab's VM disk goes with the VM."""
    target = Path(out) if out is not None else run_dir / EVAL_FILE
    if out is not None and target.is_dir():
        raise EvalError(
            f"--out {out} is a directory; give a file to append the rows to, e.g. {target / EVAL_FILE}"
        )
    # rows go after eval rows only: appended to a meta.json, a corpus or metrics.jsonl, they broke it
    if out is not None and target.is_file() and target.stat().st_size:
        with open(target, "rb") as f:
            first = f.readline(1 << 16).decode(errors="replace")
        if not re.match(r'\{"task": "', first):
            raise EvalError(
                f"--out {out} holds something else than eval rows; give a new file or an eval.jsonl"
            )
    try:
        return target, colab.drive_copy(run_dir) if out is None else None
    except OSError as e:  # Drive hung or dropped: said once, as a failed copy is (_to_drive)
        warn(f"!! {target} stays on this VM, lost with it: its Drive copy was not found ({e})")
        return target, None


def _to_drive(target: Path, drive: Path | None, warn) -> Path | None:
    """eval.jsonl's rows copied to the Drive mirror's -> the mirror, else (none, or Drive failing: said once) None."""
    try:
        if drive is not None:
            # Drive's may hold rows of its own (notebook 04 on another VM): they stay
            rows = partial(copy_rows, target, drive / EVAL_FILE)
            call_with_timeout(rows, colab.DRIVE_CHECK_S, what=f"copying it to {drive}")
        return drive
    except OSError as e:  # the rows stand on this VM's disk
        warn(f"!! {target} not copied to the run's Drive copy {drive} ({e}): lost with this VM")
        return None


def evaluate_run(
    run_dir: str | Path,
    task: str,
    checkpoint: str | int = "latest",
    *,
    data: str | Path | None = None,
    limit: int | None = None,
    device: str = "auto",
    batch_tokens: int | None = None,
    progress: bool = True,
    out: str | Path | None = None,
    warn=loud,
    file_option: str = "--data FILE",
) -> list[dict]:
    """-> the rows, each reused from `out` (default RUN_DIR/eval.jsonl), else appended to it as computed; one that
    cannot be (read-only) costs no score: warn() names the file and the fix. file_option: how messages name the
    HellaSwag file."""
    run_dir, task = Path(run_dir), str(task).strip().lower()
    if task not in TASKS:
        raise EvalError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")
    if limit is not None and limit < 0:
        raise EvalError(f"--limit {limit} must be >= 0 (0 = everything)")
    target, drive = _rows_file(run_dir, out, warn)
    steps = select_steps(run_dir, checkpoint)
    dev = resolve_device(device)
    # fp32 weights under this autocast, as training's validation loss
    dt = resolve_dtype("auto", dev)
    prep, rows, unsaved = _prepare(run_dir, task, data, steps[-1], limit, file_option), [], 0
    # a re-run (notebook 04's Run all) reuses a row recorded for the same weights (not just step) and settings
    recorded, reused, dtype = read_jsonl(target), [], str(dt).replace("torch.", "")
    for step in steps:
        path = checkpoints_dir(run_dir) / checkpoint_name(step)
        try:
            sha = model_sha256(path)
            same = dict(task=task, step=step, model_sha256=sha, dtype=dtype, **prep["same"])
            if old := next((r for r in reversed(recorded) if same.items() <= r.items()), None):
                rows, reused = rows + [old], reused + [step]
                continue
            lm = load_run(run_dir, step, device=dev)
        except (GptlibError, OSError):
            # not one a run still training deleted (keep_last) since the listing: the others are scored all the same
            if path.exists():
                raise
            warn(f"step {step}: gone since it was listed (training rotates old ones); passed over")
            continue
        t0 = time.perf_counter()
        if task == "hellaswag":
            desc = f"hellaswag step {step}"
            res = hs.evaluate_rendered(
                lm.model, prep["rendered"], dev, dt, batch_tokens, progress, desc=desc
            )
            result = hs.row_fields(res, prep["file"])
        else:
            result = evaluate_bpb(
                lm.model, lm.tokenizer, prep["val"], dev, dt, limit, batch_tokens, progress
            )
            result.update(n=result["windows"], data=str(prep["meta"].data_dir), **prep["same"])
        where = dict(checkpoint=str(lm.path), device=str(dev), dtype=dtype, model_sha256=sha)
        seconds = round(time.perf_counter() - t0, 3)
        rows.append(make_row(task, step, lm.state.tokens_seen, result, **where, seconds=seconds))
        del lm  # before the next checkpoint loads
        try:
            append_jsonl(target, rows[-1])
        # the score is computed: keep going, say it once at the end (the rows are returned)
        except OSError as e:
            unsaved, error = unsaved + 1, e
        drive = _to_drive(target, drive, warn)
    if reused:
        warn(
            f"{task}: reused the rows {target} records for step{'s' * (len(reused) > 1)} {', '.join(map(str, reused))} "
            f"(the same checkpoint and settings); {len(rows) - len(reused)} scored now; delete a row to score it again"
        )
    if unsaved:
        warn(
            f"warning: {unsaved} row{'s' if unsaved > 1 else ''} not saved: cannot append to {target}: "
            f"{error.strerror or error}; add --out FILE (evaluate_run(..., out=FILE)) to append the rows to another "
            f"file"
        )
    return rows


# Each task's columns: (eval.jsonl field, header, format); a field with a standard error (FIELD_se) shows it after ±
COLUMNS = {
    "bpb": [
        ("bpb", "val bpb", "{:.4f}"),
        ("loss", "nats/token", "{:.4f}"),
        ("windows", "windows", "{:,}"),
        ("tokens", "tokens", "{:,}"),
    ],
    "hellaswag": [
        ("acc_norm", "HellaSwag acc_norm", "{:.4f}"),
        ("acc", "acc", "{:.4f}"),
        ("n", "items", "{:,}"),
        ("truncated", "truncated", "{:,}"),
        ("skipped", "skipped", "{:,}"),
    ],
}


def noise_lines(by_step: dict[int, dict], tasks: list[str]) -> list[str]:
    """Each task's first figure, the newest two checkpoints that have its standard error: their difference is within
    noise under 2 x the combined standard error sqrt(se_a^2 + se_b^2), else the better checkpoint is named."""
    lines, oldest_first = [], sorted(by_step.items())
    for t in tasks:
        k, name, _ = COLUMNS[t][0]
        had = [(s, d[t]) for s, d in oldest_first if d.get(t, {}).get(f"{k}_se") is not None]
        if len(had) < 2:
            continue
        (sa, a), (sb, b) = had[-2:]
        diff, bound = b[k] - a[k], 2 * math.hypot(a[f"{k}_se"], b[f"{k}_se"])
        # lower bits per byte, higher accuracy
        better = sb if (diff < 0) == (k == "bpb") else sa
        verdict = "within noise" if abs(diff) < bound or diff == 0 else f"step {better:,} is better"
        lines.append(
            f"{name}, step {sb:,} - step {sa:,}: {diff:+.4f}; 2 x combined standard error {bound:.4f}: {verdict}"
        )
    return lines


def format_table(rows: list[dict]) -> str:
    """A line per checkpoint, each task's newest result, ± its standard error; with HellaSwag, GPT-2 124M's figures
    for reference; the newest two checkpoints compared."""

    def cell(row: dict, k: str, f: str) -> str:
        se = "" if row.get(f"{k}_se") is None else f" ± {row[f'{k}_se']:.4f}"
        return "-" if row.get(k) is None else f.format(row[k]) + se

    by_step: dict[int, dict] = {}
    for r in rows:
        by_step.setdefault(r["step"], {"tokens_seen": r.get("tokens_seen")})[r.get("task")] = r
    tasks = [t for t in COLUMNS if any(r.get("task") == t for r in rows)]
    cols = [(t, *c) for t in tasks for c in COLUMNS[t]]
    table = [["checkpoint", "tokens seen", *(h for _, _, h, _ in cols)]]
    for step, d in sorted(by_step.items()):
        scores = [cell(d.get(t, {}), k, f) for t, k, _, f in cols]
        table.append([f"step {step:,}", cell(d, "tokens_seen", "{:,}"), *scores])
    if "hellaswag" in tasks:
        gpt2 = [cell(hs.GPT2_124M if t == "hellaswag" else {}, k, f) for t, k, _, f in cols]
        table.append(["GPT-2 124M (OpenAI)", "-", *gpt2])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += noise_lines(by_step, tasks)
    lines.append("± the standard error (HellaSwag: binomial over the items; bpb: over windows)")
    # beside training's val loss of the same weights (a checkpoint's label): which is which
    if "bpb" in tasks:
        lines.append(
            "val bpb, nats/token: on the windows column's windows (block_size tokens each) of the val split; "
            "a checkpoint's \"val\" (its label, metrics.jsonl) is training's validation, on its own fixed "
            "batches: another sample, so the two differ a little"
        )
    if "hellaswag" in tasks:
        lines.append(f"GPT-2 124M: {hs.GPT2_124M['source']}; chance on HellaSwag is 0.25")
    return "\n".join(lines)
