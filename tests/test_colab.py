"""The Colab code path, in CI: a fake `google.colab` whose drive.mount maps to a temp dir."""

from __future__ import annotations

import json
import re
import shutil
import sys
import types

import pytest
import torch

from gptlib import colab
from gptlib.checkpoint.format import verify_checkpoint
from gptlib.errors import GptlibError
from gptlib.training.logs import read_metrics
from gptlib.training.loop import train
from tests.conftest import TINY


class FakeDrive:
    def __init__(self, fail: Exception | None = None):
        self.calls: list[dict] = []
        self.fail = fail

    def mount(self, mountpoint, force_remount=False, timeout_ms=120000, readonly=False):
        self.calls.append(
            {"mountpoint": mountpoint, "force_remount": force_remount, "timeout_ms": timeout_ms}
        )
        if self.fail is not None:
            raise self.fail
        from pathlib import Path

        (Path(mountpoint) / "MyDrive").mkdir(parents=True, exist_ok=True)


@pytest.fixture
def fake_colab(monkeypatch, tmp_path):
    drive = FakeDrive()
    google = types.ModuleType("google")
    gcolab = types.ModuleType("google.colab")
    gcolab.drive = drive
    google.colab = gcolab
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", gcolab)
    monkeypatch.setattr(colab, "DRIVE_MOUNT", tmp_path / "content" / "drive")
    monkeypatch.setattr(colab, "COLAB_LOCAL_ROOT", tmp_path / "content" / "gptlib_local")
    monkeypatch.delenv("GPTLIB_ROOT", raising=False)
    return drive


def test_outside_colab_uses_local_root(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    assert not colab.in_colab()
    roots = colab.setup()
    assert roots.persistent == roots.local == tmp_path / "root"
    rp = colab.run_paths("shakespeare", roots)
    assert rp.run_dir == tmp_path / "root" / "runs" / "shakespeare" and rp.mirror_dir is None
    assert colab.data_dir("shakespeare", roots) == tmp_path / "root" / "data" / "shakespeare"
    with pytest.raises(GptlibError, match="needs Google Colab"):
        colab.mount_drive()


def test_outside_colab_default_is_cwd(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    monkeypatch.delenv("GPTLIB_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert colab.run_paths("r").run_dir.resolve() == (tmp_path / "runs" / "r").resolve()


def test_colab_mounts_drive_once(fake_colab, tmp_path):
    assert colab.in_colab()
    roots = colab.setup()
    roots2 = colab.setup()  # re-running the cell: already mounted, no second mount
    assert len(fake_colab.calls) == 1
    assert roots == roots2
    assert roots.persistent == tmp_path / "content" / "drive" / "MyDrive" / "gptlib"
    assert roots.local == tmp_path / "content" / "gptlib_local"
    rp = colab.run_paths("gpt2", roots)
    assert (
        rp.run_dir == roots.local / "runs" / "gpt2"
        and rp.mirror_dir == roots.persistent / "runs" / "gpt2"
    )
    assert colab.data_dir("owt", roots) == roots.persistent / "data" / "owt"


def test_colab_stale_mount_is_forced(fake_colab, tmp_path):
    mp = tmp_path / "content" / "drive"
    mp.mkdir(parents=True)
    (mp / "leftover").write_text("x")  # something there, but no MyDrive: a dead or partial mount
    colab.mount_drive()
    assert fake_colab.calls[-1]["force_remount"] is True


def test_colab_hung_mount_is_remounted_not_waited_on_forever(fake_colab, tmp_path, monkeypatch):
    """A hung Drive mount (a FUSE call that never returns): the set-up cell's look at MyDrive waited forever. It
    gives up after DRIVE_CHECK_S and remounts, as for a dead mount."""
    import threading
    from pathlib import Path

    my_drive, is_dir, released = (
        tmp_path / "content" / "drive" / "MyDrive",
        Path.is_dir,
        threading.Event(),
    )
    my_drive.mkdir(parents=True)

    def hung_until_remounted(path):
        if path == my_drive and not fake_colab.calls:
            released.wait(30)  # the hung mount: answers only long after
        return is_dir(path)

    monkeypatch.setattr(Path, "is_dir", hung_until_remounted)
    monkeypatch.setattr(colab, "DRIVE_CHECK_S", 0.2)
    try:
        assert colab.mount_drive() == tmp_path / "content" / "drive"
        assert [c["force_remount"] for c in fake_colab.calls] == [True]
    finally:
        released.set()


def test_setups_folders_on_a_hung_drive_are_given_up_in_time_with_one_line(
    fake_colab, tmp_path, monkeypatch
):
    """Every notebook's set-up cell: after the timed look at MyDrive, colab.setup() made gptlib's folder on Drive with
    no time limit, so a mount hung since then held the cell with nothing said. It is given up after DRIVE_CHECK_S as
    the look is: one line naming the folder and what to do."""
    import threading
    import time
    from pathlib import Path

    from gptlib.errors import HungIOError

    roots = colab.setup()  # mounted
    mkdir, released = Path.mkdir, threading.Event()

    def hung(path, *a, **k):
        if path == roots.persistent:
            released.wait(10)  # the hung mount: answers only long after
        return mkdir(path, *a, **k)

    monkeypatch.setattr(Path, "mkdir", hung)
    monkeypatch.setattr(colab, "DRIVE_CHECK_S", 0.2)
    try:
        t0 = time.monotonic()
        with pytest.raises(HungIOError) as e:
            colab.setup()
        assert time.monotonic() - t0 < 5
    finally:
        released.set()
    said = e.value._render_traceback_()
    assert said == [
        f"HungIOError: [Errno 110] creating {roots.persistent} made no progress for 0.2 s (hung mount?): Wait a "
        f"few minutes and re-run, or remount Drive (Colab: drive.mount('/content/drive', force_remount=True)) and "
        f"re-run"
    ], said


def test_colab_mount_timeout_has_clear_message(fake_colab, monkeypatch):
    fake_colab.fail = TimeoutError("Timed out waiting for authorization")
    with pytest.raises(GptlibError) as ei:
        colab.setup(timeout_s=5)
    msg = str(ei.value)
    assert "did not mount" in msg and "authorization" in msg
    # its advice works from every cell (each calls setup()): the VM's disk only, no mount, no mirror
    [advice] = re.findall(r"os\.environ\['GPTLIB_ROOT'\] = '([^']+)'", msg)
    monkeypatch.setenv("GPTLIB_ROOT", advice)
    fake_colab.fail = None
    assert colab.run_paths("mine").mirror_dir is None and len(fake_colab.calls) == 1


def test_colab_without_drive_keeps_everything_local(fake_colab, tmp_path):
    roots = colab.setup(use_drive=False)
    assert (
        not fake_colab.calls
        and roots.persistent == roots.local
        and colab.run_paths("x", roots).mirror_dir is None
    )


def test_colab_gptlib_root_off_drive_does_not_mount(fake_colab, tmp_path, monkeypatch):
    """GPTLIB_ROOT set to a folder on the VM to stay off Drive: no Drive prompt, no wait for a mount (it mounted
    Drive all the same); a GPTLIB_ROOT on Drive mounts it first, as the default root does."""
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "content" / "mine"))
    roots = colab.setup()
    assert not fake_colab.calls and roots.persistent == tmp_path / "content" / "mine"
    monkeypatch.setenv(
        "GPTLIB_ROOT", f"{colab.DRIVE_MOUNT}/../mine2"
    )  # beside the mount point, not in it
    assert colab.setup().persistent.is_dir() and not fake_colab.calls
    on_drive = colab.DRIVE_MOUNT / "MyDrive" / "elsewhere"
    monkeypatch.setenv("GPTLIB_ROOT", str(on_drive))
    assert colab.setup().persistent == on_drive and len(fake_colab.calls) == 1


def test_a_data_dir_on_drive_mounts_drive_with_gptlib_root_off_drive(
    fake_colab, tmp_path, char_data, monkeypatch
):
    """Notebook 03 with GPTLIB_ROOT on the VM and DATA_DIR on Drive: Drive is mounted for the data only."""
    from gptlib.data.shards import find_dataset

    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "content" / "mine"))

    def mount(mountpoint, **kw):
        fake_colab.calls.append({"mountpoint": mountpoint})
        shutil.copytree(char_data, f"{mountpoint}/MyDrive/mydata")

    fake_colab.mount = mount
    d = colab.DRIVE_MOUNT / "MyDrive" / "mydata"
    assert find_dataset(data_dir=d) == d and len(fake_colab.calls) == 1


def test_bad_run_name():
    with pytest.raises(ValueError, match="plain directory name"):
        colab.run_paths("../escape", colab.Roots(persistent=colab.Path("."), local=colab.Path(".")))


@pytest.mark.parametrize("name", ["a/b", "", " ", "..", "a\\b"])
def test_a_bad_run_or_data_name_is_a_gptlib_error(name, tmp_path):
    """A bad RUN_NAME or DATASET_NAME is the user's to fix, as every other bad input: a ConfigError (a GptlibError,
    still a ValueError), not a plain ValueError."""
    from gptlib.errors import ConfigError

    roots = colab.Roots(persistent=tmp_path, local=tmp_path)
    for call in (colab.run_paths, colab.data_dir):
        with pytest.raises(ConfigError, match=r"name .*: use a plain directory name"):
            call(name, roots)


def test_a_name_or_folder_pasted_with_spaces_is_the_same_run(tmp_path, char_data):
    """A name or folder pasted into a notebook's form with a trailing space or newline: the same run, not a new run
    "phase1 " (02, 03) or "no complete checkpoint in .../phase1 " (04, 05)."""
    from gptlib.inference.loading import find_run
    from gptlib.training.loop import train

    char_run = tmp_path / "run"
    train(char_data, char_run, overrides=TINY, max_steps=2, progress=False, log=lambda s: None)
    roots = colab.Roots(persistent=tmp_path / "drive", local=tmp_path / "local")
    assert colab.run_paths(" phase1\n", roots) == colab.run_paths("phase1", roots)
    assert colab.data_dir("shakespeare ", roots) == colab.data_dir("shakespeare", roots)
    assert find_run(run_dir=f"{char_run}  \n") == char_run


def hellaswag_settings(tmp_path) -> list[str]:
    """TINY, saving every 5 steps, with HellaSwag at step 10 on 4 of 8 made-up items (tmp_path/hs.jsonl)."""
    items = [
        {"ctx": "ROMEO:", "endings": [" a", " b", " c", " d"], "label": i % 4} for i in range(8)
    ]
    hs_file = tmp_path / "hs.jsonl"
    hs_file.write_text("".join(json.dumps(it) + "\n" for it in items))
    hs = ["hellaswag_every=10", "hellaswag_items=4", f"hellaswag_file={hs_file}"]
    return TINY + ["save_every_steps=5", *hs]


def train_tiny_on_colab(char_data, settings: list[str]):
    """10 steps of run "tiny" on 'Colab': its local run dir, checkpoints mirrored to Drive -> (its paths, result)."""
    rp = colab.run_paths("tiny", colab.setup())
    r = train(
        char_data,
        rp.run_dir,
        "phase1",
        settings,
        max_steps=10,
        device="cpu",
        progress=False,
        mirror_dir=rp.mirror_dir,
    )
    return rp, r


def test_colab_disconnect_resume_from_drive(fake_colab, tmp_path, char_data, capsys):
    """Train on 'Colab', lose the VM's local disk, re-run the same cell: it resumes from Drive."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        settings = TINY + ["save_every_steps=5"]
        rp, r = train_tiny_on_colab(char_data, settings)
        assert r.step == 10
        assert verify_checkpoint(rp.mirror_dir / "checkpoints" / "step_0000010").step == 10
        for name in ("config.json", "tokenizer.json", "loss.png"):
            assert (rp.mirror_dir / name).is_file(), name
        assert (
            rp.mirror_dir / "checkpoints" / "step_0000010" / "metrics.jsonl"
        ).is_file()  # the logs: inside it
        shutil.rmtree(colab.setup().local)  # disconnect: a new VM, same Drive
        rp2 = colab.run_paths("tiny", colab.setup())
        capsys.readouterr()
        r2 = train(
            char_data,
            rp2.run_dir,
            "phase1",
            settings,
            max_steps=15,
            device="cpu",
            progress=False,
            mirror_dir=rp2.mirror_dir,
        )
        out = capsys.readouterr().out
        assert r2.resumed_from == 10 and "on the Drive mirror" in out, out
        # the curve continues
        assert [row["step"] for row in read_metrics(rp2.run_dir)] == list(range(1, 16))
        assert verify_checkpoint(rp2.mirror_dir / "checkpoints" / "step_0000015").step == 15
    finally:
        torch.set_num_threads(n)


def test_a_resume_refused_for_other_data_names_drives_dataset_and_copies_nothing(
    fake_colab, tmp_path, small_text, monkeypatch
):
    """Notebook 03 on a fresh VM, its DATASET_NAME tokenized again with other text: the resume was refused after the
    dataset was copied to the VM's disk (gpt2-small's: gigabytes, minutes), and the line named that copy, not the
    dataset on Drive. The checks come first: the refusal names the folder on Drive, and nothing is copied."""
    from gptlib.data.prepare import prepare_text

    data = colab.data_dir("chars", colab.setup())
    prepare_text([small_text], data, tokenizer="char", verbose=False)
    train_tiny_on_colab(data, TINY)
    shutil.rmtree(colab.setup().local)  # a new VM, same Drive
    shutil.rmtree(data)
    other = tmp_path / "other.txt"  # the same characters, other text
    other.write_text("\n".join(reversed(small_text.read_text().splitlines())))
    prepare_text([other], data, tokenizer="char", verbose=False)
    rp = colab.run_paths("tiny", colab.setup())
    with pytest.raises(GptlibError) as e:  # the run trained on
        train(
            data, rp.run_dir, "phase1", TINY, max_steps=15, device="cpu", mirror_dir=rp.mirror_dir
        )
    assert f"trained on other data than {data} (tokens_sha256 " in str(e.value), e.value
    assert not (colab.COLAB_LOCAL_ROOT / "data").exists()


def test_a_data_dir_on_drive_mounts_drive_before_it_is_looked_at(fake_colab, tmp_path, char_data):
    """Notebook 03 on a fresh VM with DATA_DIR = a dataset on Drive: Drive is mounted first (it was mounted only for
    DATASET_NAME, so the dataset "did not exist"); a DATA_DIR pasted with a space is the same folder."""
    import shutil

    from gptlib.data.shards import find_dataset

    store = tmp_path / "drive_store"  # Drive's files, seen only once mounted
    shutil.copytree(char_data, store / "MyDrive" / "mydata")

    def mount(mountpoint, **kw):
        fake_colab.calls.append({"mountpoint": mountpoint})
        shutil.copytree(store, mountpoint, dirs_exist_ok=True)

    fake_colab.mount = mount
    d = colab.DRIVE_MOUNT / "MyDrive" / "mydata"
    assert find_dataset(data_dir=f"{d} ") == d and len(fake_colab.calls) == 1


def test_notebook_02s_results_cells_on_a_fresh_vm_read_the_run_on_drive(
    fake_colab, tmp_path, char_data, capsys
):
    """A fresh VM, notebook 02 opened to look at a run trained earlier: its set-up cells, then the loss curve, the
    samples and the generation cells, without the train cell (the VM's disk is empty). They read the run's copy on
    Drive; they used to fail on the VM's missing run dir."""
    import json

    from tests.nbrun import NOTEBOOKS

    rp, _ = train_tiny_on_colab(char_data, TINY + ["eval_interval=5", "save_every_steps=5"])
    shutil.rmtree(colab.setup().local)  # a new VM, same Drive
    cells = json.loads((NOTEBOOKS / "02_phase1_shakespeare.ipynb").read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    after_train = code[code.index(next(c for c in code if "result = train(" in c)) + 1 :]
    shown = []
    ipython_display = pytest.importorskip("IPython.display")
    capsys.readouterr()
    scope = {"RUN_NAME": "tiny", "SEED": 1, "paths": colab.run_paths("tiny", colab.setup())}
    real = ipython_display.display
    ipython_display.display = shown.append
    try:
        for source in after_train:
            exec(source, scope)
    finally:
        ipython_display.display = real
    image, table = shown[:2]
    assert image.data[:8] == b"\x89PNG\r\n\x1a\n"  # loss.png, from Drive
    assert (
        scope["run_dir"] == rp.mirror_dir
        and "step" in table.data
        and "no samples yet" not in table.data
    )
    assert capsys.readouterr().out.startswith("ROMEO:")


def test_notebook_02_on_a_fresh_vm_with_another_text_is_refused_naming_it_and_leaves_a_run_notebook_04_reads(
    fake_colab, tmp_path, small_text, monkeypatch
):
    """Notebook 02 trained on Drive, then on a fresh VM TEXT_PATH changed to another text, same RUN_NAME: its data
    cell is refused (the dataset RUN_NAME on Drive holds the old text's); that folder deleted, training is refused
    naming TEXT_PATH and RUN_NAME (it named vocab_size, a field the user never set, and said 'drop the change'); the
    checkpoint it copied from Drive to the VM's run folder came without the run's tokenizer.json, and notebook 04,
    which prefers that copy, failed with 'tokenizer mismatch' (it read the new text's). The old TEXT_PATH, as said,
    resumes."""
    import json

    from gptlib.data import prepare
    from gptlib.data.prepare import prepare_text
    from gptlib.evaluation.evaluate import evaluate_run
    from gptlib.inference.loading import find_run
    from gptlib.training import resume

    data = colab.data_dir("tiny", colab.setup())

    def notebook_02(text, steps):  # its data and train cells
        paths = colab.run_paths("tiny", colab.setup())
        prepare_text([text], data, tokenizer="char", verbose=False)
        return train(
            data,
            paths.run_dir,
            "phase1",
            TINY,
            max_steps=steps,
            device="cpu",
            progress=False,
            log=lambda s: None,
            mirror_dir=paths.mirror_dir,
        )

    notebook_02(small_text, 10)
    shutil.rmtree(colab.setup().local)  # a new VM, same Drive
    other = tmp_path / "other.txt"
    other.write_text(small_text.read_text().lower())  # fewer characters: another vocabulary
    monkeypatch.setattr(resume, "in_notebook", lambda: True)
    monkeypatch.setattr(prepare, "in_notebook", lambda: True)
    with pytest.raises(GptlibError) as e:
        notebook_02(other, 15)
    assert f"{data} already holds a different dataset" in str(e.value), e.value
    assert "set TEXT_PATH back to the text it was made from (or delete the folder)" in str(e.value)
    shutil.rmtree(data)  # deleted, as said: the other text tokenized there, training refused
    with pytest.raises(GptlibError) as e:
        notebook_02(other, 15)
    msg = str(e.value)
    assert "vocab_size=" not in msg and "drop the change" not in msg, msg
    assert f"set TEXT_PATH back to the text it was trained on (and delete {data})" in msg, msg
    assert "or choose a new RUN_NAME" in msg, msg
    # notebook 04: the run's copy it picks loads, for HellaSwag as for bpb
    items = tmp_path / "hs.jsonl"
    items.write_text(
        json.dumps({"ctx": "ROMEO", "endings": ["a", "b", "c", "d"], "label": 1}) + "\n"
    )
    [row] = evaluate_run(find_run("tiny"), "hellaswag", "latest", device="cpu", data=str(items))
    assert row["step"] == 10 and row["n"] == 1
    # as the message says: the old text (its data folder made again), and the run goes on
    shutil.rmtree(data)
    assert notebook_02(small_text, 15).resumed_from == 10


def test_a_run_dir_on_drive_is_mounted_before_it_is_looked_at(fake_colab, tmp_path, char_data):
    """Notebook 04 on a fresh VM with RUN_DIR on Drive: Drive is mounted, then the run is found (it said there was no
    complete checkpoint there: train first)."""
    from gptlib.inference.loading import find_run

    made = tmp_path / "made"
    train(char_data, made, overrides=TINY, max_steps=2, progress=False, log=lambda s: None)

    def mount(mountpoint, **kw):
        fake_colab.calls.append({"mountpoint": mountpoint})
        shutil.copytree(made, f"{mountpoint}/MyDrive/runs/mine")

    fake_colab.mount = mount
    d = colab.DRIVE_MOUNT / "MyDrive" / "runs" / "mine"
    assert find_run(run_dir=f" {d}\n") == d and len(fake_colab.calls) == 1


def test_an_export_to_drive_mounts_drive_with_gptlib_root_off_drive(
    fake_colab, tmp_path, char_data, monkeypatch
):
    """Notebook 04's EXPORT_DIR on Drive with GPTLIB_ROOT on the VM: Drive is mounted before the export is written
    (it was written under the unmounted mount point, on the VM's disk: lost at a disconnect)."""
    from gptlib.inference.export import export_hf

    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "content" / "mine"))
    run = tmp_path / "run"
    train(char_data, run, overrides=TINY, max_steps=2, progress=False, log=lambda s: None)
    out = colab.DRIVE_MOUNT / "MyDrive" / "exports" / "mine"
    export_hf(run, out)
    assert len(fake_colab.calls) == 1 and (out / "config.json").is_file()


def test_eval_rows_survive_a_vm_reset(fake_colab, tmp_path, char_data):
    """eval.jsonl lived on the VM's disk only: after a VM reset notebook 04 (reading the run's Drive copy) scored every
    checkpoint again (GPU time) and the model card lost its eval rows. The rows reach the Drive copy (training's
    end-of-run row with the checkpoint, Evaluate's as it appends them), a run resumed from Drive keeps them, and
    Evaluate on the Drive copy reuses them."""
    from gptlib.evaluation.evaluate import evaluate_run
    from gptlib.fsutil import read_jsonl
    from gptlib.inference.loading import find_run
    from gptlib.layout import EVAL_FILE

    settings = hellaswag_settings(tmp_path)
    rp, _ = train_tiny_on_colab(char_data, settings)
    assert [r["source"] for r in read_jsonl(rp.mirror_dir / EVAL_FILE)] == ["training"]
    said = []
    kw = dict(device="cpu", progress=False, warn=said.append, limit=4)
    # notebook 04 on the same VM: the VM's copy of the run (as new as Drive's)
    assert find_run("tiny") == rp.run_dir
    first = evaluate_run(rp.run_dir, "bpb", "all", **kw)
    assert read_jsonl(rp.mirror_dir / EVAL_FILE) == read_jsonl(rp.run_dir / EVAL_FILE)
    shutil.rmtree(
        colab.setup().local
    )  # the VM is gone: notebook 04 on a new one reads Drive's copy
    assert find_run("tiny") == rp.mirror_dir
    assert evaluate_run(rp.mirror_dir, "bpb", "all", **kw) == first
    assert said == [
        f"bpb: reused the rows {rp.mirror_dir / EVAL_FILE} records for steps 5, 10 (the same checkpoint and "
        f"settings); 0 scored now; delete a row to score it again"
    ]
    # training resumed from Drive on the new VM: its copy of eval.jsonl keeps the rows, and Drive's with it
    r = train(
        char_data,
        rp.run_dir,
        "phase1",
        settings,
        max_steps=15,
        device="cpu",
        progress=False,
        mirror_dir=rp.mirror_dir,
    )
    assert r.resumed_from == 10
    rows = read_jsonl(rp.mirror_dir / EVAL_FILE)
    assert [(x["task"], x["step"]) for x in rows] == [
        ("hellaswag", 10),
        ("bpb", 5),
        ("bpb", 10),
        ("hellaswag", 15),
    ]


def test_eval_rows_from_another_vm_survive_training_going_on(fake_colab, tmp_path, char_data):
    """Notebook 04 runs on its own VM: it evaluates the run's Drive copy, appending to Drive's eval.jsonl, while the
    training VM still holds the run. Training going on there (or Evaluate of its local copy) copied the VM's
    eval.jsonl over Drive's, and notebook 04's rows were gone. Drive's rows are kept, the VM's added after them."""
    from gptlib.evaluation.evaluate import evaluate_run
    from gptlib.fsutil import read_jsonl
    from gptlib.layout import EVAL_FILE

    settings = hellaswag_settings(tmp_path)
    rp, _ = train_tiny_on_colab(char_data, settings)
    kw = dict(device="cpu", progress=False, warn=lambda s: None, limit=4)
    # notebook 04 on another VM: the run's Drive copy
    evaluate_run(rp.mirror_dir, "bpb", "all", **kw)
    # training goes on on its VM (its local copy as new as Drive's): the mirror copies its eval.jsonl
    train(
        char_data,
        rp.run_dir,
        "phase1",
        settings,
        max_steps=15,
        device="cpu",
        progress=False,
        mirror_dir=rp.mirror_dir,
    )
    rows = [(r["task"], r["step"]) for r in read_jsonl(rp.mirror_dir / EVAL_FILE)]
    assert rows == [("hellaswag", 10), ("bpb", 5), ("bpb", 10), ("hellaswag", 15)]
    # and Evaluate of the training VM's copy adds its rows after Drive's
    evaluate_run(rp.run_dir, "bpb", "15", **kw)
    rows = [(r["task"], r["step"]) for r in read_jsonl(rp.mirror_dir / EVAL_FILE)]
    assert rows == [("hellaswag", 10), ("bpb", 5), ("bpb", 10), ("hellaswag", 15), ("bpb", 15)]


def test_a_row_notebook_04_appends_while_training_copies_its_logs_stays(
    fake_colab, tmp_path, char_data, monkeypatch
):
    """Notebook 04 on its own VM appends a row to Drive's eval.jsonl while notebook 03 trains on (its VM's eval.jsonl
    holding no row Drive lacks): the mirror rewrote Drive's file at every checkpoint copy all the same, and a row
    appended meanwhile went into the replaced file: lost. With nothing new it leaves Drive's file alone."""
    import gptlib.checkpoint.mirror as mirror
    from gptlib.fsutil import read_jsonl
    from gptlib.layout import EVAL_FILE

    hs_file = tmp_path / "hs.jsonl"
    item = {"ctx": "ROMEO:", "endings": [" a", " b", " c", " d"], "label": 1}
    hs_file.write_text(json.dumps(item) + "\n")
    settings = TINY + ["save_every_steps=5", "hellaswag_every=10", f"hellaswag_file={hs_file}"]
    rp, _ = train_tiny_on_colab(char_data, settings)  # its end-of-run row: on Drive
    copy_rows, raced = mirror.copy_rows, []

    def with_an_append_under_way(
        src, dst
    ):  # notebook 04's append_jsonl: the file opened, then written
        with open(dst, "ab") as f:
            copy_rows(src, dst)
            if not raced:
                raced.append(f.write(json.dumps({"task": "bpb", "step": 5}).encode() + b"\n"))

    monkeypatch.setattr(mirror, "copy_rows", with_an_append_under_way)
    train(
        char_data,
        rp.run_dir,
        "phase1",
        settings,
        max_steps=20,
        device="cpu",
        progress=False,
        mirror_dir=rp.mirror_dir,
    )
    rows = [(r["task"], r["step"]) for r in read_jsonl(rp.mirror_dir / EVAL_FILE)]
    assert raced and rows == [("hellaswag", 10), ("bpb", 5), ("hellaswag", 20)], rows


def test_evaluates_look_at_the_runs_drive_copy_does_not_hang_on_a_hung_mount(
    fake_colab, monkeypatch
):
    """Notebook 04's Evaluate of a run on the VM's disk looks for its Drive copy (colab.drive_copy) before scoring:
    after the timed look at MyDrive, the look at the run's folder on Drive had no limit, so a mount hung since then
    held Evaluate before it scored anything. It is under DRIVE_CHECK_S: hung, an OSError within the limit (Evaluate
    says the rows stay on the VM's disk)."""
    import threading
    import time
    from pathlib import Path

    rp = colab.run_paths("tiny", colab.setup())
    rp.run_dir.mkdir(parents=True)
    rp.mirror_dir.mkdir(parents=True)
    assert colab.drive_copy(rp.run_dir) == rp.mirror_dir
    is_dir, released = Path.is_dir, threading.Event()

    def hung(path):
        if path == rp.mirror_dir:
            released.wait(30)  # the hung mount: answers only long after
        return is_dir(path)

    monkeypatch.setattr(Path, "is_dir", hung)
    monkeypatch.setattr(colab, "DRIVE_CHECK_S", 0.2)
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError, match="made no progress"):
            colab.drive_copy(rp.run_dir)
        assert time.monotonic() - t0 < 5
    finally:
        released.set()


def test_evaluate_says_once_that_a_hung_drive_keeps_its_rows_on_the_vm(
    fake_colab, char_data, monkeypatch
):
    """Evaluate of a run on the VM's disk whose Drive copy could not be looked at (Drive hung, or dropped): no Drive
    copy, as for a run with none, and not a word: its rows stayed on the VM, lost with it, unsaid (a failed copy of
    them is said). It is said once, before scoring; the rows are scored and stand on the VM's disk."""
    import threading
    from pathlib import Path

    from gptlib.evaluation.evaluate import evaluate_run
    from gptlib.fsutil import read_jsonl
    from gptlib.layout import EVAL_FILE

    rp, _ = train_tiny_on_colab(char_data, TINY + ["eval_interval=5"])
    is_dir, released, said = Path.is_dir, threading.Event(), []

    def hung(path):
        if path == rp.mirror_dir:
            released.wait(20)  # the hung mount: answers only long after
        return is_dir(path)

    monkeypatch.setattr(Path, "is_dir", hung)
    monkeypatch.setattr(colab, "DRIVE_CHECK_S", 0.3)
    try:
        rows = evaluate_run(
            rp.run_dir, "bpb", "all", device="cpu", progress=False, limit=2, warn=said.append
        )
    finally:
        released.set()
    assert (
        [r["step"] for r in rows]
        == [5, 10]
        == [r["step"] for r in read_jsonl(rp.run_dir / EVAL_FILE)]
    )
    assert not (rp.mirror_dir / EVAL_FILE).exists()
    [line] = said
    assert line == (
        f"!! {rp.run_dir / EVAL_FILE} stays on this VM, lost with it: its Drive copy was not found "
        f"([Errno 110] Drive made no progress for 0.3 s (hung mount?))"
    ), line


def test_eval_rows_that_never_reached_drive_survive_a_resume_from_drive(
    fake_colab, tmp_path, char_data, monkeypatch
):
    """Evaluate on the training VM while Drive was failing: its rows stood on the VM's disk only. When that VM later
    resumed from a newer checkpoint on Drive (training went on on another VM), Drive's eval.jsonl replaced the VM's and
    those rows were lost. The VM's rows are kept, Drive's added, and the mirror takes them all to Drive."""
    from gptlib.evaluation.evaluate import evaluate_run
    from gptlib.fsutil import read_jsonl
    from gptlib.layout import EVAL_FILE

    settings = hellaswag_settings(tmp_path)
    rp, _ = train_tiny_on_colab(char_data, settings)
    kw = dict(device="cpu", progress=False, warn=lambda s: None, limit=4)

    def dropped(run_dir):  # Drive dropped while Evaluate ran on this VM
        raise OSError(107, "Transport endpoint is not connected")

    with monkeypatch.context() as m:
        m.setattr(colab, "drive_copy", dropped)
        evaluate_run(rp.run_dir, "bpb", "all", **kw)
    assert [r["task"] for r in read_jsonl(rp.mirror_dir / EVAL_FILE)] == ["hellaswag"]
    # training goes on on another VM from Drive's copy, then on this one (Drive's checkpoint the newer)
    kw = dict(device="cpu", progress=False, mirror_dir=rp.mirror_dir)
    train(char_data, tmp_path / "other_vm" / "tiny", "phase1", settings, max_steps=15, **kw)
    r = train(char_data, rp.run_dir, "phase1", settings, max_steps=20, **kw)
    assert r.resumed_from == 15
    want = {("hellaswag", 10), ("bpb", 5), ("bpb", 10), ("hellaswag", 15), ("hellaswag", 20)}
    for copy in (rp.run_dir, rp.mirror_dir):
        rows = [(x["task"], x["step"]) for x in read_jsonl(copy / EVAL_FILE)]
        assert sorted(rows) == sorted(want), copy
