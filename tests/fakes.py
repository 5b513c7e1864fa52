"""Fakes for what cannot exist in tests: the Hugging Face Hub, a network that drops, Colab.

- FakeHub: an fsspec filesystem that answers like huggingface_hub's HfFileSystem for
  `datasets/OWNER/NAME[@REV]/path`, backed by a local directory root/OWNER/NAME/<rev>/...
  (rev "main" by default; refs/convert/parquet is the directory "refs%2Fconvert%2Fparquet"). Its
  listings carry `lfs.sha256` for parquet files as the Hub's do; a missing repository raises
  FileNotFoundError from a real RepositoryNotFoundError, a repository with a `.gated` file refuses
  reads with a real GatedRepoError. It counts opens and can drop reads (faults). install_fake_hub puts
  it in fsspec's registry as the "hf" protocol, where huggingface_hub puts HfFileSystem: gptlib's own
  code asks fsspec for it, as it does for the real Hub.
- FaultyFS (protocol "faulty"): the local filesystem, whose files raise ConnectionResetError on the
  reads listed in `FAULTS` (numbered across all files) and log every read's offset.
- colab_vm: code for a notebook's kernel (tests/nbrun.py's `code`) that makes it a Colab VM: `google.colab`, whose
  drive.mount maps a folder (Drive: the same for every VM), and a VM disk of its own.
"""

from __future__ import annotations

import hashlib
import io
import re
import sys
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

CONVERTED_DIR = "refs%2Fconvert%2Fparquet"


class Faults:
    """Which reads fail: numbers in `at` (1-based, across all files), or every read from `all_from` on."""

    def __init__(self):
        self.reset()

    def reset(self, at=(), all_from=None):
        self.at = set(at)
        self.all_from = all_from
        self.reads = 0
        self.log: list[
            tuple[str, int]
        ] = []  # ("open", 0) | ("read", offset) | ("fault", offset), in order
        self.failed = 0


FAULTS = Faults()


class _FaultyFile(io.RawIOBase):
    def __init__(self, path: str, faults: Faults):
        super().__init__()
        self._f = open(path, "rb", buffering=0)
        self._path = path
        self._faults = faults
        faults.log.append(("open", 0))

    def readinto(self, b) -> int:
        fl = self._faults
        fl.reads += 1
        if fl.reads in fl.at or (fl.all_from is not None and fl.reads >= fl.all_from):
            fl.failed += 1
            fl.log.append(("fault", self._f.tell()))
            raise ConnectionResetError(f"connection reset by peer (injected, read {fl.reads})")
        fl.log.append(("read", self._f.tell()))
        return self._f.readinto(b)

    def seek(self, offset, whence=0):
        return self._f.seek(offset, whence)

    def tell(self):
        return self._f.tell()

    def readable(self):
        return True

    def seekable(self):
        return True

    def close(self):
        self._f.close()
        super().close()


class FaultyFS(LocalFileSystem):
    """faulty:///abs/path: the local file system with injected read errors (FAULTS)."""

    protocol = "faulty"

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        return _FaultyFile(self._strip_protocol(path), FAULTS)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("faulty://"):
            path = path[len("faulty://") :]
        return LocalFileSystem._strip_protocol(path)

    def unstrip_protocol(self, name):
        return "faulty://" + name


fsspec.register_implementation("faulty", FaultyFS, clobber=True)


def _hub_error(cls_name: str, url: str, status: int):
    """A real huggingface_hub error (as HfFileSystem raises them), with an HTTP response of `status`."""
    import huggingface_hub
    import huggingface_hub.errors as errors

    # 0.x (beside transformers 4) speaks requests
    if int(huggingface_hub.__version__.split(".")[0]) < 1:
        import requests

        resp = requests.Response()
        resp.status_code, resp.url, resp.request = (
            status,
            url,
            requests.Request("GET", url).prepare(),
        )
    else:
        try:
            import httpx2 as httpx  # what this huggingface_hub uses
        except ImportError:
            import httpx
        resp = httpx.Response(status, request=httpx.Request("GET", url))
    return getattr(errors, cls_name)(
        f"{status} Client Error: {cls_name} for url: {url}", response=resp
    )


class FakeHub(AbstractFileSystem):
    """See the module docstring. `token` is what the code under test passed."""

    protocol = "hf"
    root_marker = ""
    cachable = False

    def __init__(self, root: Path, token=None, faults: Faults | None = None):
        super().__init__()
        self.root = Path(root)
        self.token = token
        self.faults = faults
        self.opened: list[str] = []

    def _parse(self, path: str) -> tuple[str, str, str | None, str | None]:
        path = self._strip_protocol(path)
        m = re.fullmatch(
            r"datasets/([^/@]+)/([^/@]+)(?:@(refs/convert/[\w.-]+|[^/]+))?(?:/(.*))?",
            path.rstrip("/"),
        )
        if not m:
            raise FileNotFoundError(path)
        return m.groups()

    def _local(self, path: str) -> Path:
        """datasets/OWNER/NAME[@REV][/path] -> the local path (Hub errors for a missing repo/revision)."""
        owner, name, rev, rest = self._parse(path)
        repo = self.root / owner / name
        url = f"https://huggingface.co/api/datasets/{owner}/{name}"
        if not repo.is_dir():
            raise FileNotFoundError(f"{path} (repository not found)") from _hub_error(
                "RepositoryNotFoundError", url, 401
            )
        revdir = repo / (rev or "main").replace("/", "%2F")
        if not revdir.is_dir():
            raise FileNotFoundError(f"{path} (revision not found)") from _hub_error(
                "RevisionNotFoundError", url, 404
            )
        return revdir / (rest or "")

    def _name(self, local: Path) -> str:
        rel = local.relative_to(self.root)
        owner, name, rev = rel.parts[:3]
        rev = rev.replace("%2F", "/")
        base = f"datasets/{owner}/{name}" + ("" if rev == "main" else f"@{rev}")
        return "/".join([base, *rel.parts[3:]])

    def _info(self, local: Path) -> dict:
        if local.is_dir():
            return {"name": self._name(local), "size": 0, "type": "directory"}
        info = {"name": self._name(local), "size": local.stat().st_size, "type": "file"}
        if local.suffix == ".parquet":  # LFS files: the Hub lists their sha256
            info["lfs"] = {
                "size": info["size"],
                "sha256": hashlib.sha256(local.read_bytes()).hexdigest(),
                "pointer_size": 134,
            }
        return info

    def ls(self, path, detail=True, **kwargs):
        local = self._local(path)
        if not local.exists():
            raise FileNotFoundError(path)
        entries = (
            [self._info(local)]
            if local.is_file()
            else [self._info(p) for p in sorted(local.iterdir()) if p.name != ".gated"]
        )
        return entries if detail else [e["name"] for e in entries]

    def info(self, path, **kwargs):
        local = self._local(path)
        if not local.exists():
            raise FileNotFoundError(path)
        return self._info(local)

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        local = self._local(path)
        owner, name = self._parse(path)[:2]
        if (self.root / owner / name / ".gated").exists() and local.name != "README.md":
            raise _hub_error("GatedRepoError", f"https://huggingface.co/datasets/{path}", 403)
        if not local.is_file():
            raise FileNotFoundError(path)
        self.opened.append(self._strip_protocol(path))
        if self.faults is not None:
            return io.BufferedReader(_FaultyFile(str(local), self.faults))
        return open(local, "rb")


def install_fake_hub(monkeypatch, root: Path, faults: Faults | None = None) -> dict:
    """fsspec's "hf" filesystem is a FakeHub over `root` for this test; returns {"fs": the last one made, "tokens":
    the tokens passed to it}."""
    made: dict = {"fs": None, "tokens": []}

    class Hub(FakeHub):
        def __init__(self, token=None, **kwargs):
            super().__init__(root, token=token, faults=faults)
            made["tokens"].append(token)
            made["fs"] = self

    # what fsspec.register_implementation("hf", Hub, clobber=True) writes, undone after the test
    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "hf", Hub)
    return made


def add_repo_file(root: Path, repo: str, path: str, data: bytes, rev: str = "main") -> Path:
    p = Path(root) / repo / rev.replace("/", "%2F") / path
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


FAKE_HUB_CHILD = """
import sys
from pathlib import Path
import fsspec
sys.path.insert(0, {tests!r})
from fakes import FakeHub
class Hub(FakeHub):
    def __init__(self, token=None, **kwargs):
        super().__init__(Path({root!r}), token=token)
fsspec.register_implementation("hf", Hub, clobber=True)
from gptlib.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def fake_hub_child(root: Path) -> str:
    """A `python -c` program: `python -m gptlib ARGS` with the fake Hub over root."""
    return FAKE_HUB_CHILD.format(tests=str(Path(__file__).parent), root=str(root))


COLAB_VM = """
import os, sys, types
from pathlib import Path
from gptlib import colab
class _Drive:
    def mount(self, mountpoint, force_remount=False, timeout_ms=120000, readonly=False):
        Path(mountpoint, "MyDrive").mkdir(parents=True, exist_ok=True)
sys.modules.setdefault("google", types.ModuleType("google"))
sys.modules["google.colab"] = sys.modules["google"].colab = types.ModuleType("google.colab")
sys.modules["google.colab"].drive = _Drive()
colab.DRIVE_MOUNT, colab.COLAB_LOCAL_ROOT = Path({drive!r}), Path({vm!r})
os.environ.pop("GPTLIB_ROOT", None)
"""


def colab_vm(drive: Path, vm: Path) -> str:
    """run_notebook's `code`: the kernel is a Colab VM whose disk is `vm`, with Google Drive mounted from `drive`."""
    return COLAB_VM.format(drive=str(drive), vm=str(vm))
