"""Training never reads Google Drive: a dataset under the Drive mount is first copied to the VM's disk (reading
shards over FUSE mid-training stalls steps), every file checked against meta.json's sha256 while copied. Anything
that goes wrong is one line, and training reads Drive as before (docs/data.md)."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Callable

from filelock import FileLock  # a dependency of torch and huggingface_hub

import gptlib.colab as colab
from gptlib.data.shards import META_FILE, read_meta
from gptlib.errors import HungIOError, in_notebook, loud
from gptlib.fsutil import (
    Progress,
    atomic_write_json,
    call_with_timeout,
    check_dir,
    copy_hashing,
    fsync_dir,
    read_bytes_with_timeout,
)
from gptlib.layout import TOKENIZER_FILE

MARKER_FILE = ".gptlib-staged.json"  # written last, after every file of the copy verified
# left free on the VM's disk for the run's checkpoints (gpt2-small: 1.33 GB each)
KEEP_FREE_BYTES = 10 << 30
STALL_S = 120.0  # a Drive read that makes no progress for this long is abandoned (hung mount): read Drive later


# why the local copy was given up, naming the file; never leaves the module
class StagingFailed(Exception):
    pass


def stage_for_training(
    data_dir: str | Path, enabled: bool = True, log: Callable[[str], None] = print
) -> Path:
    """What train() reads: the verified local copy of a data dir on the Drive mount (made now, or earlier on this VM),
    or data_dir itself (not on Drive, or the copy failed). Not a finished dataset: read_meta's DataFormatError."""
    # a file or a symlink loop: one line, before anything else
    check_dir(data_dir, "data directory")
    src = Path(data_dir).resolve()
    if not enabled or not src.is_relative_to(colab.DRIVE_MOUNT.resolve()):
        return Path(data_dir)
    dst = colab.COLAB_LOCAL_ROOT / "data" / src.name
    try:
        meta_bytes = read_bytes_with_timeout(src / META_FILE, STALL_S)
    # a hung Drive, said as it is: read_meta would read it again, with no time limit
    except HungIOError:
        raise
    except OSError:
        read_meta(src)  # missing or unreadable: its own clear error
        raise
    meta_sha = hashlib.sha256(meta_bytes).hexdigest()
    dst.parent.mkdir(parents=True, exist_ok=True)
    # one process copies at a time (torchrun's ranks, two notebooks): the others wait, then reuse its copy
    with FileLock(dst.parent / f".{src.name}.lock"):
        if _reusable(dst, src, meta_sha):
            log(f"data: using the verified local copy {dst} of {src} (made earlier on this VM)")
            return dst
        shutil.rmtree(dst, ignore_errors=True)  # an older or partial copy
        t0 = time.time()
        try:
            files = _files_of(src, meta_bytes, meta_sha)
            need, free = sum(size for _, size, _ in files), shutil.disk_usage(dst.parent).free
            if need + KEEP_FREE_BYTES > free:
                loud(
                    f"!! data: {_gb(need)} does not fit on the VM's disk ({_gb(free)} free at {dst.parent}, keeping "
                    f"{_gb(KEEP_FREE_BYTES)} for checkpoints); training reads {src} from Google Drive (slower)"
                )
                return src
            dst.mkdir(parents=True)
            for name, _, sha in files:
                _copy_verified(src / name, dst / name, sha)
            fsync_dir(dst)
            atomic_write_json(
                dst / MARKER_FILE,
                {
                    "source": str(src),
                    "meta_sha256": meta_sha,
                    "files": {name: size for name, size, _ in files},
                    "verified_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                },
            )
        except (StagingFailed, OSError) as e:
            shutil.rmtree(dst, ignore_errors=True)
            loud(
                f"!! data: {e}; the local copy was deleted and training reads {src} from Google Drive (slower)"
            )
            return src
        dt = time.time() - t0
        log(
            f"data: copied {src} to the VM's disk ({dst}): {_gb(need)} in {dt:.1f} s "
            f"({need / max(dt, 1e-9) / 1e6:,.0f} MB/s), every file checked against meta.json's sha256"
        )
        return dst


def _gb(n: int | float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def _files_of(src: Path, meta_bytes: bytes, meta_sha: str) -> list[tuple[str, int, str | None]]:
    """(name, size, the sha256 meta.json expects or None) of every file, after read_meta's checks."""
    meta = read_meta(src)
    tok = meta.tokenizer.get("file", TOKENIZER_FILE)
    files = [
        (META_FILE, len(meta_bytes), meta_sha),
        (tok, (src / tok).stat().st_size, meta.tokenizer.get("hash")),
    ]
    for split in meta.splits.values():
        for shard in split["shards"]:
            files.append(
                (shard["file"], int(shard["tokens"]) * meta.dtype.itemsize, shard.get("sha256"))
            )
            spans = shard.get("spans")
            if isinstance(spans, dict) and "file" in spans:
                files.append((spans["file"], int(spans["count"]) * 16, spans.get("sha256")))
    return files


def _reusable(dst: Path, src: Path, meta_sha: str) -> bool:
    """Its marker names this meta.json, and every size is right."""
    try:
        marker = json.loads((dst / MARKER_FILE).read_text())
        return (
            marker.get("meta_sha256") == meta_sha
            and marker.get("source") == str(src)
            and all((dst / name).stat().st_size == size for name, size in marker["files"].items())
        )
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return False


def _copy_verified(src: Path, dst: Path, sha: str | None) -> None:
    progress = Progress()
    _, got = call_with_timeout(
        lambda: copy_hashing(src, dst, progress), STALL_S, progress, what=f"reading {src}"
    )
    if sha is not None and got != sha:
        how = "--overwrite"
        if in_notebook():
            how = "OVERWRITE = True in notebook 01 (notebook 05's data: delete the folder, then run notebook 05 again)"
        raise StagingFailed(
            f"{src} does not match meta.json: sha256 {got[:16]}... read, {sha[:16]}... expected (the "
            f"file on Drive is damaged or was changed after tokenizing; tokenize again to repair it: {how})"
        )
