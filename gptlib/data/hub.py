"""Inputs behind fsspec URLs (file://, s3://, hf://...): hf://datasets/OWNER/NAME[@REV]/path/or/glob, or without a
path a config/split of the Hub's parquet conversion (docs/data.md). Listings carry sizes and, on the Hub, sha256s:
resolving a 1,000-file dataset reads nothing."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from gptlib.errors import PrepareError

CONVERTED = "refs/convert/parquet"
TOKEN_HELP = (
    "pass a token: set the environment variable HF_TOKEN=hf_... (a read token from "
    "https://huggingface.co/settings/tokens), or on Colab add a secret named HF_TOKEN in the key-icon "
    "panel and allow this notebook to use it"
)
_DATASET_URL = re.compile(
    r"hf://datasets/([^/@]+/[^/@]+)(?:@(refs/(?:convert/[\w.-]+|pr/\d+)|[^/]+))?(?:/(.*))?"
)


def is_url(s: str) -> bool:
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(s)) is not None


def has_glob(s: str) -> bool:
    return any(ch in s for ch in "*?[")


# what a folder listing leaves out: hidden files (macOS's .DS_Store) and those Windows puts in synced folders
def unlisted(part: str) -> bool:
    return part.startswith(".") or part.lower() in ("thumbs.db", "desktop.ini")


@dataclass
class Found:
    url: str  # what meta.json records and messages name
    fs: Any
    path: str  # the path within fs
    size: int
    # where the listing gives it (Hub LFS files): no read needed to identify the file
    sha256: str | None = None


def list_files(fs, path: str, url: str) -> list[Found]:
    """A file, a directory (unlisted files skipped) or a glob, in the order of the same local paths: the same shards."""
    root = None
    try:
        if has_glob(path):
            found = {
                p: i for p, i in fs.glob(path, detail=True).items() if i.get("type") != "directory"
            }
        elif fs.isdir(path):
            found = fs.find(path, detail=True)
            root = path.rstrip("/")
        else:
            found = {path: fs.info(path)}
    except FileNotFoundError:
        raise PrepareError(f"input {url} does not exist") from None
    except Exception as e:  # noqa: BLE001 - a remote listing can fail in many library-specific ways
        raise PrepareError(f"input {url} cannot be listed: {describe(e, url)}") from None
    if not found and has_glob(path):
        raise PrepareError(f"input pattern {url!r} matches no files")
    parts = {
        p: PurePosixPath(p[len(root) :].lstrip("/") if root is not None else p).parts for p in found
    }
    # a folder leaves out unlisted files and folders, a wildcard unlisted files (as Python's glob does hidden ones)
    hide = {
        p: parts[p] if root is not None else parts[p][-1:] if has_glob(path) else () for p in found
    }
    keep = sorted((p for p in found if not any(map(unlisted, hide[p]))), key=parts.get)
    return [
        Found(fs.unstrip_protocol(p), fs, p, int(found[p].get("size") or 0), _lfs_sha256(found[p]))
        for p in keep
    ]


def _lfs_sha256(info: dict) -> str | None:
    sha = (info.get("lfs") or {}).get("sha256")
    return sha if isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha) else None


def resolve_url(url: str, hf_config: str | None = None, hf_split: str | None = None) -> list[Found]:
    import fsspec

    if url.startswith("hf://"):
        # huggingface_hub's HfFileSystem: its token is HF_TOKEN, a login or Colab's secret
        fs = fsspec.filesystem("hf")
        if url.startswith("hf://datasets/"):
            return _resolve_dataset(fs, url, hf_config, hf_split)
        return list_files(fs, url[len("hf://") :], url)  # a model's or a bucket's files
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as e:  # unknown protocol, or its package is not installed
        raise PrepareError(f"input URL {url}: {e}") from None
    return list_files(fs, path, url)


def http_status(e: BaseException) -> int | None:
    """The status of an HTTP error from requests/httpx (huggingface_hub's), else None."""
    return getattr(getattr(e, "response", None), "status_code", None)


def describe(e: BaseException, url: str | None = None) -> str:
    """One line for an error from a filesystem library; for the Hub, what to do."""
    m = _DATASET_URL.fullmatch(url or "")
    repo, rev = m.group(1, 2) if m else (None, None)
    what = f"dataset {repo}" if repo else "the dataset"
    chain = (e, e.__cause__ or e.__context__)  # huggingface_hub's errors arrive wrapped
    names = {t.__name__ for c in chain if c is not None for t in type(c).__mro__}
    hints = {
        "GatedRepoError": f"{what} is gated: accept its conditions at https://huggingface.co/datasets/{repo}, "
        f"then {TOKEN_HELP}",
        "RevisionNotFoundError": f"revision {rev!r} of {what} does not exist",
        "RepositoryNotFoundError": f"{what} was not found on the Hub (it does not exist, or it is private and "
        f"needs a login); check the name (OWNER/NAME) or {TOKEN_HELP}",
    }
    hint = next((h for n, h in hints.items() if n in names), None)
    if hint is None and http_status(e) in (401, 403):
        hint = f"the Hub refused access to {what}; {TOKEN_HELP}"
    first = (str(e).strip().splitlines() or [""])[0]
    return hint or f"{type(e).__name__}: {first}".rstrip(": ")


def _resolve_dataset(fs, url: str, config: str | None, split: str | None) -> list[Found]:
    m = _DATASET_URL.fullmatch(url)
    if not m:
        raise PrepareError(
            f"input {url}: a Hub dataset URL is hf://datasets/OWNER/NAME[@REVISION][/path/or/glob]"
        )
    repo, rev, path = m.group(1), m.group(2), (m.group(3) or "").strip("/")
    root = f"datasets/{repo}" + (f"@{rev}" if rev else "")
    if path and (config or split):
        raise PrepareError(
            f"input {url} names its files: --hf-config / --hf-split choose within the Hub's parquet "
            f"conversion of a dataset named without a path (hf://datasets/{repo})"
        )
    try:
        # the repository and revision exist and are readable (else a Hub error, said below)
        fs.info(root)
        if path:
            return list_files(fs, f"{root}/{path}", url)
        if rev:
            raise PrepareError(
                f"input {url}: the Hub's parquet conversion is of the main branch; name the files "
                f"of revision {rev!r} instead: hf://{root}/path/*.parquet"
            )
        return _converted(fs, repo, config, split)
    except PrepareError:
        raise
    except Exception as e:  # noqa: BLE001 - FileNotFoundError from a Hub error, or a network failure
        raise PrepareError(f"input {url}: {describe(e, url)}") from None


def _dirs(fs, path: str) -> list[str]:
    return sorted(
        e["name"].rsplit("/", 1)[-1] for e in fs.ls(path, detail=True) if e["type"] == "directory"
    )


def _converted(fs, repo: str, config: str | None, split: str | None) -> list[Found]:
    """By default config "default" and split "train", or the only one there is."""
    root = f"datasets/{repo}@{CONVERTED}"
    try:
        configs = _dirs(fs, root)
    except FileNotFoundError:
        configs = []
    if not configs:
        raise PrepareError(
            f"dataset {repo}: the Hub has no parquet conversion of it ({CONVERTED}); name its files "
            f"instead: hf://datasets/{repo}/path/*.parquet"
        )
    config = config or (configs[0] if len(configs) == 1 else "default")
    if config not in configs:
        raise PrepareError(
            f"dataset {repo} has no config {config!r} (configs: {', '.join(configs)}); choose one "
            f"with --hf-config / hf_config="
        )
    dirs = _dirs(fs, f"{root}/{config}")
    splits = sorted({d.removeprefix("partial-") for d in dirs})
    split = split or (splits[0] if len(splits) == 1 else "train")
    name = split if split in dirs else f"partial-{split}" if f"partial-{split}" in dirs else None
    if name is None:
        raise PrepareError(
            f"config {config!r} of dataset {repo} has no split {split!r} (splits: {', '.join(splits)}); "
            f"choose one with --hf-split / hf_split="
        )
    if name.startswith("partial-"):
        print(
            f"note: the Hub's parquet conversion of {repo} {config}/{split} is partial (its first ~5 GB); name the "
            f"repository's own files for all of it: hf://datasets/{repo}/path/*.parquet",
            file=sys.stderr,
        )
    return list_files(
        fs, f"{root}/{config}/{name}/*.parquet", f"hf://{root}/{config}/{name}/*.parquet"
    )
