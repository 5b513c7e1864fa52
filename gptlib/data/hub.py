"""Inputs behind fsspec URLs (file://, memory://, s3://, hf://...): their files, listed with sizes (and, on the
Hub, sha256s: resolving a 1,000-file dataset reads nothing), and Hub datasets `hf://datasets/OWNER/NAME[@REV]`
mapped to files as docs/data.md says (a path or glob, else the card's configs, else the repository's parquet files
by split, else the Hub's parquet conversion), through huggingface_hub's HfFileSystem. Hub errors (a missing,
private or gated dataset, a missing revision) are one message saying which, and how to pass a token.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from gptlib.colab import in_colab
from gptlib.errors import PrepareError

CONVERTED = "refs/convert/parquet"
TEXT_EXT = (".parquet", ".pq", ".jsonl", ".ndjson", ".txt")
_SPLIT_NAMES = ("train", "validation", "valid", "val", "test", "dev", "eval")
TOKEN_HELP = ("pass a token: set the environment variable HF_TOKEN=hf_... (a read token from "
              "https://huggingface.co/settings/tokens), or on Colab add a secret named HF_TOKEN in the key-icon "
              "panel and allow this notebook to use it")
_DATASET_URL = re.compile(r"hf://datasets/([^/@]+/[^/@]+)(?:@(refs/(?:convert/[\w.-]+|pr/\d+)|[^/]+))?(?:/(.*))?")


def is_url(s: str) -> bool:
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(s)) is not None


def has_glob(s: str) -> bool:
    return any(ch in s for ch in "*?[")


@dataclass
class Found:
    """One input file behind a URL."""

    url: str  # what meta.json records and messages name
    fs: Any  # the fsspec filesystem
    path: str  # the path within fs
    size: int
    sha256: str | None = None  # the content's sha256 where the filesystem lists it (Hub LFS files)


def listed_sha256(info: dict) -> str | None:
    """The content sha256 a listing gives for a file, if any (the Hub: `lfs.sha256` of LFS files)."""
    sha = (info.get("lfs") or {}).get("sha256")
    return sha if isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha) else None


def list_files(fs, path: str, url: str) -> list[Found]:
    """A file, a directory (recursively, hidden files skipped) or a glob on fs, sorted as local paths are."""
    root = None
    try:
        if has_glob(path):
            found = {p: i for p, i in fs.glob(path, detail=True).items() if i.get("type") != "directory"}
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
    parts = {p: PurePosixPath(p[len(root):].lstrip("/") if root is not None else p).parts for p in found}
    keep = sorted((p for p in found if root is None or not any(s.startswith(".") for s in parts[p])),
                  key=parts.get)  # the order of sorted(Path(...)) for the same names
    return [Found(fs.unstrip_protocol(p), fs, p, int(found[p].get("size") or 0), listed_sha256(found[p]))
            for p in keep]


def resolve_url(url: str, *, hf_config: str | None = None, hf_split: str | None = None) -> list[Found]:
    """The files a URL names: a file, a directory (recursively) or a glob; hf:// through resolve_hf."""
    if url.startswith("hf://"):
        return resolve_hf(url, config=hf_config, split=hf_split)
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as e:  # unknown protocol, or its package is not installed
        raise PrepareError(f"input URL {url}: {e}") from None
    return list_files(fs, path, url)


def describe(e: BaseException, url: str | None = None) -> str:
    """One line for an error from a filesystem library; Hub errors say what to do, naming the dataset of `url`."""
    m = _DATASET_URL.fullmatch(url or "")
    hint = hub_error_hint(e, *(m.group(1, 2) if m else ()))
    msg = str(e).strip().splitlines()
    return hint or f"{type(e).__name__}: {msg[0] if msg else ''}".rstrip(": ")


def hf_token() -> str | None:
    """HF_TOKEN from the environment, else Colab's HF_TOKEN secret, else None (huggingface_hub then
    uses a saved `hf auth login`, if any)."""
    tok = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if tok or not in_colab():
        return tok or None
    try:
        from google.colab import userdata  # noqa: PLC0415 - only exists on Colab

        return userdata.get("HF_TOKEN") or None
    except Exception:  # noqa: BLE001 - no such secret, or the notebook was not given access
        return None


def parse_dataset_url(url: str) -> tuple[str, str | None, str]:
    """hf://datasets/OWNER/NAME[@REV][/path] -> (OWNER/NAME, REV or None, path)."""
    m = _DATASET_URL.fullmatch(url)
    if not m:
        raise PrepareError(f"input {url}: a Hub dataset URL is hf://datasets/OWNER/NAME[@REVISION][/path/or/glob]")
    return m.group(1), m.group(2), (m.group(3) or "").strip("/")


def error_names(e: BaseException | None) -> set[str]:
    """Class names (with bases) of an error and of its causes."""
    names: set[str] = set()
    for _ in range(8):
        if e is None:
            break
        names.update(c.__name__ for c in type(e).__mro__)
        e = e.__cause__ or e.__context__
    return names


def hub_error_hint(e: BaseException, repo: str | None = None, rev: str | None = None) -> str | None:
    """What a Hub error means for the user and what to do, or None for other errors."""
    names = error_names(e)
    what = f"dataset {repo}" if repo else "the dataset"
    if "GatedRepoError" in names:
        where = f"https://huggingface.co/datasets/{repo}" if repo else "its page on huggingface.co"
        return f"{what} is gated: accept its conditions at {where} (logged in), then {TOKEN_HELP}"
    if "RevisionNotFoundError" in names:
        return f"revision {rev!r} of {what} does not exist" if rev else f"a revision of {what} does not exist"
    if "DisabledRepoError" in names:
        return f"{what} has been disabled on the Hub"
    if "RepositoryNotFoundError" in names:
        token = "the token in use has no access to it, or it does not exist" if hf_token() else \
            "it does not exist, or it is private and needs a login"
        return f"{what} was not found on the Hub ({token}); check the name (OWNER/NAME) or {TOKEN_HELP}"
    if "OfflineModeIsEnabled" in names:
        return "huggingface_hub is in offline mode (HF_HUB_OFFLINE=1): the Hub cannot be reached"
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status in (401, 403):
        return f"the Hub refused access to {what} (HTTP {status}); {TOKEN_HELP}"
    return None


def hf_filesystem(token: str | None):
    """huggingface_hub's fsspec filesystem (tests replace this function with a fake Hub)."""
    from huggingface_hub import HfFileSystem

    return HfFileSystem(token=token)


def resolve_hf(url: str, config: str | None = None, split: str | None = None) -> list[Found]:
    """The files of a Hub URL (see the module docstring)."""
    fs = hf_filesystem(hf_token())
    if not url.startswith("hf://datasets/"):  # a model's or a bucket's files: plain fsspec listing
        return list_files(fs, url[len("hf://"):], url)
    repo, rev, path = parse_dataset_url(url)
    try:
        return _resolve(fs, repo, rev, path, config, split)
    except PrepareError:
        raise
    except Exception as e:  # noqa: BLE001 - FileNotFoundError from a Hub error, or a network failure
        hint = hub_error_hint(e, repo, rev)
        if hint is None and error_names(e) & {"ConnectError", "ConnectTimeout", "ConnectionError", "TimeoutError"}:
            hint = f"the Hub (huggingface.co) cannot be reached ({describe(e)}): no network?"
        raise PrepareError(f"input {url}: {hint or describe(e)}") from None


def _resolve(fs, repo: str, rev: str | None, path: str, config: str | None, split: str | None) -> list[Found]:
    root = f"datasets/{repo}" + (f"@{rev}" if rev else "")
    fs.info(root)  # the repository and revision exist and are readable (else a Hub error, mapped by the caller)
    if path:
        return _list(fs, f"{root}/{path}")
    card = _card_configs(fs, root)
    shown = root.removeprefix("datasets/")  # OWNER/NAME[@REV], as messages name it
    found = _from_card(fs, shown, root, card, config, split) if card else \
        _repo_parquet(fs, shown, root, split) if config is None else []
    return found or _converted(fs, repo, config, split)


def _list(fs, path: str) -> list[Found]:
    return list_files(fs, path, f"hf://{path}")


def _card_configs(fs, root: str) -> list[dict]:
    """The `configs:` list of the dataset card's YAML header ([] without a card or configs)."""
    import yaml

    try:
        text = fs.cat_file(f"{root}/README.md").decode("utf-8", "replace")
    except FileNotFoundError:
        return []
    m = re.match(r"\A---\s*\n(.*?)\n---\s*(\n|\Z)", text, re.S)
    try:
        meta = (yaml.safe_load(m.group(1)) if m else None) or {}
    except yaml.YAMLError:
        return []
    configs = meta.get("configs") if isinstance(meta, dict) else None
    return [c for c in configs if isinstance(c, dict) and c.get("config_name")] if isinstance(configs, list) else []


def _card_splits(entry: dict) -> dict[str, list[str]]:
    """A card config's data_files as {split: [patterns]}."""
    df = entry.get("data_files")
    if isinstance(df, str):
        df = [df]
    elif isinstance(df, dict):
        df = [{"split": k, "path": v} for k, v in df.items()]
    out: dict[str, list[str]] = {}
    for item in df if isinstance(df, list) else []:
        if isinstance(item, str):
            out.setdefault("train", []).append(item)
        elif isinstance(item, dict) and item.get("path"):
            paths = item["path"] if isinstance(item["path"], list) else [item["path"]]
            out.setdefault(str(item.get("split", "train")), []).extend(map(str, paths))
    return out


def _default(names, split: bool) -> str:
    """The config or split chosen when none is named: "train" / "default" if there, or the only one."""
    want = "train" if split else "default"
    return want if want in names or len(names) != 1 else next(iter(names))


def _from_card(fs, repo: str, root: str, card: list[dict], config: str | None, split: str | None) -> list[Found]:
    if config is None:
        entry = next((c for c in card if c.get("default")), None) or \
            next((c for c in card if c["config_name"] == "default"), card[0])
    else:
        entry = next((c for c in card if str(c["config_name"]) == config), None)
        if entry is None:
            raise PrepareError(f"dataset {repo} has no config {config!r} (configs: "
                               f"{', '.join(str(c['config_name']) for c in card)}); choose one with --hf-config / "
                               f"hf_config=")
    splits = _card_splits(entry)
    if not splits:
        return []
    chosen = split or _default(splits, split=True)
    if chosen not in splits:
        raise PrepareError(f"config {entry['config_name']!r} of dataset {repo} has no split {chosen!r} (splits: "
                           f"{', '.join(splits)}); choose one with --hf-split / hf_split=")
    found: dict[str, Found] = {}
    for pattern in splits[chosen]:
        pattern = pattern.lstrip("/")
        if not has_glob(pattern) and not pattern.lower().endswith(TEXT_EXT):
            pattern = pattern.rstrip("/") + "/**"
        try:
            found.update((f.path, f) for f in _list(fs, f"{root}/{pattern}"))
        except PrepareError:
            pass  # a pattern matching nothing; the others may
    if not found or not all(p.lower().endswith(TEXT_EXT) for p in found):
        return []  # csv, compressed json...: the Hub's parquet conversion has it
    if len(card) > 1 or len(splits) > 1:
        print(f"note: {repo}: config {entry['config_name']!r}, split {chosen!r} ({len(found)} files)", file=sys.stderr)
    return list(found.values())


def split_matches(path: str, split: str) -> bool:
    """Whether a repository path names split `split` as the Hub's file conventions do: a directory
    `train/`, or a name `train-0000-of-0004`, `data/train.parquet`, `train_00.jsonl` (`train_sft` is
    another split)."""
    stem = path.rsplit(".", 1)[0] if "/" not in path.rsplit(".", 1)[-1] else path
    pat = r"(?:^|[/\-. _0-9])" + re.escape(split) + r"(?=$|[/\-. 0-9]|_(?![A-Za-z]))"
    return re.search(pat, stem) is not None


def _repo_parquet(fs, repo: str, root: str, split: str | None) -> list[Found]:
    files = [f for f in _list(fs, root) if f.path.lower().endswith((".parquet", ".pq"))]
    named = sorted({s for s in _SPLIT_NAMES for f in files if split_matches(f.path[len(root) + 1:], s)})
    if split is None and not named:
        return files
    chosen = [f for f in files if split_matches(f.path[len(root) + 1:], split or "train")]
    if files and not chosen:
        raise PrepareError(f"dataset {repo}: no parquet file is named for split {split or 'train'!r} (splits found: "
                           f"{', '.join(named) or 'none'}); choose one with --hf-split, or name the files: "
                           f"hf://{root}/path/*.parquet")
    return chosen


def _dirs(fs, path: str) -> list[str]:
    return sorted(e["name"].rsplit("/", 1)[-1] for e in fs.ls(path, detail=True) if e["type"] == "directory")


def _converted(fs, repo: str, config: str | None, split: str | None) -> list[Found]:
    """The Hub's parquet conversion (refs/convert/parquet) of config/split."""
    root = f"datasets/{repo}@{CONVERTED}"
    try:
        configs = _dirs(fs, root)
    except FileNotFoundError:
        configs = []
    if not configs:
        raise PrepareError(f"dataset {repo} has no parquet files, and the Hub has no parquet conversion of it "
                           f"(refs/convert/parquet); name its files instead: hf://datasets/{repo}/path/*.jsonl")
    config = config or _default(configs, split=False)
    if config not in configs:
        raise PrepareError(f"dataset {repo} has no config {config!r} (configs: {', '.join(configs)}); choose one "
                           f"with --hf-config / hf_config=")
    dirs = _dirs(fs, f"{root}/{config}")
    splits = sorted({d.removeprefix("partial-") for d in dirs})
    split = split or _default(splits, split=True)
    name = split if split in dirs else f"partial-{split}" if f"partial-{split}" in dirs else None
    if name is None:
        raise PrepareError(f"config {config!r} of dataset {repo} has no split {split!r} (splits: {', '.join(splits)}); "
                           f"choose one with --hf-split / hf_split=")
    if name.startswith("partial-"):
        print(f"note: the Hub's parquet conversion of {repo} {config}/{split} is partial (its first ~5 GB)",
              file=sys.stderr)
    return _list(fs, f"{root}/{config}/{name}/*.parquet")
