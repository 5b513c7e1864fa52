"""Hugging Face Hub datasets as tokenize inputs: `hf://datasets/OWNER/NAME[@REV][/path/glob]`.

Read through huggingface_hub's fsspec filesystem (HfFileSystem): files are listed with their size and
sha256 (nothing is read to identify them) and streamed with HTTP range requests, row group by row
group (remote.py, sources.py); nothing is downloaded to disk.

Which files (`resolve_hf`):
1. A path or glob in the URL: exactly those files (`.../sample/10BT/*.parquet`).
2. Else the dataset card's `configs:` (README.md YAML, what the Hub's viewer and `datasets` use): the
   files of config `config` (default: the one marked `default`, else "default", else the first) and
   split `split` (default "train", or the config's only split), if they are parquet, jsonl or txt.
3. Else the repository's parquet files: those named by `split` (`data/train-0000-of-0004.parquet`,
   `train/0.parquet`, ...), by default the "train" ones when the files are named by split, else all.
4. Else (a repository without parquet files: scripts, csv, compressed json) the Hub's own parquet
   conversion, revision `refs/convert/parquet`: `{config}/{split}/*.parquet` (config default
   "default", split default "train"), or `{config}/partial-{split}/` where the Hub converted only the
   first ~5 GB of a big split (a note says so).

Auth: the token is `HF_TOKEN` from the environment, else on Colab the `HF_TOKEN` secret
(`google.colab.userdata`), else huggingface_hub's own saved login. A dataset that does not exist or is
private, a gated dataset, a missing revision: one message saying which, and how to pass a token.
"""

from __future__ import annotations

import re
import sys

from gptlib.data.remote import (Found, describe, error_names, has_glob, hf_token, hub_error_hint, list_files,
                                parse_dataset_url)
from gptlib.errors import PrepareError

CONVERTED = "refs/convert/parquet"
TEXT_EXT = (".parquet", ".pq", ".jsonl", ".ndjson", ".txt")
_SPLIT_NAMES = ("train", "validation", "valid", "val", "test", "dev", "eval")
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


def _root(repo: str, rev: str | None) -> str:
    return f"datasets/{repo}" + (f"@{rev}" if rev else "")


def _resolve(fs, repo: str, rev: str | None, path: str, config: str | None, split: str | None) -> list[Found]:
    root = _root(repo, rev)
    fs.info(root)  # the repository and revision exist and are readable (else a Hub error, mapped by the caller)
    if path:
        return list_files(fs, f"{root}/{path}", f"hf://{root}/{path}")
    card = _card_configs(fs, root)
    if card:
        found = _from_card(fs, root, card, config, split)
        if found:
            return found
    elif config is None:
        found = _repo_parquet(fs, root, split)
        if found:
            return found
    return _converted(fs, repo, config, split)


def _supported(found: list[Found]) -> bool:
    return bool(found) and all(f.path.lower().endswith(TEXT_EXT) for f in found)


def _card_configs(fs, root: str) -> list[dict]:
    """The `configs:` list of the dataset card's YAML header ([] without a card or configs)."""
    import yaml

    try:
        text = fs.cat_file(f"{root}/README.md").decode("utf-8", "replace")
    except FileNotFoundError:
        return []
    m = re.match(r"\A---\s*\n(.*?)\n---\s*(\n|\Z)", text, re.S)
    if not m:
        return []
    try:
        meta = yaml.safe_load(m.group(1)) or {}
    except yaml.YAMLError:
        return []
    configs = meta.get("configs") if isinstance(meta, dict) else None
    return [c for c in configs if isinstance(c, dict) and c.get("config_name")] if isinstance(configs, list) else []


def _card_splits(entry: dict) -> dict[str, list[str]]:
    """A card config's data_files as {split: [patterns]}."""
    df = entry.get("data_files")
    if df is None:
        return {}
    if isinstance(df, str):
        return {"train": [df]}
    if isinstance(df, dict):
        df = [{"split": k, "path": v} for k, v in df.items()]
    out: dict[str, list[str]] = {}
    for item in df if isinstance(df, list) else []:
        if isinstance(item, str):
            out.setdefault("train", []).append(item)
        elif isinstance(item, dict) and item.get("path"):
            paths = item["path"] if isinstance(item["path"], list) else [item["path"]]
            out.setdefault(str(item.get("split", "train")), []).extend(map(str, paths))
    return out


def _from_card(fs, root: str, card: list[dict], config: str | None, split: str | None) -> list[Found]:
    names = [str(c["config_name"]) for c in card]
    if config is None:
        marked = [c for c in card if c.get("default")]
        entry = marked[0] if marked else next((c for c in card if c["config_name"] == "default"), card[0])
    else:
        entry = next((c for c in card if str(c["config_name"]) == config), None)
        if entry is None:
            raise PrepareError(f"dataset {root[len('datasets/'):]} has no config {config!r} (configs: {', '.join(names)}); "
                               f"choose one with --hf-config / hf_config=")
    splits = _card_splits(entry)
    if not splits:
        return []
    chosen = split or ("train" if "train" in splits or len(splits) != 1 else next(iter(splits)))
    if chosen not in splits:
        raise PrepareError(f"config {entry['config_name']!r} of dataset {root[len('datasets/'):]} has no split "
                           f"{chosen!r} (splits: {', '.join(splits)}); choose one with --hf-split / hf_split=")
    found: list[Found] = []
    for pattern in splits[chosen]:
        pattern = pattern.lstrip("/")
        if not has_glob(pattern) and not pattern.lower().endswith(TEXT_EXT):
            pattern = pattern.rstrip("/") + "/**"
        try:
            found.extend(list_files(fs, f"{root}/{pattern}", f"hf://{root}/{pattern}"))
        except PrepareError:
            pass  # a pattern matching nothing; the others may
    found = list({f.path: f for f in found}.values())
    if _supported(found):
        if len(card) > 1 or len(splits) > 1:
            print(f"note: {root[len('datasets/'):]}: config {entry['config_name']!r}, split {chosen!r} "
                  f"({len(found)} files)", file=sys.stderr)
        return found
    return []  # csv, compressed json...: the Hub's parquet conversion has it


def split_matches(path: str, split: str) -> bool:
    """Whether a repository path names split `split` as the Hub's file conventions do: a directory
    `train/`, or a name `train-0000-of-0004`, `data/train.parquet`, `train_00.jsonl` (`train_sft` is
    another split)."""
    stem = path.rsplit(".", 1)[0] if "/" not in path.rsplit(".", 1)[-1] else path
    pat = r"(?:^|[/\-. _0-9])" + re.escape(split) + r"(?=$|[/\-. 0-9]|_(?![A-Za-z]))"
    return re.search(pat, stem) is not None


def _repo_parquet(fs, root: str, split: str | None) -> list[Found]:
    files = [f for f in list_files(fs, root, f"hf://{root}") if f.path.lower().endswith((".parquet", ".pq"))]
    if not files:
        return []
    rel = {f.path: f.path[len(root) + 1:] for f in files}
    if split is None:
        named = {s for s in _SPLIT_NAMES for f in files if split_matches(rel[f.path], s)}
        if not named:
            return files
        split = "train"
    chosen = [f for f in files if split_matches(rel[f.path], split)]
    if not chosen:
        names = sorted({s for s in _SPLIT_NAMES for f in files if split_matches(rel[f.path], s)})
        raise PrepareError(f"dataset {root[len('datasets/'):]}: no parquet file is named for split {split!r} "
                           f"(splits found: {', '.join(names) or 'none'}); choose one with --hf-split, or name the "
                           f"files: hf://{root}/path/*.parquet")
    return chosen


def _converted(fs, repo: str, config: str | None, split: str | None) -> list[Found]:
    """The Hub's parquet conversion (refs/convert/parquet) of config/split."""
    root = _root(repo, CONVERTED)
    try:
        configs = sorted(e["name"].rsplit("/", 1)[-1] for e in fs.ls(root, detail=True) if e["type"] == "directory")
    except FileNotFoundError:
        configs = []
    if not configs:
        raise PrepareError(f"dataset {repo} has no parquet files, and the Hub has no parquet conversion of it "
                           f"(refs/convert/parquet); name its files instead: hf://datasets/{repo}/path/*.jsonl")
    config = config or ("default" if "default" in configs or len(configs) != 1 else configs[0])
    if config not in configs:
        raise PrepareError(f"dataset {repo} has no config {config!r} (configs: {', '.join(configs)}); choose one "
                           f"with --hf-config / hf_config=")
    dirs = sorted(e["name"].rsplit("/", 1)[-1] for e in fs.ls(f"{root}/{config}", detail=True)
                  if e["type"] == "directory")
    splits = sorted({d.removeprefix("partial-") for d in dirs})
    split = split or ("train" if "train" in splits or len(splits) != 1 else splits[0])
    name = split if split in dirs else f"partial-{split}" if f"partial-{split}" in dirs else None
    if name is None:
        raise PrepareError(f"config {config!r} of dataset {repo} has no split {split!r} (splits: {', '.join(splits)}); "
                           f"choose one with --hf-split / hf_split=")
    if name.startswith("partial-"):
        print(f"note: the Hub's parquet conversion of {repo} {config}/{split} is partial (its first ~5 GB)",
              file=sys.stderr)
    return list_files(fs, f"{root}/{config}/{name}/*.parquet", f"hf://{root}/{config}/{name}/*.parquet")
