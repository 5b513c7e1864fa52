"""Where things live. On Colab a run trains into the VM's fast disk and mirrors to Drive, which survives a
disconnect (docs/drive.md); elsewhere one root, `./` or $GPTLIB_ROOT. Nothing runs at import (no mounts, no prints).
"""

from __future__ import annotations

import errno
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from gptlib.errors import ConfigError, GptlibError, HungIOError
from gptlib.fsutil import DRIVE_ADVICE, call_with_timeout

DRIVE_MOUNT = Path("/content/drive")
COLAB_LOCAL_ROOT = Path("/content/gptlib_local")


def in_colab() -> bool:
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


DRIVE_CHECK_S = 30.0  # a mount that has not answered by then is hung: remounted


def _drive_usable() -> bool:
    """Mounted and answering: a dead FUSE mount raises ENOTCONN (or EIO) on any access, a hung one never returns
    (HungIOError, ETIMEDOUT: the setup cell waited forever)."""
    my_drive = DRIVE_MOUNT / "MyDrive"
    try:
        return call_with_timeout(my_drive.is_dir, DRIVE_CHECK_S, what=f"looking at {my_drive}")
    except OSError as e:
        if e.errno in (errno.ENOTCONN, errno.EIO, errno.ETIMEDOUT):
            return False
        raise


def mount_drive(timeout_s: float = 120.0) -> Path:
    """Mount Google Drive once (already mounted: a no-op); a dead or stale mount is remounted."""
    if not in_colab():
        raise GptlibError(
            "mount_drive() needs Google Colab; outside Colab use a local directory "
            "(gptlib.colab.setup() does this for you)"
        )
    if _drive_usable():
        return DRIVE_MOUNT
    from google.colab import drive  # noqa: PLC0415 - only exists on Colab

    try:  # force_remount: whatever is at the mount point (a dead FUSE mount, leftovers) is replaced
        drive.mount(str(DRIVE_MOUNT), force_remount=True, timeout_ms=int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - Colab raises ValueError/TimeoutError/others for a failed mount
        raise GptlibError(
            f"Google Drive did not mount at {DRIVE_MOUNT} ({type(e).__name__}: {e}). Re-run this cell and complete "
            f"the authorization prompt within {timeout_s:.0f} s; if it keeps failing, use Runtime > Restart "
            f"session, or, to work on the VM's disk only (lost at a disconnect), set os.environ['GPTLIB_ROOT'] = "
            f"'{COLAB_LOCAL_ROOT}' in the first cell and give no folder on Drive."
        ) from None
    if not _drive_usable():
        raise GptlibError(
            f"Google Drive mount at {DRIVE_MOUNT} finished but {DRIVE_MOUNT / 'MyDrive'} is not there; "
            f"re-run this cell (drive.mount(..., force_remount=True))"
        )
    return DRIVE_MOUNT


@dataclass
class Roots:
    persistent: Path  # survives a disconnect (Drive on Colab; the working dir elsewhere)
    local: Path  # fast scratch (VM disk on Colab; the same as persistent elsewhere)


@dataclass
class RunPaths:
    run_dir: Path  # where train() writes (fast local disk)
    # where checkpoints are copied (Drive), or None when run_dir persists itself
    mirror_dir: Path | None


def mount_for(path: str | Path, timeout_s: float = 120.0) -> None:
    """On Colab, mount Drive if `path` is on it (by its name: looking at the path would hang on a hung mount)."""
    if in_colab() and Path(os.path.abspath(path)).is_relative_to(os.path.abspath(DRIVE_MOUNT)):
        mount_drive(timeout_s)


def setup(use_drive: bool = True, timeout_s: float = 120.0) -> Roots:
    env_root, on_colab = os.environ.get("GPTLIB_ROOT"), in_colab()
    local = COLAB_LOCAL_ROOT if on_colab else Path(env_root or ".")
    default = DRIVE_MOUNT / "MyDrive/gptlib" if on_colab and use_drive else local
    roots = Roots(Path(env_root or default), local)
    # only a root on Drive needs it mounted: a GPTLIB_ROOT on the VM's disk gets no Drive prompt and no wait
    if use_drive:
        mount_for(roots.persistent, timeout_s)
    try:  # a Drive hung since the look at MyDrive: given up as that look is
        for d in {roots.persistent, roots.local}:
            mkdir = partial(d.mkdir, parents=True, exist_ok=True)
            call_with_timeout(mkdir, DRIVE_CHECK_S, what=f"creating {d}")
    except HungIOError as e:
        raise HungIOError(e.errno, f"{e.strerror}: {DRIVE_ADVICE}") from None
    return roots


def run_paths(name: str, roots: Roots | None = None) -> RunPaths:
    name, roots = _checked(name), roots or setup()
    mirror = roots.persistent / "runs" / name if roots.persistent != roots.local else None
    return RunPaths(roots.local / "runs" / name, mirror)


def drive_copy(run_dir: str | Path) -> Path | None:
    """On Colab, the Drive mirror of a run on the VM's disk (where notebooks 02/03 train it) if Drive is mounted; an
    OSError where Drive does not answer (hung: HungIOError; dropped), for the caller to say its rows stay on the VM."""
    local = Path(os.path.abspath(run_dir))
    if not in_colab() or local.parent != Path(os.path.abspath(COLAB_LOCAL_ROOT)) / "runs":
        return None
    # each look within the time limit: Drive not mounted gives none (no mount prompt)
    if not call_with_timeout((DRIVE_MOUNT / "MyDrive").is_dir, DRIVE_CHECK_S):
        return None
    mirror = run_paths(local.name).mirror_dir
    return mirror if mirror and call_with_timeout(mirror.is_dir, DRIVE_CHECK_S) else None


def data_dir(name: str, roots: Roots | None = None) -> Path:
    """Data lives on the persistent root (Drive on Colab), so tokenizing is done once."""
    return (roots or setup()).persistent / "data" / _checked(name)


def _checked(name: str) -> str:
    name = name.strip()  # pasted into a notebook's form with a space or a newline
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ConfigError(f"name {name!r}: use a plain directory name like 'shakespeare-char'")
    return name
