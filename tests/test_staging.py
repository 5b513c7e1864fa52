"""Training reads a verified local copy of data on the Drive mount (gptlib.data.staging), with a fake Drive: a temp
dir as gptlib.colab.DRIVE_MOUNT, and the VM's disk another (COLAB_LOCAL_ROOT)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from gptlib import colab
from gptlib.data import staging
from gptlib.data.shards import ShardWriter, read_meta, read_spans, write_meta
from gptlib.errors import DataFormatError
from tests.conftest import TINY
from tests.tokenize_kit import verified_meta


@pytest.fixture
def drive(monkeypatch, tmp_path) -> Path:
    """The fake Drive's gptlib root; the VM's local root is tmp_path/content/gptlib_local."""
    monkeypatch.setattr(colab, "DRIVE_MOUNT", tmp_path / "content" / "drive")
    monkeypatch.setattr(colab, "COLAB_LOCAL_ROOT", tmp_path / "content" / "gptlib_local")
    root = tmp_path / "content" / "drive" / "MyDrive" / "gptlib"
    root.mkdir(parents=True)
    return root


@pytest.fixture
def drive_data(drive, char_data) -> Path:
    d = drive / "data" / "chars"
    shutil.copytree(char_data, d)
    return d


def local_root(tmp_path: Path) -> Path:
    return tmp_path / "content" / "gptlib_local"


def snapshot(d: Path) -> dict[str, tuple[str, int]]:
    """Every file's sha256 and mtime: what 'unchanged' means for the Drive copy."""
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(d.iterdir())
    }


def test_copy_verify_and_reuse(drive_data, tmp_path, capsys):
    logs: list[str] = []
    drive_before = snapshot(drive_data)
    got = staging.stage_for_training(drive_data, log=logs.append)
    dst = local_root(tmp_path) / "data" / "chars"
    assert got == dst and got != drive_data
    # the time it took
    assert any("copied" in m and " s (" in m and "sha256" in m for m in logs), logs
    for p in drive_data.iterdir():
        assert (dst / p.name).read_bytes() == p.read_bytes(), p.name
    marker = json.loads((dst / staging.MARKER_FILE).read_text())
    assert marker["source"] == str(drive_data.resolve())
    assert (
        marker["meta_sha256"] == hashlib.sha256((drive_data / "meta.json").read_bytes()).hexdigest()
    )
    verified_meta(dst)  # a complete, valid dataset
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in dst.iterdir()}

    # a re-run on the same VM reuses it: no second copy
    logs.clear()
    assert staging.stage_for_training(drive_data, log=logs.append) == dst
    assert any("using the verified local copy" in m for m in logs), logs
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in dst.iterdir()} == stamps
    assert snapshot(drive_data) == drive_before and capsys.readouterr().err == ""


def test_a_changed_or_damaged_local_copy_is_copied_again(drive_data, tmp_path):
    dst = staging.stage_for_training(drive_data, log=lambda m: None)
    shard = dst / "train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # a truncated local file: the size check sees it
    logs: list[str] = []
    assert staging.stage_for_training(drive_data, log=logs.append) == dst and any(
        "copied" in m for m in logs
    )
    assert shard.read_bytes() == (drive_data / "train_000000.bin").read_bytes()
    # the dataset re-tokenized on Drive (another meta.json): the old copy is not reused
    meta = json.loads((drive_data / "meta.json").read_text())
    meta["sources"] = meta["sources"] + [{"note": "re-tokenized"}]
    (drive_data / "meta.json").write_text(json.dumps(meta))
    logs.clear()
    staging.stage_for_training(drive_data, log=logs.append)
    assert (
        any("copied" in m for m in logs)
        and (dst / "meta.json").read_bytes() == (drive_data / "meta.json").read_bytes()
    )


@pytest.mark.parametrize("name", ["val_000000.bin", "tokenizer.json"])
def test_a_file_failing_verification_is_named_and_drive_is_read(drive_data, tmp_path, capsys, name):
    f = drive_data / name
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, one bit flipped: only the sha256 sees it
    f.write_bytes(bytes(data))
    # read_meta itself refuses a replaced tokenizer: its own clear error
    if name == "tokenizer.json":
        with pytest.raises(DataFormatError, match="tokenizer"):
            staging.stage_for_training(drive_data, log=lambda m: None)
        return
    before = snapshot(drive_data)
    got = staging.stage_for_training(drive_data, log=lambda m: None)
    err = capsys.readouterr().err
    assert got == drive_data.resolve()  # falls back to reading Drive
    assert err.count("\n") == 1 and str(f) in err and "sha256" in err and "Google Drive" in err, err
    assert not (local_root(tmp_path) / "data" / "chars").exists()  # the bad local copy is deleted
    assert snapshot(drive_data) == before  # Drive's copy untouched


def test_not_enough_disk_reads_drive(drive_data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(staging, "KEEP_FREE_BYTES", 1 << 60)  # more than any disk has free
    got = staging.stage_for_training(drive_data, log=lambda m: None)
    err = capsys.readouterr().err
    assert (
        got == drive_data.resolve()
        and "does not fit on the VM's disk" in err
        and "Google Drive" in err
    ), err
    assert not (local_root(tmp_path) / "data" / "chars").exists()


def test_not_on_drive_or_off_is_left_alone(drive_data, char_data, tmp_path):
    assert staging.stage_for_training(char_data) == char_data  # a local data dir: nothing to do
    assert staging.stage_for_training(drive_data, enabled=False) == drive_data
    assert not (local_root(tmp_path) / "data").exists()


def test_a_broken_dataset_on_drive_is_its_clear_error(drive, tmp_path):
    (drive / "data" / "empty").mkdir(parents=True)
    with pytest.raises(DataFormatError, match="meta.json is missing"):
        staging.stage_for_training(drive / "data" / "empty")


def chat_dataset(out: Path, char_data: Path) -> Path:
    """A small chat-format dataset (two train shards, each with its spans file) in the char vocabulary."""
    out.mkdir(parents=True)
    meta = read_meta(char_data)
    shutil.copy(char_data / "tokenizer.json", out / "tokenizer.json")
    rng = np.random.default_rng(0)
    splits = {}
    for split, n in (("train", 300), ("val", 100)):
        w = ShardWriter(out, split, meta.dtype, shard_tokens=160, with_spans=True)
        w.write(rng.integers(0, meta.vocab_size, n), np.array([[5, 40], [60, 90], [150, 170]]))
        splits[split] = w.close()
    write_meta(
        out,
        vocab_size=meta.vocab_size,
        tokenizer=meta.tokenizer,
        splits=splits,
        sources=[],
        extra={"format": "chat"},
    )
    return out


def test_chat_data_spans_files_are_copied_and_verified(drive, char_data, tmp_path, capsys):
    src = chat_dataset(drive / "data" / "chat", char_data)
    dst = staging.stage_for_training(src, log=lambda m: None)
    assert dst == local_root(tmp_path) / "data" / "chat"
    assert (
        sorted(p.name for p in dst.glob("*.spans.bin"))
        == sorted(p.name for p in src.glob("*.spans.bin"))
        != []
    )
    m = verified_meta(dst)
    assert (read_spans(m, "train") == read_spans(read_meta(src), "train")).all()
    # a damaged spans file on Drive is named, like a shard
    shutil.rmtree(dst)
    f = src / "train_000001.spans.bin"
    data = bytearray(f.read_bytes())
    data[8] ^= (
        0x01  # the first span ends one token later: still a valid span, only the sha256 sees it
    )
    f.write_bytes(bytes(data))
    assert staging.stage_for_training(src, log=lambda m: None) == src.resolve()
    assert "train_000001.spans.bin" in capsys.readouterr().err and not dst.exists()


def test_train_reads_the_local_copy(drive_data, tmp_path, capsys):
    """train() on data under the Drive mount copies it once, reads the copy, and names Drive in the checkpoint."""
    import torch

    from gptlib.checkpoint.format import verify_checkpoint
    from gptlib.training.loop import train

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = tmp_path / "run"
        train(drive_data, run, "phase1", TINY, max_steps=3, device="cpu")
        out = capsys.readouterr().out
        dst = local_root(tmp_path) / "data" / "chars"
        # the data loaded from the VM's copy (the checks before it name Drive's)
        assert "copied" in out and f"\ndata: {dst} (" in out, out
        assert f"(from {drive_data}/meta.json)" in out, out
        state = json.loads(
            (
                verify_checkpoint(run / "checkpoints" / "step_0000003").path / "state.json"
            ).read_text()
        )
        assert state["data_dir"] == str(drive_data)  # where the data lasts, not the VM's copy
        r = train(drive_data, run, "phase1", TINY, max_steps=5, device="cpu", progress=False)
        out = capsys.readouterr().out
        assert r.resumed_from == 3 and "using the verified local copy" in out, out
        # a fresh VM re-running a finished run: said at once, without copying the data first (gpt2-small's: 5.6 GB)
        shutil.rmtree(dst)
        r = train(drive_data, run, "phase1", TINY, max_steps=5, device="cpu", progress=False)
        out = capsys.readouterr().out
        assert r.stopped_by == "finished" and "copied" not in out and not dst.exists(), out
        train(
            drive_data,
            tmp_path / "run2",
            "phase1",
            TINY,
            max_steps=1,
            device="cpu",
            progress=False,
            stage_data=False,
        )
        assert f"(from {drive_data}/meta.json)" in capsys.readouterr().out
    finally:
        torch.set_num_threads(n)


def test_a_hung_meta_json_is_said_at_its_time_limit_not_read_again(drive_data, monkeypatch):
    """meta.json on a hung Drive: the watchdogged read gives up after STALL_S, and the error says so. Its fallback
    (read_meta, for a missing or unreadable file's own message) read the same hung file again with no time limit."""
    from gptlib.errors import HungIOError

    def hung(path, timeout):
        raise HungIOError(110, f"reading {path} made no progress for {timeout:g} s (hung mount?)")

    read_again = []
    monkeypatch.setattr(staging, "read_bytes_with_timeout", hung)
    monkeypatch.setattr(staging, "read_meta", read_again.append)
    with pytest.raises(HungIOError, match="meta.json made no progress"):
        staging.stage_for_training(drive_data, log=lambda s: None)
    assert read_again == []


def test_a_damaged_shard_on_drive_in_a_notebook_names_overwrite(drive_data, monkeypatch, capsys):
    """Notebook 03 training on a dataset whose shard on Drive was damaged: the line said 'tokenize again with
    --overwrite to repair it', a flag no notebook has. It names notebook 01's OVERWRITE, and for notebook 05, which
    has none and tokenizes its own data, deleting the folder."""
    import sys
    from types import SimpleNamespace

    kernel = SimpleNamespace(get_ipython=lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    shard = read_meta(drive_data).shard_paths("train")[0]
    data = bytearray(shard.read_bytes())
    data[0] ^= 1  # the same size: only the sha256 sees it
    shard.write_bytes(bytes(data))
    assert staging.stage_for_training(drive_data, log=lambda m: None) == drive_data.resolve()
    err = capsys.readouterr().err
    assert (
        f"{shard.name} does not match meta.json" in err
        and "tokenize again to repair it: OVERWRITE = True in notebook 01 (notebook 05's data: delete the "
        "folder, then run notebook 05 again)"
        in err
    ), err
    assert "--" not in err.replace(str(drive_data.parents[4]), ""), err
