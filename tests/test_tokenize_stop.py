"""tokenize with real processes: one writer per data directory (a second tokenize into it refuses at once), and
Ctrl-C: one line, no temp files left, and the same command finishes the dataset byte for byte."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gptlib.data.encode as genc
import gptlib.data.prepare as prep
from gptlib.data.shards import PREPARE_STATE_FILE, read_meta
from gptlib.data.tokenizer import BPETokenizer
from tests.tokenize_kit import SLOW_FSYNC, SLOW_TOKENIZE, verified_meta, wait_for_shards

REPO = Path(__file__).resolve().parents[1]
# the same small batches: the same shard cuts
UNSLOWED = SLOW_TOKENIZE.replace("time.sleep(0.15)", "pass")


def tokenize_args(src: Path, out: Path, bpe_file: Path) -> list[str]:
    return [
        "tokenize",
        "--input",
        str(src),
        "--tokenizer-from",
        str(bpe_file),
        "--shard-tokens",
        "5000",
        "--out",
        str(out),
        "--quiet",
    ]


def data_files(d: Path) -> dict[str, bytes]:
    """Every file of a data directory, meta.json without its elapsed_s (the one field a run's speed changes)."""
    files = {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}
    meta = json.loads(files.pop("meta.json"))
    meta.pop("elapsed_s")
    return {**files, "meta.json": json.dumps(meta, sort_keys=True).encode()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, docs, bpe_file) -> tuple[Path, Path]:
    """(a jsonl corpus, its dataset made by one uninterrupted tokenize with the tests' small batches)."""
    d = tmp_path_factory.mktemp("corpus")
    src = d / "a.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    r = subprocess.run(
        [sys.executable, "-c", UNSLOWED, *tokenize_args(src, d / "clean", bpe_file)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return src, d / "clean"


def test_a_second_tokenize_into_the_same_dir_refuses_and_the_first_finishes(
    tmp_path, corpus, bpe_file
):
    src, clean = corpus
    out = tmp_path / "out"
    first = subprocess.Popen(
        [sys.executable, "-c", SLOW_TOKENIZE, *tokenize_args(src, out, bpe_file)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_shards(first, out, 2)
        t0 = time.time()
        second = subprocess.run(
            [sys.executable, "-m", "gptlib", *tokenize_args(src, out, bpe_file)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.time() - t0
        assert first.poll() is None, "the first tokenize should still be running"
    finally:
        stdout, stderr = first.communicate(timeout=120)
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    (line,) = second.stderr.strip().splitlines()
    assert line.startswith(f"error: {out} is in use by another tokenize process"), line
    assert took < 20, f"the second tokenize took {took:.1f} s to refuse"
    assert first.returncode == 0, stderr
    assert data_files(out) == data_files(clean)  # the first one's dataset, whole
    verified_meta(out)


def test_ctrl_c_is_one_line_leaves_no_temp_file_and_the_same_command_finishes(
    tmp_path, corpus, bpe_file
):
    src, clean = corpus
    out = tmp_path / "out"
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_FSYNC + SLOW_TOKENIZE, *tokenize_args(src, out, bpe_file)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # val shards kept too (here the first comes with the third train shard): the line counts both
        wait_for_shards(child, out, 1, split="val")
        deadline = time.time() + 60
        # Ctrl-C while a shard is being written
        while not any(".bin.tmp-" in p.name for p in out.iterdir()):
            assert time.time() < deadline and child.poll() is None, "no shard temp file seen"
            time.sleep(0.005)
        os.kill(child.pid, signal.SIGINT)
        stdout, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 130 and "Traceback" not in stderr, stderr
    state = json.loads((out / PREPARE_STATE_FILE).read_text())
    done, val = len(state["shards"]["train"]), len(state["shards"]["val"])
    assert val > 0
    (line,) = stderr.strip().splitlines()
    assert line == (
        f"tokenize stopped: {done} train and {val} val shard(s) of {out} are kept; run the same command "
        f"again to continue from there"
    ), line
    left = sorted(p.name for p in out.iterdir() if not p.name.endswith(".bin"))
    assert left == [PREPARE_STATE_FILE, "tokenizer.json"], left  # no temp file, no lock file
    kept = {s["file"]: (out / s["file"]).stat().st_mtime_ns for s in state["shards"]["train"]}
    r = subprocess.run(
        [sys.executable, "-c", UNSLOWED, *tokenize_args(src, out, bpe_file)[:-1]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"resuming the unfinished run in {out}: {done} train" in r.stdout
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept  # continued, not redone
    assert data_files(out) == data_files(clean)


def test_a_finished_dataset_on_a_read_only_disk_is_still_reused(
    tmp_path, corpus, bpe_file, monkeypatch
):
    """Its lock file cannot be made there (simulated: these tests may run as root, whom chmod does not stop), and
    nothing else is written to reuse it; a new dataset there is one line naming the directory, leaving nothing."""
    import errno
    import shutil

    from gptlib.errors import RunDirError

    src, clean = corpus
    ro = tmp_path / "ro"
    shutil.copytree(clean, ro)

    def read_only(lock, *a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(lock.lock_file))

    monkeypatch.setattr(genc.FileLock, "acquire", read_only)
    opts = dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    assert prep.prepare([src], ro, **opts).splits == read_meta(clean).splits
    assert data_files(ro) == data_files(clean)
    with pytest.raises(
        RunDirError, match=f"cannot write to {tmp_path / 'new'}: Read-only file system"
    ):
        prep.prepare([src], tmp_path / "new", **opts)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "fault, says",
    [
        ("enospc", "No space left on device; free space there"),  # the free 15 GB of Drive used up
        (
            "enotconn",
            "Transport endpoint is not connected; is Google Drive answering? Wait a few minutes",
        ),
    ],
)
def test_a_shard_write_that_fails_is_one_line_naming_the_folder_and_the_rerun_resumes(
    tmp_path, corpus, bpe_file, monkeypatch, fault, says
):
    from gptlib.errors import RunDirError
    from tests import faulty

    src, clean = corpus
    out = tmp_path / "out"
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)  # the corpus dataset's shard cuts
    opts = dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    undo = faulty.install(f"{fault}:shard_mid@3")
    try:
        with pytest.raises(
            RunDirError, match="^" + re.escape(f"cannot write to {out}: {says}")
        ) as e:
            prep.prepare([src], out, **opts)
    finally:
        undo()
    # it did not say that the shards written are kept, nor that the same command resumes (Drive full: hours of
    # tokenizing seemed lost, and choosing another directory started over)
    said = f"; 3 train and 1 val shard(s) of {out} are kept; run the same command again to continue from there"
    assert str(e.value).endswith(said), e.value
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    kept = json.loads((out / PREPARE_STATE_FILE).read_text())["shards"]["train"]
    assert len(kept) == 3
    prep.prepare([src], out, **opts)
    assert data_files(out) == data_files(clean)


def test_an_error_without_errno_while_reading_is_not_called_a_write_failure(
    tmp_path, corpus, bpe_file, monkeypatch
):
    """An OSError with no errno and no file (pyarrow's, a dropped connection's) comes from reading, not from the
    data directory: it is not reported as 'cannot write to DIR'."""
    from gptlib.errors import RunDirError

    src, _ = corpus

    def dropped(self, texts):
        raise OSError("connection reset by peer")

    monkeypatch.setattr(BPETokenizer, "encode_batch_ids", dropped)
    with pytest.raises(OSError, match="connection reset") as e:
        prep.prepare([src], tmp_path / "out", tokenizer_from=bpe_file, verbose=False)
    assert not isinstance(e.value, RunDirError)


def test_a_shard_write_that_hangs_is_one_line_in_time_and_the_rerun_resumes(
    tmp_path, corpus, bpe_file
):
    """Drive stops answering while a shard is written: tokenize gives up on it after its time limit (here 1 s),
    saying so, where the progress bar stood still for good."""
    from tests import faulty

    src, clean = corpus
    out = tmp_path / "out"
    spec = "hang:shard_mid@2,data.shards.WRITE_TIMEOUT_S=1,data.encode.BATCH_CHARS=20000"
    r = subprocess.run(
        faulty.gptlib_cmd(spec, *tokenize_args(src, out, bpe_file)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(
        f"error: cannot write to {out}: writing {out / 'train_000002.bin'} made no progress for 1 s "
        f"(hung mount?); is Google Drive answering?"
    ), line
    r = subprocess.run(
        [sys.executable, "-c", UNSLOWED, *tokenize_args(src, out, bpe_file)[:-1]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"resuming the unfinished run in {out}: 2 train" in r.stdout
    assert data_files(out) == data_files(clean)


def test_a_shard_drive_has_not_synced_yet_at_resume_says_to_wait_and_the_rerun_resumes(
    tmp_path, corpus, bpe_file, monkeypatch
):
    """A new VM's Drive may show a shard the state lists before its bytes (lag): the resume refuses, as the
    shard may be damaged, but says that waiting may be all it takes, not only to start again (hours lost)."""
    from gptlib.errors import PrepareError, RunDirError
    from tests import faulty

    src, clean = corpus
    out = tmp_path / "out"
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)  # the corpus dataset's shard cuts
    opts = dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    undo = faulty.install("enotconn:shard_mid@3")
    try:
        with pytest.raises(RunDirError):
            prep.prepare([src], out, **opts)
    finally:
        undo()
    shard = out / "train_000001.bin"
    synced = shard.read_bytes()
    shard.write_bytes(b"")  # its size not yet visible
    with pytest.raises(
        PrepareError, match=f"shard {shard} .* not be synced yet: Wait a few minutes"
    ):
        prep.prepare([src], out, **opts)
    shard.write_bytes(synced)
    prep.prepare([src], out, **opts)
    assert data_files(out) == data_files(clean)


def test_a_failed_rename_in_a_relative_out_dir_is_one_line_naming_the_folder(
    tmp_path, corpus, bpe_file, monkeypatch
):
    """`tokenize --out data/x` (relative) on a Drive that drops as a shard is renamed into place: os.replace names the
    temp file by its absolute path, which was not seen as out_dir's, and the OSError went out bare, not as 'cannot
    write to data/x: ...'."""
    import errno

    from gptlib import fsutil
    from gptlib.errors import RunDirError

    src, _ = corpus
    real = fsutil.replace

    def dropped(tmp, dst):
        if str(dst).endswith(".bin"):
            raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN), str(tmp), None, str(dst))
        real(tmp, dst)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fsutil, "replace", dropped)
    with pytest.raises(
        RunDirError, match="^cannot write to out: Transport endpoint is not connected; is Google"
    ):
        prep.prepare([src], "out", tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)


def test_a_dropped_drives_line_is_not_replaced_by_the_lock_clean_ups_error(
    tmp_path, corpus, bpe_file, monkeypatch
):
    """A Drive that drops fails every call there, the lock file's unlink in the clean-up too: its OSError replaced the
    one line 'cannot write to ...; is Google Drive ...' with a traceback, and the lock stayed held by this process, so
    the cell run again (the Drive back) was refused as 'in use by another tokenize process'."""
    import errno

    from gptlib import fsutil
    from gptlib.errors import RunDirError

    src, clean = corpus
    real_replace, real_unlink, dropped = fsutil.replace, Path.unlink, [True]

    def replace(tmp, dst):
        if dropped[0] and str(dst).endswith(".bin"):
            raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN), str(tmp), None, str(dst))
        real_replace(tmp, dst)

    def unlink(self, *a, **k):
        if dropped[0] and self.name == genc.LOCK_FILE:
            raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN), str(self))
        return real_unlink(self, *a, **k)

    monkeypatch.setattr(fsutil, "replace", replace)
    monkeypatch.setattr(Path, "unlink", unlink)
    out, opts = tmp_path / "out", dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    with pytest.raises(RunDirError, match="Transport endpoint is not connected; is Google"):
        prep.prepare([src], out, **opts)
    dropped[0] = False  # the Drive back: the same process goes on
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)
    assert prep.prepare([src], out, **opts).splits == read_meta(clean).splits


def test_a_held_data_dir_in_a_notebook_says_to_run_the_cell_again(tmp_path, monkeypatch):
    """A tokenize cell (notebook 01 or 05) whose data folder another tokenize holds (a terminal's, or the cell run
    twice at once): the refusal said 'the same command then continues its work'. In a notebook: this cell."""
    from types import SimpleNamespace

    from filelock import FileLock

    from gptlib.errors import RunDirError

    src, out = tmp_path / "a.txt", tmp_path / "data"
    src.write_text("to be or not to be\n" * 100)
    out.mkdir()
    kernel = SimpleNamespace(get_ipython=lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    with FileLock(out / genc.LOCK_FILE):
        with pytest.raises(
            RunDirError, match="stop it, then run this cell again \\(it continues its work\\)"
        ):
            prep.prepare([src], out, tokenizer="char", verbose=False)
    assert sorted(p.name for p in out.iterdir()) == [genc.LOCK_FILE]


def test_what_a_stopped_tokenize_keeps_is_not_read_from_a_hung_drive(tmp_path, monkeypatch):
    """A shard write given up on a hung Drive (and Ctrl-C) says what is kept by reading tokenize's progress file on that
    same Drive: a read that cannot answer is given up too, and the line is said without it (was: a hang, after the
    write's own time limit, with nothing said)."""
    from concurrent.futures import wait

    import gptlib.colab as colab
    from gptlib.fsutil import in_background

    monkeypatch.setattr(colab, "DRIVE_CHECK_S", 0.5)
    fifo = tmp_path / PREPARE_STATE_FILE
    os.mkfifo(fifo)  # opening it blocks, as a file on a hung mount does
    kept = in_background(lambda: genc._kept(tmp_path))
    try:
        wait([kept], 10)
        assert kept.done() and kept.result() == ""
    finally:  # the blocked open returns (and reads nothing)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def lock_unlink_hangs(monkeypatch):
    """The data folder's lock file cannot be deleted (a hung Drive) until the returned event is set."""
    import threading

    answer, real_unlink = threading.Event(), Path.unlink

    def unlink(self, *a, **k):  # the lock file's: Drive does not answer
        if self.name == genc.LOCK_FILE:
            answer.wait(60)
        return real_unlink(self, *a, **k)

    monkeypatch.setattr(Path, "unlink", unlink)
    return answer


def test_a_hung_shard_writes_line_is_not_held_up_by_the_clean_up_on_the_same_drive(
    tmp_path, corpus, bpe_file, monkeypatch
):
    """On a hung mount every call there blocks: after the shard write is given up, the lock's clean-up in the data
    directory (its unlink, its close) is given up the same way, so the one line still comes (was: a hang in the
    clean-up, after the write's time limit, with nothing said)."""
    from concurrent.futures import wait

    import gptlib.colab as colab
    from gptlib.errors import RunDirError
    from gptlib.fsutil import in_background
    from tests import faulty

    src, _ = corpus
    faulty.install(
        "hang:shard_mid@2,data.shards.WRITE_TIMEOUT_S=1,data.encode.BATCH_CHARS=20000",
        monkeypatch.setattr,
    )
    monkeypatch.setattr(colab, "DRIVE_CHECK_S", 0.5)
    answer = lock_unlink_hangs(monkeypatch)
    out = tmp_path / "out"
    opts = dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    run = in_background(lambda: prep.prepare([src], out, **opts))
    try:
        wait([run], 20)
        assert run.done()
        with pytest.raises(RunDirError, match=f"cannot write to {re.escape(str(out))}: writing"):
            run.result()
    finally:
        answer.set()


@pytest.mark.parametrize("fault", ["kill", "enospc"])
def test_an_overwrite_that_dies_late_leaves_the_old_dataset_whole_and_the_rerun_resumes(
    tmp_path, corpus, bpe_file, fault
):
    """Notebook 01's OVERWRITE = True on a finished dataset, killed (Colab gone) or failing (Drive full) after three
    shards of the new one: the old dataset was deleted before encoding, so the user had neither. The old one stays
    whole (every shard's sha256, as training reads it) until the new one is complete, and the same command resumes
    the new one."""
    from tests import faulty

    src, clean = corpus
    out = tmp_path / "out"
    old = prep.prepare([src], out, tokenizer_from=bpe_file, val_fraction=0.2, verbose=False)
    old_files = data_files(out)
    r = subprocess.run(
        faulty.gptlib_cmd(
            f"{fault}:shard_mid@3,data.encode.BATCH_CHARS=20000",
            *tokenize_args(src, out, bpe_file),
            "--overwrite",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == {"kill": -9, "enospc": 2}[fault], r.stderr
    assert verified_meta(out).splits == old.splits
    # the lock file a kill leaves is not the dataset's
    assert {k: v for k, v in data_files(out).items() if k != genc.LOCK_FILE} == old_files
    if fault == "enospc":
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith(f"error: cannot write to {out}: No space left on device"), line
        assert line.endswith(
            f"3 train and 1 val shard(s) of {out / genc.OVERWRITE_DIR} are kept and the dataset in {out} is "
            f"unchanged; run the same command again to continue from there"
        ), line
    r = subprocess.run(
        [sys.executable, "-c", UNSLOWED, *tokenize_args(src, out, bpe_file)[:-1], "--overwrite"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "resuming the unfinished run in" in r.stdout and ": 3 train" in r.stdout, r.stdout
    assert data_files(out) == data_files(clean) and not (out / genc.OVERWRITE_DIR).exists()
    verified_meta(out)


def test_an_overwrite_killed_as_it_replaces_the_dataset_leaves_one_whole_and_the_rerun_ends_it(
    tmp_path, corpus, bpe_file, monkeypatch
):
    """The new dataset complete, a kill at each deletion or rename in the data directory as it takes the old one's
    place: a meta.json there always names a whole dataset (the old or the new), and the same command ends the
    replacement without encoding anything again."""
    import shutil

    from gptlib.data.shards import META_FILE
    from tests.tokenize_kit import Killed

    src, clean = corpus
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)  # the corpus dataset's shard cuts
    opts = dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    # more shards than the new one: the old ones past its last go too
    old = prep.prepare([src], tmp_path / "old", **{**opts, "shard_tokens": 4000})
    new = read_meta(clean)
    real_unlink, real_replace = Path.unlink, os.replace

    def overwrite_killed_at(k: int, out: Path) -> bool:
        """-> whether the k-th deletion or rename of a file of `out` (not the lock) killed the overwrite."""
        ops = [0]

        def op(path):
            if Path(path).parent == out and Path(path).name != genc.LOCK_FILE:
                ops[0] += 1
                if ops[0] == k:
                    raise Killed()

        def unlink(self, *a, **kw):
            op(self)
            return real_unlink(self, *a, **kw)

        def replace(src_, dst, *a, **kw):
            op(dst)
            return real_replace(src_, dst, *a, **kw)

        monkeypatch.setattr(Path, "unlink", unlink)
        monkeypatch.setattr(os, "replace", replace)
        try:
            prep.prepare([src], out, overwrite=True, **opts)
            return False
        except Killed:
            return True
        finally:
            monkeypatch.setattr(Path, "unlink", real_unlink)
            monkeypatch.setattr(os, "replace", real_replace)

    def no_encoding(self, texts):
        raise AssertionError("the new dataset encoded again")

    # the new dataset complete beside the old one, killed at the first step of the replacement
    pending = tmp_path / "pending"
    shutil.copytree(tmp_path / "old", pending)
    assert overwrite_killed_at(1, pending) and verified_meta(pending).splits == old.splits
    monkeypatch.setattr(BPETokenizer, "encode_batch_ids", no_encoding)
    for k in range(1, 1000):
        out = tmp_path / f"kill_{k}"
        shutil.copytree(pending, out)
        if not overwrite_killed_at(k, out):
            break
        if (out / META_FILE).exists():
            assert verified_meta(out).splits in (old.splits, new.splits), k
        prep.prepare([src], out, overwrite=True, **opts)
        assert data_files(out) == data_files(clean), k
        assert not (out / genc.OVERWRITE_DIR).exists(), k
    # a kill at each of them (the old meta.json, the old shards past the new last, the new files), and then at none
    assert k > len(old.splits["train"]["shards"]) and data_files(out) == data_files(clean), k


def test_a_rerun_in_the_same_kernel_while_the_last_clean_up_is_stuck_on_drive_says_so(
    tmp_path, corpus, bpe_file, monkeypatch
):
    """The tokenize cell run again in the same kernel after a shard write given up on a hung Drive, while that run's
    clean-up (its lock file's unlink, given up too) still hangs there holding the lock: refused as 'in use by another
    tokenize process', which sends the user looking for one. It says the last run in this process is stuck on Drive,
    and once Drive answers the cell run again resumes."""
    import time
    from concurrent.futures import wait

    import gptlib.colab as colab
    from gptlib.errors import RunDirError
    from gptlib.fsutil import in_background
    from tests import faulty

    src, clean = corpus
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)  # the corpus dataset's shard cuts
    undo = faulty.install("hang:shard_mid@2,data.shards.WRITE_TIMEOUT_S=1")
    monkeypatch.setattr(colab, "DRIVE_CHECK_S", 0.5)
    answer = lock_unlink_hangs(monkeypatch)
    out = tmp_path / "out"
    opts = dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    try:
        run = in_background(lambda: prep.prepare([src], out, **opts))
        wait([run], 20)
        with pytest.raises(RunDirError, match="cannot write to .*: writing"):
            run.result()
        undo()
        for _ in range(2):  # and run again: the same
            with pytest.raises(RunDirError) as e:
                prep.prepare([src], out, **opts)
            assert str(e.value) == (
                f"{out} is still held by the last tokenize in this process (a notebook's kernel), its clean-up "
                f"stuck on a Google Drive that does not answer: Wait a few minutes and re-run, or remount Drive "
                f"(Colab: drive.mount('/content/drive', force_remount=True)) and re-run"
            ), e.value
    finally:
        undo()
        answer.set()
    deadline = time.monotonic() + 10
    while True:  # the clean-up ends as Drive answers
        try:
            assert prep.prepare([src], out, **opts).splits == read_meta(clean).splits
            break
        except RunDirError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert data_files(out) == data_files(clean)


def test_an_overwrite_killed_as_it_replaces_the_dataset_is_ended_by_a_rerun_without_overwrite(
    tmp_path, corpus, bpe_file, monkeypatch
):
    """Killed mid-way as the new dataset took the old one's place (the old meta.json gone): the next tokenize without
    --overwrite (OVERWRITE set back to False, notebook 03's 'no dataset' sending the user back to notebook 01)
    encoded it all again into OUT beside the complete one left in OUT/.overwrite, which a later --overwrite then
    moved over it: a meta.json naming the other dataset's shards. The replacement is ended, nothing encoded again."""
    from gptlib.data.shards import META_FILE
    from tests.tokenize_kit import Killed

    src, clean = corpus
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)  # the corpus dataset's shard cuts
    opts = dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    out = tmp_path / "out"
    prep.prepare([src], out, **{**opts, "shard_tokens": 4000})
    real_replace, moved = os.replace, []

    def replace(src_, dst, *a, **kw):  # killed after the tokenizer and a shard were moved into OUT
        if Path(dst).parent == out:
            moved.append(dst)
            if len(moved) == 3:
                raise Killed()
        return real_replace(src_, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Killed):
        prep.prepare([src], out, overwrite=True, **opts)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (out / META_FILE).exists() and (out / genc.OVERWRITE_DIR / META_FILE).is_file()

    def no_encoding(self, texts):
        raise AssertionError("the new dataset encoded again")

    monkeypatch.setattr(BPETokenizer, "encode_batch_ids", no_encoding)
    assert prep.prepare([src], out, **opts).splits == read_meta(clean).splits
    assert data_files(out) == data_files(clean) and not (out / genc.OVERWRITE_DIR).exists()


def test_a_stopped_overwrite_whose_shard_drive_has_not_synced_yet_says_to_wait_not_starts_over(
    tmp_path, corpus, bpe_file, monkeypatch, capsys
):
    """A stopped --overwrite resumes only with --overwrite (the old dataset is there): on a new VM whose Drive shows
    a shard of OUT/.overwrite before its bytes, --overwrite's 'start again an unfinished run that fails its checks'
    deleted every shard made so far and encoded them all again (hours, for a lag). It says to wait, as a resume
    without --overwrite does, deletes nothing, and the re-run resumes."""
    from gptlib.errors import PrepareError, RunDirError
    from tests import faulty

    src, clean = corpus
    out = tmp_path / "out"
    monkeypatch.setattr(genc, "BATCH_CHARS", 20_000)  # the corpus dataset's shard cuts
    opts = dict(tokenizer_from=bpe_file, shard_tokens=5000, verbose=False)
    old = prep.prepare([src], out, **{**opts, "shard_tokens": 4000})
    undo = faulty.install("enotconn:shard_mid@3")
    try:
        with pytest.raises(RunDirError):
            prep.prepare([src], out, overwrite=True, **opts)
    finally:
        undo()
    shard = out / genc.OVERWRITE_DIR / "train_000001.bin"
    synced = shard.read_bytes()
    shard.write_bytes(b"")  # its size not yet visible
    with pytest.raises(PrepareError, match=f"shard {shard} .* not be synced yet: Wait") as e:
        prep.prepare([src], out, overwrite=True, **opts)
    # --overwrite (OVERWRITE = True) is what the user already gave
    assert str(e.value).endswith(f"; else delete {out / genc.OVERWRITE_DIR} to start it over"), (
        e.value
    )
    assert verified_meta(out).splits == old.splits
    shard.write_bytes(synced)
    prep.prepare([src], out, overwrite=True, **{**opts, "verbose": True})
    assert (
        f"resuming the unfinished run in {out / genc.OVERWRITE_DIR}: 3 train"
        in capsys.readouterr().out
    )
    assert data_files(out) == data_files(clean) and not (out / genc.OVERWRITE_DIR).exists()
