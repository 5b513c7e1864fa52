"""Exact resume on CPU: a run killed at any moment, then resumed, matches an uninterrupted run.

"Matches" means the same per-step train/val losses and learning rates in metrics.jsonl and the
same final weights (torch.equal). The kills are real: `python -m gptlib train` runs in a
subprocess (through tests/faulty.py) and SIGKILLs itself at a named point, or gets SIGTERM.
dropout > 0 so the global torch RNG matters; the negative controls show that skipping the RNG or
sampler restore makes the comparison fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
import torch

from gptlib import batches as gdata
from gptlib.checkpoint import format as gformat
from gptlib.checkpoint.format import (
    list_checkpoints,
    load_checkpoint,
    load_model_weights,
    verify_checkpoint,
)
from gptlib.training import loop as gtrain
from gptlib.training import resume as gresume
from gptlib.training.logs import read_metrics
from gptlib.training.loop import train
from tests import faulty
from tests.conftest import REPO, TINY, newest_checkpoint, skip_without_muon

MAX_STEPS = 20
# Saves at 5, 10, 15, 20 (validation at 10, 20); dropout makes the torch RNG part of the state.
SETTINGS = TINY + ["dropout=0.1", "save_every_steps=5", "keep_last=2"]


@pytest.fixture(autouse=True)
def one_thread():
    """Same thread count in-process as in the subprocesses (OMP_NUM_THREADS=1): same float sums, and
    much faster on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run_inproc(data, run_dir, mirror_dir=None, log=None, **kw):
    return train(
        data,
        run_dir,
        "phase1",
        SETTINGS,
        max_steps=MAX_STEPS,
        device="cpu",
        progress=False,
        mirror_dir=mirror_dir,
        log=log or print,
        **kw,
    )


def run_cli(
    data, run_dir, fault: str | None = None, mirror_dir=None, timeout=120
) -> subprocess.CompletedProcess:
    cmd = faulty.train_cmd(fault, data, run_dir, MAX_STEPS, settings=SETTINGS)
    if mirror_dir is not None:
        cmd += ["--mirror-dir", str(mirror_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def curve(run_dir) -> dict[int, tuple]:
    """step -> (train loss, val loss, lr): what must continue unchanged across a resume."""
    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"duplicate steps in {run_dir}/metrics.jsonl: {steps}"
    return {r["step"]: (r["train_loss"], r.get("val_loss"), r["lr"]) for r in rows}


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    ck = newest_checkpoint(run_dir)
    assert ck is not None and ck.step == MAX_STEPS, f"{run_dir}: newest valid checkpoint is {ck}"
    return load_model_weights(ck.path)


def assert_same_run(ref_dir, run_dir) -> None:
    a, b = curve(ref_dir), curve(run_dir)
    assert sorted(b) == list(range(1, MAX_STEPS + 1)), f"steps logged: {sorted(b)}"
    diff = [s for s in a if a[s] != b.get(s)]
    assert not diff, (
        f"losses differ from the uninterrupted run at steps {diff}: {[(a[s], b.get(s)) for s in diff[:3]]}"
    )
    wa, wb = final_weights(ref_dir), final_weights(run_dir)
    assert wa.keys() == wb.keys()
    bad = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not bad, f"final weights differ: {bad}"


@pytest.fixture(scope="module")
def reference(char_data, tmp_path_factory):
    """The uninterrupted run."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("ref") / "run"
    r = run_inproc(char_data, d, log=lambda m: None)
    assert r.step == MAX_STEPS and r.resumed_from is None
    return d


def _resume_and_check(
    char_data, reference, run_dir, capsys, expect_step, mirror_dir=None, where="local disk"
):
    capsys.readouterr()
    r = run_inproc(char_data, run_dir, mirror_dir=mirror_dir)
    out = capsys.readouterr().out
    assert r.resumed_from == expect_step, out
    assert f"resumed from step {expect_step}" in out and where in out, out
    assert_same_run(reference, run_dir)


# (fault, the checkpoint steps the resumed run may start from). During a step the step-10 save may
# still be in flight in its background thread, and dies with the process: then step 5 is the newest.
KILLS = {
    "during a step": ("kill:mid_step@13", {5, 10}),
    "during a save (model.pt written, no manifest)": ("kill:save_mid@15", {10}),
    "between rename and rotation": ("kill:after_rename@15", {15}),
    "during rotation (deleting step 5 at the step-15 save)": ("kill:rotate_mid@5", {15}),
}


@pytest.mark.parametrize("when", list(KILLS))
def test_sigkill_then_resume_is_exact(char_data, reference, tmp_path, capsys, when):
    fault, allowed = KILLS[when]
    run_dir = tmp_path / "run"
    p = run_cli(char_data, run_dir, fault=fault)
    assert p.returncode == -signal.SIGKILL, f"rc={p.returncode}\n{p.stdout}\n{p.stderr}"
    newest = newest_checkpoint(run_dir)
    assert newest is not None and newest.step in allowed, (newest, allowed)
    expect = newest.step
    # The previous checkpoints are intact (full sha256 check), whatever the kill interrupted.
    for ck in list_checkpoints(run_dir):
        if ck.name == f"step_{expect:07d}" or int(ck.name[5:]) < expect:
            load_checkpoint(ck)
    _resume_and_check(char_data, reference, run_dir, capsys, expect)
    leftovers = [
        p.name
        for p in (run_dir / "checkpoints").iterdir()
        if not p.name.startswith("step_") or "." in p.name
    ]
    assert not leftovers, f"orphans not cleaned: {leftovers}"


def test_sigterm_saves_at_step_boundary_and_exits_cleanly(char_data, reference, tmp_path, capsys):
    run_dir = tmp_path / "run"
    p = run_cli(char_data, run_dir, fault="term:mid_step@13")
    assert p.returncode == 0, p.stderr
    assert "SIGTERM" in p.stderr and "stopped (sigterm) at step 13" in p.stdout, p.stdout + p.stderr
    assert verify_checkpoint(run_dir / "checkpoints" / "step_0000013").step == 13
    _resume_and_check(char_data, reference, run_dir, capsys, 13)


def test_vm_lost_resume_from_drive_mirror(char_data, reference, tmp_path, capsys):
    """Killed while copying to the mirror, then the local disk is gone (a new Colab VM): resume from
    the mirror's newest valid checkpoint, metrics history included, still exact."""
    run_dir, mirror = tmp_path / "local" / "run", tmp_path / "drive" / "run"
    p = run_cli(char_data, run_dir, fault="kill:mirror_mid@15", mirror_dir=mirror)
    assert p.returncode == -signal.SIGKILL, p.stderr
    shutil.rmtree(tmp_path / "local")
    ck = newest_checkpoint(mirror)
    assert ck is not None and ck.step in (5, 10), ck
    _resume_and_check(
        char_data, reference, run_dir, capsys, ck.step, mirror_dir=mirror, where="Drive mirror"
    )
    # The mirror caught up: the final checkpoint is there and verifies; no partial copies remain.
    assert verify_checkpoint(mirror / "checkpoints" / f"step_{MAX_STEPS:07d}").step == MAX_STEPS
    assert not [p for p in (mirror / "checkpoints").iterdir() if "." in p.name]


def interrupted_in_step_13(char_data, run_dir):
    """A run that a KeyboardInterrupt stops inside step 13, with no signal handlers to defer it."""
    undo = faulty.install("interrupt:mid_step@13")
    try:
        return run_inproc(char_data, run_dir, log=lambda m: None)
    finally:
        undo()


def test_keyboard_interrupt_mid_step_then_resume_is_exact(
    char_data, reference, tmp_path, monkeypatch, capsys
):
    """An interrupt inside a step (no signal handlers) saves nothing: the last checkpoint (10) stands."""
    run_dir = tmp_path / "run"
    r = interrupted_in_step_13(char_data, run_dir)
    assert r.stopped_by == "interrupt" and r.step == 12
    _resume_and_check(char_data, reference, run_dir, capsys, 10)


def test_a_run_on_shards_left_on_disk_is_the_run_in_ram(
    char_data, reference, tmp_path, monkeypatch, capsys
):
    """Data too large for RAM stays on disk (memory-mapped): its batches are the preloaded split's, so the run,
    interrupted mid-step and resumed, is the uninterrupted run in RAM, bit for bit."""
    monkeypatch.setattr(gdata, "available_ram", lambda: 1000)  # a machine nearly out of memory
    gathered, real_gather = [], gdata.MemmapSplit.gather_raw
    monkeypatch.setattr(
        gdata.MemmapSplit,
        "gather_raw",
        lambda self, *a: gathered.append(1) or real_gather(self, *a),
    )
    run_dir = tmp_path / "run"
    r = interrupted_in_step_13(char_data, run_dir)
    # every batch read from the shards
    assert r.stopped_by == "interrupt" and r.step == 12 and len(gathered) >= 12
    _resume_and_check(char_data, reference, run_dir, capsys, 10)


# --- negative controls: the comparison above does catch a resume that forgets state ----------------


@pytest.fixture(scope="module")
def interrupted(char_data, tmp_path_factory):
    d = tmp_path_factory.mktemp("interrupted") / "run"
    undo = faulty.install("interrupt:mid_step@13")
    try:
        torch.set_num_threads(1)
        r = run_inproc(char_data, d, log=lambda m: None)
    finally:
        undo()
    assert r.step == 12
    return d


def test_negative_control_without_rng_restore(
    char_data, reference, interrupted, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    shutil.copytree(interrupted, run_dir)
    monkeypatch.setattr(gformat.RNG, "load_state_dict", lambda self, state: None)
    run_inproc(char_data, run_dir, log=lambda m: None)
    with pytest.raises(AssertionError, match="losses differ"):
        assert_same_run(reference, run_dir)


def test_negative_control_without_sampler_restore(
    char_data, reference, interrupted, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    shutil.copytree(interrupted, run_dir)
    monkeypatch.setattr(gdata.BatchSampler, "load_state_dict", lambda self, state, ranks=None: None)
    run_inproc(char_data, run_dir, log=lambda m: None)
    with pytest.raises(AssertionError, match="losses differ"):
        assert_same_run(reference, run_dir)


def test_positive_control_same_copy_resumes_exactly(char_data, reference, interrupted, tmp_path):
    """The same copied interrupted run, resumed without tampering, matches (so the controls above
    fail because of the skipped restore, not because of the copy)."""
    run_dir = tmp_path / "run"
    shutil.copytree(interrupted, run_dir)
    run_inproc(char_data, run_dir, log=lambda m: None)
    assert_same_run(reference, run_dir)


# --- time-based saving and the time budget ------------------------------------------------------------


def test_time_based_saves_and_max_minutes(char_data, tmp_path, capsys, monkeypatch):
    """save_every_minutes saves between step-based saves; max_minutes stops with a checkpoint, and
    the same call resumes from it."""
    from gptlib.checkpoint.format import list_checkpoints

    # Every step lasts longer than save_every_minutes (6 ms): a tiny step on an idle CPU can be faster,
    # and then step 7 was not saved (flaky [6, 8]). "slow" sleeps 50 ms in every step.
    faulty.install("slow:mid_step", monkeypatch.setattr)
    run_dir = tmp_path / "run"
    settings = TINY + ["eval_interval=1000", "save_every_steps=1000", "save_every_minutes=0.0001"]
    r = train(
        char_data,
        run_dir,
        "phase1",
        settings,
        max_steps=8,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    steps = sorted(int(p.name[5:]) for p in list_checkpoints(run_dir))
    # the time-based save at 7 (keep_last=2), final at 8
    assert r.step == 8 and steps == [7, 8], steps

    run2 = tmp_path / "run2"
    r = train(
        char_data,
        run2,
        "phase1",
        TINY,
        max_steps=50,
        max_minutes=1e-6,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    assert r.stopped_by == "max_minutes" and r.step == 1
    assert verify_checkpoint(run2 / "checkpoints" / "step_0000001").step == 1
    capsys.readouterr()
    r = train(
        char_data,
        run2,
        "phase1",
        TINY,
        max_steps=50,
        max_minutes=1e-6,
        device="cpu",
        progress=False,
    )
    assert r.resumed_from == 1 and r.step == 2 and "resumed from step 1" in capsys.readouterr().out


# --- host memory ----------------------------------------------------------------------------------------------


def tensors(o):
    """Every tensor in nested dicts, lists and tuples."""
    if isinstance(o, torch.Tensor):
        yield o
    elif isinstance(o, dict):
        for v in o.values():
            yield from tensors(v)
    elif isinstance(o, (list, tuple)):
        for v in o:
            yield from tensors(v)


def test_the_loaded_checkpoint_is_freed_once_restored(char_data, tmp_path, monkeypatch):
    """Issue 26.3: a resumed run held the loaded checkpoint (a CPU copy of weights and optimizer state) for the whole
    run. At the first step of the resumed run, no tensor of it is alive but those the optimizer took as its own state
    (on CPU, load_state_dict adopts them instead of copying): the weights' copy is gone."""
    import gc
    import weakref

    run_dir = tmp_path / "run"
    train(
        char_data,
        run_dir,
        "phase1",
        SETTINGS,
        max_steps=10,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    loaded = {}  # part -> weak references to the loaded checkpoint's tensors
    real_load = gresume.load_checkpoint

    def load_checkpoint(path):
        ck = real_load(path)
        for part in ("model", "optimizer", "scaler", "sampler", "rng"):
            loaded[part] = [weakref.ref(t) for t in tensors(ck[part])]
        return ck

    alive = {}

    def train_step(model, optimizer, *a, **k):
        if not alive:  # the first step of the resumed run
            gc.collect()
            own = {id(v) for st in optimizer.state.values() for v in st.values()}
            alive.update(
                {
                    part: [t for r in refs if (t := r()) is not None and id(t) not in own]
                    for part, refs in loaded.items()
                }
            )
        return real_train_step(model, optimizer, *a, **k)

    real_train_step = gtrain.train_step
    monkeypatch.setattr(gresume, "load_checkpoint", load_checkpoint)
    monkeypatch.setattr(gtrain, "train_step", train_step)
    r = train(
        char_data,
        run_dir,
        "phase1",
        SETTINGS,
        max_steps=12,
        device="cpu",
        progress=False,
        log=lambda m: None,
    )
    assert r.resumed_from == 10 and len(loaded["model"]) > 5
    assert alive and not any(alive.values()), {part: len(ts) for part, ts in alive.items()}


@pytest.mark.parametrize("recipe", ["gpt2", "modern"])
def test_a_resume_trains_with_the_hyperparameters_it_says_changed(char_data, tmp_path, recipe):
    """--set weight_decay / beta2 / eps-free fields on a resume: the run logs "resume: X changed A -> B" and now
    trains with B. Was: torch's load_state_dict kept the checkpoint's groups, so it said 0.0 and went on with 0.1."""
    skip_without_muon(recipe)
    run = tmp_path / "run"
    before = TINY + ["weight_decay=0.1", "beta2=0.99", "muon_momentum=0.95"]
    train(
        char_data,
        run,
        "phase1",
        before,
        max_steps=10,
        device="cpu",
        progress=False,
        log=lambda m: None,
        recipe=recipe,
    )
    logs = []
    after = TINY + ["weight_decay=0.0", "beta2=0.9", "muon_momentum=0.8"]
    r = train(
        char_data, run, "phase1", after, max_steps=12, device="cpu", progress=False, log=logs.append
    )
    assert r.resumed_from == 10 and r.step == 12
    assert (
        "resume: weight_decay changed 0.1 -> 0.0" in logs
        and "resume: beta2 changed 0.99 -> 0.9" in logs
    ), logs
    opt = load_checkpoint(list_checkpoints(run)[0])["optimizer"]
    adamw = opt["adamw"]["param_groups"] if recipe == "modern" else opt["param_groups"]
    assert {g["weight_decay"] for g in adamw} <= {0.0} and {tuple(g["betas"]) for g in adamw} == {
        (0.9, 0.9)
    }
    if recipe == "modern":
        assert "resume: muon_momentum changed 0.95 -> 0.8" in logs, logs
        assert [(g["momentum"], g["weight_decay"]) for g in opt["muon"]["param_groups"]] == [
            (0.8, 0.0)
        ]


def test_a_resume_builds_the_model_once(char_data, tmp_path, monkeypatch):
    """Issue 43: a start builds one GPT. The saved optimizer state is checked against the checkpoint's own tensors
    (no second model on the meta device), and the auto micro-batch is measured on the run's own model (no probe
    model): here on a fake GPU's memory (tests/test_runtime.py's FakeGpuMemory), the probe's code running on the CPU."""
    from gptlib.model import GPT
    from gptlib.training import memory
    from tests.test_runtime import GIB, FakeGpuMemory

    overrides = [*TINY, "auto_batch=true", "grad_accum_steps=2"]
    train(char_data, tmp_path, "phase1", overrides, max_steps=4, progress=False, log=lambda s: None)
    built, init = [], GPT.__init__

    def counted(self, *args, **kwargs):
        built.append(args)
        init(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "__init__", counted)
    monkeypatch.setitem(
        memory.MEMORY_PROBES, "cpu", lambda d: FakeGpuMemory(100 * GIB, 15 * GIB, 10 * GIB)
    )
    logs = []
    result = train(
        char_data, tmp_path, "phase1", overrides, max_steps=6, progress=False, log=logs.append
    )
    assert result.resumed_from == 4 and result.step == 6, result
    assert any("auto micro-batch" in m for m in logs), logs
    assert len(built) == 1, f"a resume built {len(built)} models"


def test_a_resume_on_a_smaller_gpu_keeps_the_batches_and_the_validation(
    char_data, tmp_path, monkeypatch
):
    """Colab gives another GPU each session (an A100 on day 1, a T4 on day 2): auto_batch measures a smaller
    micro-batch and more accumulation. The same sequences make each step, and the validation measures the same
    sequences too, so the curve and the best checkpoint go on comparably (it took eval_batches micro-batches of the
    new size: a quarter of the sequences here, and the val loss jumped). Fake GPU memories (tests/test_runtime.py's
    FakeGpuMemory: 8 sequences fit the large one, 2 the small); a constant LR, so that the run may stop at step 10."""
    from gptlib.training import memory
    from tests.test_runtime import GIB, FakeGpuMemory

    over = TINY + [
        "auto_batch=true",
        "batch_size=4",
        "grad_accum_steps=2",
        "eval_interval=5",
        "eval_batches=4",
    ]
    over += [
        "learning_rate=1e-2",
        "warmup_steps=0",
        "min_lr_ratio=1.0",
        "save_every_steps=5",
        "sample_tokens=0",
    ]

    def day(run_dir, gib, steps):
        monkeypatch.setitem(
            memory.MEMORY_PROBES, "cpu", lambda d: FakeGpuMemory(gib * GIB, GIB, 10 * GIB)
        )
        train(
            char_data,
            run_dir,
            "phase1",
            over,
            max_steps=steps,
            device="cpu",
            progress=False,
            log=lambda m: None,
        )
        return {r["step"]: r for r in read_metrics(run_dir)}

    one_gpu = day(tmp_path / "a", 100, 20)
    day(tmp_path / "b", 100, 10)
    switched = day(tmp_path / "b", 30, 20)
    assert sorted(switched) == sorted(one_gpu)
    for s, row in one_gpu.items():  # the same math in another order: float rounding apart
        assert switched[s]["train_loss"] == pytest.approx(row["train_loss"], abs=1e-4), s
        assert switched[s].get("val_loss") == pytest.approx(row.get("val_loss"), abs=1e-4), s


def test_an_auto_batch_resume_says_no_change_it_did_not_make(char_data, tmp_path, monkeypatch):
    """Every session of notebook 03 (AUTO_BATCH on) asks for the preset's sizes, which the probe measures again: a
    resume said `resume: batch_size changed 8 -> 4`, `grad_accum_steps changed 1 -> 2` (and eval_batches) although
    nothing changed and the probe then took 8 again. A change of the tokens per step is still said."""
    from gptlib.training import memory
    from tests.test_runtime import GIB, FakeGpuMemory

    monkeypatch.setitem(
        memory.MEMORY_PROBES, "cpu", lambda d: FakeGpuMemory(100 * GIB, GIB, 10 * GIB)
    )
    over = TINY + ["auto_batch=true", "batch_size=4", "grad_accum_steps=2", "sample_tokens=0"]

    def day(steps, *more):
        logs = []
        train(
            char_data,
            tmp_path,
            "phase1",
            over + list(more),
            max_steps=steps,
            progress=False,
            log=logs.append,
        )
        return [m for m in logs if m.startswith("resume:") and " changed " in m]

    day(2)
    assert day(4) == []
    assert "resume: grad_accum_steps changed 1 -> 4" in day(6, "grad_accum_steps=4")


def test_config_json_of_a_session_on_another_gpu_that_never_saved_is_not_an_edit(
    char_data, tmp_path, monkeypatch
):
    """A session on a smaller GPU writes config.json with the sizes its probe measured, then Colab disconnects before
    its first checkpoint. The next session must not say that config.json has values "this run does not use" as if
    the learner had edited them: batch_size and grad_accum_steps were left out of that line, eval_batches (which the
    probe sets too) was not."""
    import json

    from gptlib.training import memory
    from tests.test_runtime import GIB, FakeGpuMemory

    over = TINY + ["auto_batch=true", "batch_size=4", "grad_accum_steps=2", "sample_tokens=0"]

    def day(gib, steps):
        monkeypatch.setitem(
            memory.MEMORY_PROBES, "cpu", lambda d: FakeGpuMemory(gib * GIB, GIB, 10 * GIB)
        )
        logs = []
        train(char_data, tmp_path, "phase1", over, max_steps=steps, progress=False, log=logs.append)
        return logs

    day(100, 2)
    config = json.loads((tmp_path / "config.json").read_text())
    # what the small GPU's session wrote before it was cut off: its probe's sizes
    config["train"].update(batch_size=2, grad_accum_steps=4, eval_batches=4)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert not [m for m in day(30, 4) if "does not use" in m]
    assert json.loads((tmp_path / "config.json").read_text())["train"]["eval_batches"] == 4


def test_a_fine_tune_resumed_on_other_data_in_a_notebook_names_notebook_05s_settings(
    char_data, small_text, tmp_path, monkeypatch
):
    """Notebook 05 (a fine-tune: init_from its base) resumed with DATASET_NAME set to another dataset: the refusal
    named 'DATASET_NAME or DATA_DIR', and notebook 05 has no DATA_DIR (notebook 03 has both)."""
    from gptlib.data.prepare import prepare_text
    from gptlib.errors import GptlibError
    from gptlib.training.resume import StartOptions

    other = tmp_path / "other.txt"  # the same characters (the same tokenizer), other tokens
    other.write_text("\n".join(reversed(small_text.read_text().splitlines())))
    prepare_text([other], tmp_path / "other", tokenizer="char", verbose=False)
    kw = dict(device="cpu", progress=False, log=lambda m: None)
    train(char_data, tmp_path / "base", "phase1", TINY, max_steps=2, **kw)
    options = StartOptions(init_from=str(tmp_path / "base"))
    train(char_data, tmp_path / "ft", "phase1", TINY, max_steps=2, options=options, **kw)
    monkeypatch.setattr(gresume, "in_notebook", lambda: True)
    with pytest.raises(GptlibError) as e:
        train(
            tmp_path / "other", tmp_path / "ft", "phase1", TINY, max_steps=4, options=options, **kw
        )
    assert "set DATASET_NAME back to its data, or choose a new RUN_NAME" in str(e.value), e.value
    # notebook 03's run (no base) names both
    train(char_data, tmp_path / "run", "phase1", TINY, max_steps=2, **kw)
    with pytest.raises(GptlibError) as e:
        train(tmp_path / "other", tmp_path / "run", "phase1", TINY, max_steps=4, **kw)
    assert "set DATASET_NAME or DATA_DIR back to its data, or choose" in str(e.value), e.value
