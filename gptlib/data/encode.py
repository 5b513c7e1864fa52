"""The tokenizing pass (pieces -> batches encoded on all cores -> train/val shards). The state is saved at every
completed shard with the input position of the batch that completed it: a resume redoes that batch, same bytes."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
from filelock import FileLock, Timeout

import gptlib.colab as colab
from gptlib.data.conversations import EXAMPLES_KEPT, ChatTemplate
from gptlib.data.hub import unlisted
from gptlib.data.inputs import Source, invalid_utf8
from gptlib.data.shards import META_FILE, PREPARE_STATE_FILE, ShardWriter, dtype_for_vocab
from gptlib.data.sources import Piece, iter_corpus
from gptlib.data.tokenizer import TOKENIZER_FILE, BPETokenizer, Tokenizer
from gptlib.errors import PrepareError, RunDirError, again, loud
from gptlib.fsutil import (
    DRIVE_ADVICE,
    TMP_MARKER,
    atomic_write_json,
    call_with_timeout,
    cannot_write,
    check_dir,
    clean_temp_files,
    read_bytes_with_timeout,
)
from gptlib.layout import CHECKPOINTS_DIR, CONFIG_FILE, LEASE_FILE, METRICS_FILE, OVERWRITE_DIR

BATCH_CHARS = 4 << 20  # text per encode_batch call: big enough for all cores, small in memory
LOCK_FILE = ".tokenize.lock"  # held by the tokenize writing the directory
# data directories whose lock this process holds (one_writer's; after a run, its clean-up stuck on a hung Drive)
_HELD: set[str] = set()


def to_array(parts: list, dtype: np.dtype) -> np.ndarray:
    # a C-speed slice assignment per part: np.concatenate would first make an array of each BPE id list
    out = np.empty(sum(map(len, parts)), dtype=dtype)
    i = 0
    for p in parts:
        out[i : i + len(p)] = p
        i += len(p)
    return out


class Batch(NamedTuple):  # with the reader's counters as they stood right after reading its pieces
    pieces: list[Piece]
    invalid_utf8: int
    skipped_files: list
    invalid_utf8_files: list


class Pass:
    """From progress["resume"] on, updating progress["emitted"] and ["stats"] in place. After run(), `writers` hold
    the last shards (not yet flushed) and `stopped` says where max_tokens stopped the pass (None: at the end)."""

    def __init__(
        self,
        out_dir: Path,
        spec: dict,
        tok: Tokenizer,
        identity: dict,
        sources: list[Source],
        progress: dict,
    ):
        self.out_dir = out_dir
        self.spec, self.identity, self.sources, self.tok = spec, identity, sources, tok
        self.template = ChatTemplate(tok) if spec.get("format") == "chat" else None
        self.resume = progress["resume"]
        self.emitted = progress["emitted"]
        self.stats = progress["stats"]
        self.max_tokens = spec.get("max_tokens")
        # plain text (split "tail") is read whole whatever the budget: a bar of tokens stood at 100% through it
        self.bar_tokens = None if spec["split"] == "tail" else self.max_tokens
        self.stopped: dict | None = None
        self.threshold = int(spec["val_fraction"] * 2**64)
        invalid_utf8.count = int(self.stats["replaced_invalid_utf8"])
        self.batch_start = {
            "pos": dict(self.resume),
            "emitted": dict(self.emitted),
            "stats": copy.deepcopy(self.stats),
        }
        self.dtype = dtype_for_vocab(tok.vocab_size)
        # skip: tokens between the resume position and the end of the last completed shard.
        done = progress["shards"]
        self.writers = {
            s: ShardWriter(
                out_dir,
                s,
                self.dtype,
                spec["shard_tokens"],
                done[s],
                on_full=self.on_full,
                skip=sum(x["tokens"] for x in done[s]) - self.emitted[s],
                with_spans=self.template is not None,
            )
            for s in ("train", "val")
        }
        self.save_state()  # marks out_dir as this run's, before the first shard

    def save_state(self) -> None:
        """As it stood before the current batch."""
        b = self.batch_start
        atomic_write_json(
            self.out_dir / PREPARE_STATE_FILE,
            {
                "spec": self.spec,
                "tokenizer": self.identity,
                "resume": b["pos"],
                "emitted": b["emitted"],
                "stats": b["stats"],
                "shards": {s: w.shards for s, w in self.writers.items()},
            },
        )

    def on_full(self, w: ShardWriter) -> None:
        # Cut the other split too: everything before this batch is in completed shards and a resume restarts here.
        for other in self.writers.values():
            if other is not w:
                other.flush()
        self.save_state()

    def doc_split(self, fi: int, doc: int) -> str:
        h = hashlib.blake2b(f"{self.sources[fi].key}:{doc}".encode(), digest_size=8).digest()
        return "val" if int.from_bytes(h, "little") < self.threshold else "train"

    def run(self, column: str, verbose: bool) -> None:
        """Each batch is encoded on a worker thread (the library releases the GIL) while this one stores the previous
        and reads the next; stored as if one at a time: a read error comes after the batch before it is stored, and a
        max_tokens stop drops the batch read ahead."""
        from tqdm.auto import tqdm

        spec = self.spec
        batches = self.batches(
            iter_corpus(
                self.sources,
                self.resume,
                self.stats["skipped_files"],
                spec["split"],
                spec["val_fraction"],
                column,
                spec.get("format", "text"),
            )
        )
        self.tokens_run, self.t_run = 0, time.time()
        with (
            tqdm(
                total=self.bar_tokens or sum(s.size for s in self.sources),
                initial=self.counted(),
                unit="tok" if self.bar_tokens else "B",
                unit_scale=True,
                unit_divisor=1000,
                desc="tokenize",
                disable=not verbose,
                mininterval=0.5,
                smoothing=0.1,
            ) as self.bar,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="gptlib-encode") as pool,
        ):
            held = None  # (batch, its ids being encoded)
            while True:
                try:
                    batch = next(batches, None)
                except BaseException:
                    if held is None or not self.store(*held):
                        raise
                    break  # one batch at a time would have stopped before this read
                ahead = None if batch is None else (batch, pool.submit(self.encode, batch.pieces))
                if (held is not None and self.store(*held)) or ahead is None:
                    break
                held = ahead
            # The data or max_tokens ended the pass: the bar ends complete at the true count (a notebook draws a
            # bar closed short of its total red, as a failure: 05's MAX_TOKENS "20M" of 13.5K tokens of data).
            self.bar.total = self.bar.n = self.counted()

    def counted(self) -> int:
        """What the bar counts: tokens towards max_tokens (so that tqdm's ETA is the one that matters), else bytes."""
        return sum(self.emitted.values()) if self.bar_tokens else int(self.stats["bytes"])

    def store(self, batch: Batch, ids) -> bool:
        """-> whether max_tokens stopped the pass in this batch; if so the reader's counters go back to where they stood
        after it."""
        self.run_batch(batch, ids.result())
        if self.stopped:
            invalid_utf8.count = batch.invalid_utf8
            self.stats["skipped_files"][:] = batch.skipped_files  # the list iter_corpus appends to
        return bool(self.stopped)

    def batches(self, pieces_iter) -> Iterator[Batch]:
        pieces, n_chars, seen = [], 0, invalid_utf8.count
        # the files read with invalid UTF-8 (as keys, in order): the warning names them, to be saved as UTF-8
        bad = dict.fromkeys(self.stats.get("invalid_utf8_files", []))
        for piece in pieces_iter:
            if invalid_utf8.count > seen:  # the count grew as this piece was read: its file's
                bad[str(self.sources[piece.pos["file"]].path)] = seen = invalid_utf8.count
            pieces.append(piece)
            n_chars += len(piece.text)
            if n_chars >= BATCH_CHARS:
                yield Batch(pieces, invalid_utf8.count, list(self.stats["skipped_files"]), [*bad])
                pieces, n_chars = [], 0
        if pieces:
            yield Batch(pieces, invalid_utf8.count, list(self.stats["skipped_files"]), [*bad])

    def encode(self, pieces: list[Piece]) -> list:
        if isinstance(self.tok, BPETokenizer):
            return self.tok.encode_batch_ids([p.text for p in pieces])
        # arrays: a batch of Python ints would be ~7x the memory; an unknown character's error names its file
        return [self.tok.encode_array(p.text, f"in {self._where(p)}") for p in pieces]

    def _where(self, p: Piece) -> str:
        src = self.sources[p.pos["file"]]  # pos["file"] is the piece's own file
        return str(src.path) if src.kind == "text" else f"{src.path} record {p.doc + 1}"

    def run_batch(self, batch: Batch, ids: list) -> None:
        parts: dict[str, list] = {"train": [], "val": []}
        spans: dict[str, list] = {"train": [], "val": []}
        count = {"train": 0, "val": 0}  # tokens of this batch per split so far
        total0, stats, eot = sum(self.emitted.values()), self.stats, self.tok.eot_id
        nbytes = 0.0
        for p, x in zip(batch.pieces, ids):
            nbytes += p.nbytes
            if p.malformed is not None:
                stats["malformed_conversations"] = stats.get("malformed_conversations", 0) + 1
                if len(examples := stats.setdefault("malformed_examples", [])) < EXAMPLES_KEPT:
                    where = str(self.sources[p.pos["file"]].path)
                    # counted from 1: a jsonl line number, as in tokenize's other messages
                    examples.append({"path": where, "record": p.doc + 1, "reason": p.malformed})
                continue
            # pos["file"] is the piece's own file
            s = p.split or self.doc_split(p.pos["file"], p.doc)
            if self.template is not None and p.role is not None:
                x, span = self.template.piece_ids(p, x)
                if span is not None:
                    spans[s].append((count[s] + span[0], count[s] + span[1]))
            parts[s].append(x)
            count[s] += len(x)
            stats["characters"] += len(p.text)
            if p.doc_end:
                # empty: a blank line, null or ""
                stats["documents" if p.text else "empty_documents"] += 1
                if p.text and eot is not None:
                    parts[s].append([eot])
                    count[s] += 1
                if self.max_tokens is not None and total0 + sum(count.values()) >= self.max_tokens:
                    where = str(self.sources[p.pos["file"]].path)
                    self.stopped = {"file": where, "document": p.doc}
                    break
        for s in ("train", "val"):
            sp = None
            if self.template is not None:
                sp = np.array(spans[s], dtype=np.int64).reshape(-1, 2)
                assistant = stats.setdefault("assistant_tokens", {"train": 0, "val": 0})
                assistant[s] += int((sp[:, 1] - sp[:, 0]).sum())
            self.writers[s].write(to_array(parts[s], self.dtype), sp)
            self.emitted[s] += count[s]
        self.tokens_run += sum(count.values())
        stats["bytes"] += nbytes
        stats["replaced_invalid_utf8"] = batch.invalid_utf8
        stats["invalid_utf8_files"] = batch.invalid_utf8_files
        # float per-row shares may overshoot
        advance = sum(count.values()) if self.bar_tokens else nbytes
        self.bar.update(max(0.0, min(advance, self.bar.total - self.bar.n)))
        if not self.bar_tokens:  # a bar of bytes: the tokens too
            rate = self.tokens_run / max(1e-9, time.time() - self.t_run)
            tokens = f"{sum(self.emitted.values()) / 1e6:,.1f}M tokens, {rate / 1e3:,.0f}K tok/s"
            self.bar.set_postfix_str(tokens, refresh=False)
        # The next batch starts after the last piece of this one, with the reader's counters as they were then.
        self.batch_start = {
            "pos": dict(p.pos),
            "emitted": dict(self.emitted),
            "stats": copy.deepcopy({**stats, "skipped_files": batch.skipped_files}),
        }


def our_files(out_dir: Path) -> list[Path]:
    """The only files tokenize deletes as old (not the lock file: another tokenize may be waiting on it; the
    holder removes it as it ends, one_writer)."""
    names = {META_FILE, PREPARE_STATE_FILE, TOKENIZER_FILE}
    ours = []
    for p in out_dir.iterdir():
        shard = p.suffix == ".bin" and p.name.split("_")[0] in ("train", "val")
        if p.is_file() and (p.name in names or shard or TMP_MARKER in p.name):
            ours.append(p)
    return ours


def replace_dataset(out_dir: Path) -> dict:
    """--overwrite's new dataset, complete in OVERWRITE_DIR, takes the old one's place -> its meta.json. The old
    meta.json goes first and the new one comes last, so that a meta.json there names a whole dataset; a kill half-way
    is ended by the next tokenize in out_dir (each step may be done again)."""
    new = out_dir / OVERWRITE_DIR
    m = json.loads((new / META_FILE).read_text())
    shards = [s for split in m["splits"].values() for s in split["shards"]]
    names = [TOKENIZER_FILE, *(r["file"] for s in shards for r in (s, s.get("spans")) if r)]
    (out_dir / META_FILE).unlink(missing_ok=True)
    for p in our_files(out_dir):
        if p.name not in names:  # the old shards past the new one's last
            p.unlink()
    for name in [*names, META_FILE]:
        if (new / name).is_file():  # not moved before a kill
            os.replace(new / name, out_dir / name)
    shutil.rmtree(new, ignore_errors=True)
    return m


def check_output_dir(out_dir: Path) -> None:
    """Refuse a file, a training run, or a directory holding files tokenize did not write (even with overwrite)."""
    if not check_dir(out_dir, "--out"):
        return
    run = [n for n in (CHECKPOINTS_DIR, CONFIG_FILE, METRICS_FILE) if (out_dir / n).exists()]
    if run:
        raise PrepareError(
            f"--out {out_dir} is a training run directory (it holds {', '.join(run)}): tokenizing "
            f"there would replace the run's tokenizer.json; give the data a directory of its own, "
            f"e.g. {out_dir / 'data'}"
        )
    ours = set(our_files(out_dir))
    # lease.json: an older gptlib's tokenize held one; .DS_Store, Thumbs.db: the desktop's, where Drive syncs it
    skip = {*ours, *(out_dir / n for n in (LOCK_FILE, LEASE_FILE))}
    foreign = sorted(p.name for p in out_dir.iterdir() if p not in skip and not unlisted(p.name))
    if foreign:
        raise PrepareError(
            f"--out {out_dir} holds files tokenize did not write ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); choose an empty or new directory"
        )


def _kept(out_dir: Path) -> str:
    """What an unfinished run in out_dir keeps, and how to go on; "" before its first shard or unreadable."""
    for d in (out_dir / OVERWRITE_DIR, out_dir):  # an --overwrite's run is in OVERWRITE_DIR
        try:  # on the Drive a write just gave up on as hung, maybe: the same limit as a mount check
            state = read_bytes_with_timeout(d / PREPARE_STATE_FILE, colab.DRIVE_CHECK_S)
            shards = json.loads(state)["shards"]
            done = " and ".join(f"{len(shards[s])} {s}" for s in ("train", "val") if shards[s])
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError):
            return ""
        old = f" and the dataset in {out_dir} is unchanged" if d != out_dir else ""
        return done and f"{done} shard(s) of {d} are kept{old}; {again()} to continue from there"
    return ""


@contextlib.contextmanager
def one_writer(out_dir: Path) -> Iterator[None]:
    """A second tokenize in out_dir raises RunDirError. The OS frees the lock of a process that ends, killed or not:
    nothing to take over or check while it runs. Ctrl-C: one line saying what is kept."""
    created = not out_dir.exists()
    # not thread-local: released by the clean-up's thread below
    lock = FileLock(out_dir / LOCK_FILE, thread_local=False)
    try:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            lock.acquire(timeout=0)
            _HELD.add(os.path.abspath(out_dir))
        except Timeout:
            if os.path.abspath(out_dir) in _HELD:  # a notebook's re-run: not another process
                raise RunDirError(
                    f"{out_dir} is still held by the last tokenize in this process (a notebook's kernel), its "
                    f"clean-up stuck on a Google Drive that does not answer: {DRIVE_ADVICE}"
                ) from None
            raise RunDirError(
                f"{out_dir} is in use by another tokenize process; wait for it to finish or stop it, then "
                f"{again()} (it continues its work)"
            ) from None
        except OSError as e:
            if not (out_dir / META_FILE).is_file():
                raise cannot_write(out_dir, e) from None
            # a finished dataset on a read-only disk: reused as before, with no writer to keep out
        yield
    except KeyboardInterrupt:
        # a write cut right after creating its temp file; while the lock is held, all ours
        for d in (out_dir, out_dir / OVERWRITE_DIR):
            clean_temp_files(d)
        first = f"tokenize stopped before its first shard was written; {again()} to start over"
        loud(f"tokenize stopped: {kept}" if (kept := _kept(out_dir)) else first)
        raise
    # a write or rename in out_dir (Drive full or dropped), not one naming another file (an input) or with no errno
    # (pyarrow's, a network drop's)
    except OSError as e:
        # by absolute paths: a rename names its temp file so (tempfile's), whatever --out was given
        named = e.filename and Path(os.path.abspath(e.filename)).parents
        if e.errno is None or named and Path(os.path.abspath(out_dir)) not in named:
            raise
        raise cannot_write(out_dir, e, (kept := _kept(out_dir)) and f"; {kept}") from None
    finally:
        # on a hung Drive (a write given up) the clean-up there would hang too: given up the same way; on a dropped
        # one it fails as the write did: neither replaces the outcome
        with contextlib.suppress(OSError):
            call_with_timeout(lambda: _unlock(lock, out_dir, created), colab.DRIVE_CHECK_S)


def _unlock(lock: FileLock, out_dir: Path, created: bool) -> None:
    # removed while held, so that a data directory holds only its dataset; released even if that fails (a re-run in
    # this process, the Drive back, would be refused as another tokenize's)
    if lock.is_locked:  # not a run refused as the lock was held (by this process, too)
        with contextlib.suppress(OSError):
            (out_dir / LOCK_FILE).unlink(missing_ok=True)
        lock.release()
        _HELD.discard(os.path.abspath(out_dir))  # not if the release failed: still held
    if created:  # refused before writing anything: no empty directory is left
        with contextlib.suppress(OSError):
            out_dir.rmdir()
