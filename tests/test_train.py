import json
import re
import shutil
import signal
import time

import pytest
import torch

from gptlib.checkpoint.format import list_checkpoints, load_model_weights
from gptlib.config import ConfigError, TrainConfig
from gptlib.training.logs import read_metrics
from gptlib.training.loop import train
from gptlib.training.resume import StartOptions
from gptlib.training.step import lr_at
from tests.conftest import TINY, skip_without_muon


def quiet(_msg):
    pass


def test_short_run_lowers_the_loss_and_writes_the_run_dir(tmp_path, char_data):
    r = train(
        char_data,
        tmp_path / "run",
        "phase1",
        TINY + ["learning_rate=3e-3"],
        max_steps=30,
        progress=False,
        log=quiet,
    )
    rows = read_metrics(tmp_path / "run")
    assert r.step == 30 and [row["step"] for row in rows] == list(range(1, 31))
    first, last = rows[0]["train_loss"], rows[-1]["train_loss"]
    assert last < first - 0.5, (first, last)
    assert r.val_loss is not None and r.val_loss < first
    for key in ("step", "train_loss", "lr", "tokens_seen"):
        assert key in rows[-1]
    assert "val_loss" in rows[-1] and "tokens_per_s" in rows[-1] and "elapsed_s" in rows[-1]
    run = tmp_path / "run"
    assert (run / "loss.png").stat().st_size > 1000
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {10, 20, 30} and all(
        s["text"].startswith(s["prompt"]) for s in samples
    )
    assert "| step |" in (run / "samples.md").read_text()
    assert (run / "tokenizer.json").is_file() and (run / "config.json").is_file()
    # weights are saved from the original module: no torch.compile / DDP prefixes
    sd = torch.load(list_checkpoints(run)[0] / "model.pt", weights_only=True)
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in sd)


def test_rerunning_a_finished_run_is_a_noop(tmp_path, char_data):
    train(char_data, tmp_path / "run", "phase1", TINY, max_steps=10, progress=False, log=quiet)
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    shown = []  # what a notebook shows: train()'s lines, then print(result.summary())
    r = train(
        char_data, tmp_path / "run", "phase1", TINY, max_steps=10, progress=True, log=shown.append
    )
    assert r.resumed_from == 10 and r.step == 10
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    shown.append(r.summary())
    # only that it is finished: no data, RAM, "resumed from" or model lines
    assert len(shown) == 1, shown
    assert re.fullmatch(
        r"already finished at step 10 \(val \d\.\d{4}\); nothing to do \(raise max_steps to train "
        r"further\) -> .*run",
        shown[-1],
    ), shown


def test_a_run_finished_before_a_disconnect_shows_its_curve_on_a_fresh_vm(tmp_path, char_data):
    """Notebook 02 run again on a new VM after the run had finished: train() says it is finished, and the next cell
    shows loss.png from the run dir. It was on Drive only (FileNotFoundError: Run all stopped there)."""
    args = dict(
        preset="phase1", overrides=TINY, progress=False, log=quiet, mirror_dir=tmp_path / "drive"
    )
    train(char_data, tmp_path / "vm1", max_steps=10, **args)
    r = train(char_data, tmp_path / "vm2", max_steps=10, **args)
    assert r.stopped_by == "finished" and (tmp_path / "vm2" / "loss.png").stat().st_size > 1000
    assert len(read_metrics(tmp_path / "vm2")) == 10


def test_the_eta_counts_the_steps_left_at_this_sessions_batch(tmp_path, char_data, monkeypatch):
    """A resume with a larger batch (allowed, and said): the ETA and Colab units counted the tokens left as
    max_steps at the new batch minus the tokens seen at both, 4x too many in the report's case."""
    from gptlib.training import throughput

    args = dict(preset="phase1", progress=False, log=quiet)
    train(char_data, tmp_path / "run", overrides=TINY, max_steps=10, **args)
    left, perf_fields = [], throughput.perf_fields

    def spy(split, fpt, tps, peak, n, tokens_seen, tokens_target, rate=None):
        left.append(tokens_target - tokens_seen)
        return perf_fields(split, fpt, tps, peak, n, tokens_seen, tokens_target, rate)

    monkeypatch.setattr(throughput, "perf_fields", spy)
    # 16 windows of 32 tokens a step, from 8
    r = train(char_data, tmp_path / "run", overrides=TINY + ["batch_size=16"], max_steps=20, **args)
    assert r.step == 20 and left and left[-1] == 0 and all(n % (16 * 32) == 0 for n in left), left


def test_a_run_shorter_than_its_warmup_says_so(tmp_path, char_data):
    """Notebook 03's token budget of 100M gave gpt2-small 191 steps against its 700 of warmup: the learning rate
    never reached its peak nor decayed, and nothing said so. Allowed (a smoke test), said in one line."""
    said = []
    train(char_data, tmp_path / "a", "phase1", TINY, max_steps=2, progress=False, log=said.append)
    warned = [
        m
        for m in said
        if m.startswith("warmup_steps=2 is not below max_steps=2: the learning rate")
    ]
    assert len(warned) == 1 and "(--set warmup_steps=N)" in warned[0], said
    said.clear()
    train(char_data, tmp_path / "b", "phase1", TINY, max_steps=3, progress=False, log=said.append)
    assert not [m for m in said if m.startswith("warmup_steps")], said


def test_init_from_the_runs_own_directory_is_said_or_refused(tmp_path, char_data):
    """--init-from naming the run itself: resuming it, said in one line; with no checkpoint yet, refused in one line
    before anything is created (its Drive mirror's path counts as the run too)."""
    run, mirror = tmp_path / "run", tmp_path / "drive" / "run"
    with pytest.raises(
        ConfigError,
        match=r"^--init-from .*run is this run's own directory, which has no checkpoint "
        r"yet: --init-from starts a new run from another run's weights; drop it to "
        r"train this one from scratch$",
    ):
        train(
            char_data,
            run,
            "phase1",
            TINY,
            max_steps=10,
            progress=False,
            log=quiet,
            options=StartOptions(init_from=str(run)),
        )
    assert not run.exists()
    train(
        char_data, run, "phase1", TINY, max_steps=10, progress=False, log=quiet, mirror_dir=mirror
    )
    for steps, spec in ((12, f"{run}/"), (14, f"{mirror}:best")):
        logs = []
        r = train(
            char_data,
            run,
            "phase1",
            TINY,
            max_steps=steps,
            progress=False,
            log=logs.append,
            options=StartOptions(init_from=spec),
            mirror_dir=mirror,
        )
        assert r.resumed_from >= 10, logs
        assert (
            f"init-from: {spec} is this run's own directory: resuming it (--init-from only starts a new run, "
            f"from another run's weights)" in logs
        ), logs
        # not also the other run's note
        assert not any("only starts a new run)" in m for m in logs), logs


def test_a_fine_tune_resumed_from_drive_on_a_fresh_vm_names_drives_copy(tmp_path, char_data):
    """Notebook 05 on a fresh VM: the fine-tune resumes from its Drive mirror, but the line said 'init-from: <the
    VM's run dir> already has checkpoints', a folder that is empty there. It names the copy it resumes from."""
    import shutil

    base, run, mirror = tmp_path / "base", tmp_path / "run", tmp_path / "drive" / "run"
    train(char_data, base, "phase1", TINY, max_steps=10, progress=False, log=quiet)
    opts = StartOptions(init_from=str(base))
    kw = dict(progress=False, options=opts, mirror_dir=mirror)
    train(char_data, run, "phase1", TINY, max_steps=10, log=quiet, **kw)
    shutil.rmtree(run)  # a new VM: only Drive's copy
    logs = []
    assert (
        train(char_data, run, "phase1", TINY, max_steps=12, log=logs.append, **kw).resumed_from
        == 10
    )
    said = (
        f"init-from: {mirror} already has checkpoints; resuming it ({base} only starts a new run)"
    )
    assert said in logs, "\n".join(logs)


def test_a_new_seed_or_learning_rate_on_resume_is_said_with_what_it_does(tmp_path, char_data):
    """The batches go on from the checkpoint, so a resumed run keeps its seed (validation's batches with it: the
    val loss stays comparable), saying so; a new learning rate is said with the LR it gives at the resumed step."""
    settings = TINY + ["eval_interval=5"]
    for run in ("same", "seeded"):
        train(
            char_data, tmp_path / run, "phase1", settings, max_steps=10, progress=False, log=quiet
        )
    train(char_data, tmp_path / "same", "phase1", settings, max_steps=20, progress=False, log=quiet)
    logs = []
    train(
        char_data,
        tmp_path / "seeded",
        "phase1",
        settings,
        max_steps=20,
        seed=5,
        progress=False,
        log=logs.append,
    )
    assert (
        "resume: seed stays 1337 (the run's own, not 5): a resumed run draws its batches on from the checkpoint, "
        "so a seed changes nothing after a resume; a new seed needs a new run" in logs
    ), logs
    assert not any("seed changed" in m for m in logs), logs
    curve = {
        run: [(r["step"], r["train_loss"], r.get("val_loss")) for r in read_metrics(tmp_path / run)]
        for run in ("same", "seeded")
    }
    # val at 5..20
    assert curve["seeded"] == curve["same"] and sum(v is not None for *_, v in curve["same"]) == 4
    assert json.loads((tmp_path / "seeded" / "config.json").read_text())["train"]["seed"] == 1337
    logs = []
    # finished: a changed setting changes nothing, said nothing
    train(
        char_data,
        tmp_path / "same",
        "phase1",
        settings + ["learning_rate=0.005"],
        max_steps=20,
        progress=False,
        log=logs.append,
    )
    assert logs == [], logs
    train(
        char_data,
        tmp_path / "same",
        "phase1",
        settings + ["learning_rate=0.005"],
        max_steps=30,
        progress=False,
        log=logs.append,
    )
    assert any(
        re.fullmatch(
            r"resume: learning_rate 0\.01 -> 0\.005, max_steps 20 -> 30: the LR at step 20 goes "
            r"[\d.e-]+ -> [\d.e-]+",
            m,
        )
        for m in logs
    ), logs


def test_tokens_per_s_of_a_resumed_call_counts_its_own_tokens(tmp_path, char_data):
    """Resuming with another batch size: tokens/s covers the tokens this call trained on, at the new size."""
    first = train(
        char_data, tmp_path / "run", "phase1", TINY, max_steps=10, progress=False, log=quiet
    )
    r = train(
        char_data,
        tmp_path / "run",
        "phase1",
        TINY + ["batch_size=4"],
        max_steps=14,
        progress=False,
        log=quiet,
    )
    assert r.resumed_from == 10 and r.tokens_seen == first.tokens_seen + 4 * 4 * 32
    assert r.tokens_per_s * r.elapsed_s == pytest.approx(4 * 4 * 32)


def test_validation_time_is_left_out_of_the_bars_tokens_per_s_but_not_the_eta(
    tmp_path, char_data, monkeypatch
):
    """A slow validation (2 s, far longer than a tiny step): the steady tokens/s and each row's tokens/s leave it
    out, the call's overall tokens/s and the ETA count it, and the closing line gives both rates. (0.5 s was not
    enough on a loaded 2-core machine, where 20 tiny steps can take as long as four such validations.)"""
    import gptlib.training.loop as T

    real = T.validation_loss

    def slow_validation(*a, **k):
        time.sleep(2.0)
        return real(*a, **k)

    monkeypatch.setattr(T, "validation_loss", slow_validation)
    # one save, at the end: a background save right after each validation would slow the next steps on 2 cores
    from gptlib.checkpoint.writer import CheckpointWriter

    real_save = CheckpointWriter.save
    monkeypatch.setattr(
        CheckpointWriter,
        "save",
        lambda self, ck: ck["progress"]["step"] == 20 and real_save(self, ck),
    )
    r = train(
        char_data,
        tmp_path / "run",
        "phase1",
        TINY + ["eval_interval=5"],
        max_steps=20,
        progress=False,
        log=quiet,
    )
    assert r.steady_tokens_per_s > 2 * r.tokens_per_s  # 4 validations: >= 8 s of the wall time
    rows = [row for row in r.history if "tokens_per_s" in row]
    # each the first interval after a validation
    after_val = [row for row in rows if row["step"] in (6, 11, 16)]
    # was ~1/4 of it
    assert after_val and all(row["tokens_per_s"] > r.tokens_per_s for row in after_val)
    last = rows[-2]  # the last row before the final validation
    tokens_left = 20 * 8 * 32 - last["tokens_seen"]
    # the ETA pays for the validations to come: 3 x 2 s (a step is ~15-100 ms here)
    assert last["eta_s"] > 1.5 * tokens_left / r.steady_tokens_per_s
    assert f"{r.steady_tokens_per_s:,.0f} tokens/s while stepping" in r.summary()


def test_a_failing_close_of_the_log_still_restores_the_signal_handlers_and_the_lease(
    tmp_path, char_data, monkeypatch
):
    """The bar and metrics.jsonl closed at the end of a run may raise (a full disk): the stop-button handlers are
    still put back (else Ctrl-C in the notebook would do nothing), the last save waited for, the lease released."""
    from gptlib.layout import LEASE_FILE
    from gptlib.training.logs import MetricsLog

    def full_disk(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(MetricsLog, "close", full_disk)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    run = tmp_path / "run"
    with pytest.raises(OSError, match="No space left"):
        train(char_data, run, "phase1", TINY, max_steps=3, progress=False, log=quiet)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    assert json.loads((run / LEASE_FILE).read_text())[
        "released"
    ]  # marked released, kept (issue 44)
    assert [p.name for p in list_checkpoints(run)] == ["step_0000003"]


class StopAt(Exception):
    pass


def test_stopped_and_resumed_equals_uninterrupted(tmp_path, char_data):
    """The Colab stop button (KeyboardInterrupt) at step 10, then the same call again."""
    args = dict(
        preset="phase1", overrides=TINY + ["dropout=0.1"], max_steps=20, progress=False, log=quiet
    )
    full = train(char_data, tmp_path / "full", **args)

    def interrupt(row):
        if row["step"] == 10:
            raise KeyboardInterrupt

    first = train(char_data, tmp_path / "resumed", on_log=interrupt, **args)
    assert first.stopped_by == "interrupt" and first.step == 10
    second = train(char_data, tmp_path / "resumed", **args)
    assert second.resumed_from == 10 and second.step == 20

    a = [(r["step"], r["train_loss"]) for r in read_metrics(tmp_path / "full")]
    b = [(r["step"], r["train_loss"]) for r in read_metrics(tmp_path / "resumed")]
    assert a == b  # same per-step losses, and no duplicated rows around the resume point
    wa = load_model_weights(list_checkpoints(tmp_path / "full")[0])
    wb = load_model_weights(list_checkpoints(tmp_path / "resumed")[0])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert full.val_loss == second.val_loss


def test_resume_with_a_different_model_is_refused_and_leaves_the_run_intact(tmp_path, char_data):
    run = tmp_path / "run"
    train(char_data, run, "phase1", TINY, max_steps=10, progress=False, log=quiet)
    # but for its lease: taken by the refused call, then marked released (never deleted: issue 44)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "lease.json"}
    with pytest.raises(
        ConfigError, match="holds a run with n_layer=2 but this call asks for n_layer=3"
    ):
        train(
            char_data, run, "phase1", TINY + ["n_layer=3"], max_steps=10, progress=False, log=quiet
        )
    assert {
        p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "lease.json"
    } == before
    # another preset (its vocab_multiple differs): named, as the setting the user changed
    with pytest.raises(
        ConfigError, match="was made with preset phase1, this call asks for phase2: --preset phase1"
    ):
        train(char_data, run, "phase2", TINY, max_steps=10, progress=False, log=quiet)


def test_text_shorter_than_one_block_is_a_clear_error(tmp_path):
    from gptlib.data.prepare import prepare_text
    from gptlib.data.shards import DataFormatError

    f = tmp_path / "short.txt"
    f.write_text("To be, or not to be: that is the question.\n" * 3)
    prepare_text([f], tmp_path / "d", verbose=False)
    with pytest.raises(DataFormatError, match="val split has .* tokens, fewer than one block"):
        train(
            tmp_path / "d", tmp_path / "run", "phase1", TINY, max_steps=5, progress=False, log=quiet
        )
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_text_shorter_than_one_block_in_a_notebook_names_overrides(tmp_path, monkeypatch):
    """Notebook 02 on a short TEXT_PATH (or 03 on a small dataset of notebook 01): the refusal said 'a smaller
    block_size (--set block_size=N), or a larger val_fraction', a flag and a name no notebook has. In a notebook it
    names OVERRIDES, and VAL_FRACTION where it is (notebook 01); following it, the run trains."""
    import sys
    from types import SimpleNamespace

    from gptlib.data.prepare import prepare_text
    from gptlib.data.shards import DataFormatError

    f = tmp_path / "short.txt"
    f.write_text("To be, or not to be: that is the question.\n" * 3)
    prepare_text([f], tmp_path / "d", verbose=False)
    kernel = SimpleNamespace(get_ipython=lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    args = dict(max_steps=2, progress=False, log=quiet)
    with pytest.raises(DataFormatError) as err:
        train(tmp_path / "d", tmp_path / "run", "phase1", TINY, **args)
    msg = str(err.value)
    assert 'a smaller block_size (OVERRIDES = ["block_size=N"])' in msg and "--" not in msg, msg
    # notebook 02 tokenizes its TEXT_PATH itself, with no VAL_FRACTION: the advice says whose setting it is
    assert (
        "val_fraction" not in msg and "a larger VAL_FRACTION (a dataset of notebook 01)" in msg
    ), msg
    monkeypatch.delitem(
        sys.modules, "IPython"
    )  # the fake has none of what a real run's display asks
    assert (
        train(tmp_path / "d", tmp_path / "run", "phase1", TINY + ["block_size=8"], **args).step == 2
    )


def test_no_earlier_micro_batchs_logits_are_alive_at_a_forward():
    """A step's micro-batches, and validation's batches, each drop their logits (B x T x vocab: 1 GiB in bf16 for
    gpt2-small at micro-batch 16) before the next forward. Was `_, loss = model(x, y)`: the logits lived on through
    the backward and the next forward, which the auto micro-batch probe (that frees them) did not count."""
    import weakref

    from gptlib.config import ModelConfig
    from gptlib.model import GPT
    from gptlib.training.step import train_step, validation_loss

    class Watched(GPT):
        def forward(self, idx, targets=None, cache=None):
            alive = [i for i, ref in enumerate(self.logits) if ref() is not None]
            assert not alive, (
                f"the logits of forward(s) {alive} are still alive at forward {len(self.logits)}"
            )
            out = super().forward(idx, targets, cache)
            self.logits.append(weakref.ref(out[0]))
            return out

    class Batches:
        def next_batch(self):
            x = torch.randint(0, 64, (2, 16))
            return x, x

    class Timer:
        def start(self):
            pass

        def mark(self, what):
            pass

    torch.manual_seed(0)
    model = Watched(ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    model.logits = []
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train_step(
        model,
        opt,
        scaler,
        Batches(),
        accum=3,
        grad_clip=1.0,
        autocast=torch.autocast("cpu", enabled=False),
        timer=Timer(),
    )
    validation_loss(model, Batches(), 3, torch.autocast("cpu", enabled=False))
    assert len(model.logits) == 6


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(learning_rate=1e-3, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(0.55e-3)
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_config_json_is_the_config_the_checkpoints_record(tmp_path, char_data, monkeypatch):
    """auto_batch changes batch_size and grad_accum_steps: config.json says so, as the checkpoints do."""
    from gptlib.training import memory
    from tests.test_runtime import GIB, FakeGpuMemory

    # 8 sequences need 0.95 of this fake GPU, 4: 0.55 -> the probe (the real one, on the CPU) takes 4
    monkeypatch.setitem(
        memory.MEMORY_PROBES, "cpu", lambda device: FakeGpuMemory(100 * GIB, 15 * GIB, 10 * GIB)
    )
    run = tmp_path / "run"
    train(
        char_data,
        run,
        "phase1",
        TINY + ["auto_batch=true", "batch_size=8", "grad_accum_steps=2"],
        max_steps=2,
        progress=False,
        log=quiet,
    )
    written = json.loads((run / "config.json").read_text())
    saved = json.loads((list_checkpoints(run)[0] / "state.json").read_text())["config"]
    assert (
        written == saved
        and written["train"]["batch_size"] == 4
        and written["train"]["grad_accum_steps"] == 4
    )


def test_hellaswag_during_training(tmp_path, char_data):
    """hellaswag_every: a fixed subset at the validations that cross a multiple, all items at the end (also
    in eval.jsonl), drawn beside the loss; without the file, training goes on and says why."""
    from gptlib.fsutil import read_jsonl
    from gptlib.layout import EVAL_FILE

    items = [
        {"ctx": "ROMEO:", "endings": [" what", " is", " this", " night"], "label": i % 4}
        for i in range(12)
    ]
    hs_file = tmp_path / "hs.jsonl"
    hs_file.write_text("".join(json.dumps(it) + "\n" for it in items))
    run = tmp_path / "run"
    settings = TINY + [
        "eval_interval=5",
        "hellaswag_every=10",
        "hellaswag_items=4",
        f"hellaswag_file={hs_file}",
    ]
    logs = []
    train(char_data, run, "phase1", settings, max_steps=25, progress=False, log=logs.append)
    rows = {r["step"]: r for r in read_metrics(run) if "val_loss" in r}
    assert [s for s in sorted(rows) if "hellaswag_acc_norm" in rows[s]] == [10, 20, 25]
    # the subset, then all items
    assert rows[10]["hellaswag_n"] == 4 and rows[25]["hellaswag_n"] == 12
    assert 0.0 <= rows[25]["hellaswag_acc_norm"] <= 1.0
    assert any("HellaSwag acc_norm" in m for m in logs)
    ev = [r for r in read_jsonl(run / EVAL_FILE) if r["task"] == "hellaswag"]
    assert (
        len(ev) == 1 and ev[0]["step"] == 25 and ev[0]["source"] == "training" and ev[0]["n"] == 12
    )
    logs = []
    missing = settings[:-1] + [f"hellaswag_file={tmp_path / 'nope.jsonl'}"]
    r = train(
        char_data,
        tmp_path / "run2",
        "phase1",
        missing,
        max_steps=5,
        progress=False,
        log=logs.append,
    )
    assert r.step == 5 and any(m.startswith("hellaswag: off for this run") for m in logs), logs


# --- what the progress output looks like (issue 18) ------------------------------------------------


class FakeTerminal:
    """A stream that says it is a terminal and keeps what tqdm draws."""

    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return True


@pytest.mark.parametrize("ncols", [100, 120])
def test_the_bar_keeps_most_of_a_100_column_line(tmp_path, char_data, monkeypatch, ncols):
    """The postfix once took the whole width (loss, lr, tok_s, mfu, eta and the time split): at 100-120 columns the
    bar shrank to one character and the line was cut. Now the bar gets a fair share and nothing is cut."""
    import sys

    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    import tqdm.std

    # the window's width
    monkeypatch.setattr(tqdm.std, "_screen_shape_wrapper", lambda: lambda fp: (ncols, 40))
    train(char_data, tmp_path / "run", "phase1", TINY, max_steps=12, log=quiet)
    frames = [f for f in term.text.replace("\n", "\r").split("\r") if "|" in f and "loss" in f]
    assert frames, term.text
    # the last one drawn while training; the bar left when training ended keeps no ETA
    frame = next(f for f in reversed(frames) if "ETA" in f)
    assert "ETA" not in frames[-1] and frames[-1].startswith("train: 100%|"), frames[-1]
    bar = frame.split("|")[1]
    assert len(frame) <= ncols and frame.endswith("]"), frame  # not cut
    assert len(bar) >= ncols // 3, frame  # the bar itself stays readable


def test_the_bar_is_readable_with_a_gpu_runs_longest_fields():
    """The longest postfix a GPU run shows (MFU known, millions of tokens/s, hours left, 5-digit steps)."""
    from tqdm import tqdm

    from gptlib.training.throughput import BAR_FORMAT, speed_text

    row = {
        "tokens_per_s": 1_234_567.0,
        "mfu": 0.4567,
        "eta_s": 45_296.0,
        "time_split": {"data": 0.03, "fwd_bwd": 0.9, "optim": 0.07},
    }
    postfix = "loss 3.2104, " + speed_text(row)
    # details: the periodic line, metrics.jsonl
    assert postfix == "loss 3.2104, 1.23M tok/s, MFU 45.7%, ETA 12h34m"
    assert speed_text(row, split=True).endswith("ETA 12h34m, time data 3% fwd_bwd 90% optim 7%")
    for ncols in (100, 120):
        line = tqdm.format_meter(
            12_345,
            19_073,
            11_565.0,
            ncols=ncols,
            prefix="train",
            bar_format=BAR_FORMAT,
            postfix=postfix,
        )
        assert line.endswith("ETA 12h34m]") and len(line) <= ncols, line
        # 12 columns of bar at 100, 32 at 120 (was 1, and cut)
        assert len(line.split("|")[1]) >= ncols - 88, line


def test_training_into_a_file_or_a_pipe_prints_plain_lines(
    tmp_path, char_data, monkeypatch, capsys
):
    """`train ... > log.txt 2>&1`: no carriage-return redraws (one endless line in the file), a progress line every
    RunProgress.TEXT_EVERY_S instead (0 here: one per log step)."""
    from gptlib.training.throughput import RunProgress, plain_progress

    assert plain_progress(__import__("io").StringIO()) and not plain_progress(FakeTerminal())
    monkeypatch.setattr(RunProgress, "TEXT_EVERY_S", 0.0)
    # progress on, as the CLI has it
    train(char_data, tmp_path / "run", "phase1", TINY, max_steps=12, log=print)
    out = capsys.readouterr()
    assert "\r" not in out.out + out.err
    lines = [ln for ln in out.out.splitlines() if ln.startswith("step ") and "/12: loss " in ln]
    assert [ln.split("/")[0] for ln in lines] == [f"step {s}" for s in range(1, 13)], out.out
    assert "lr " in lines[-1] and "tok/s" in lines[-1]


def test_the_samples_table_is_left_aligned(tmp_path):
    """samples.md: the classic notebook right-aligns a column without an explicit alignment; text reads left."""
    from gptlib.training.logs import write_samples_table

    rows = [
        {"step": s, "prompt": p, "text": p + " and more"}
        for s in (10, 20)
        for p in ("ROMEO:", "JULIET:")
    ]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_samples_table(tmp_path)
    lines = (tmp_path / "samples.md").read_text().splitlines()
    assert lines[1] == "|:---|:---|:---|" and lines[2].startswith("| 10 | ROMEO: and more |")


def test_the_samples_table_in_a_notebook_aligns_each_cell_top_left(tmp_path):
    """Notebook 02 shows the samples as HTML: a notebook's table style centres a cell vertically (two samples of one
    row, a short and a long one, started at different heights) and right-aligns it; each cell says top-left itself."""
    import xml.etree.ElementTree as ET

    from gptlib import samples_html

    assert "no samples yet" in samples_html(tmp_path)
    texts = {
        ("ROMEO:", 10): "ROMEO: a\nb\nc\nd",
        ("JULIET:", 10): "JULIET: <e> & f",
        ("ROMEO:", 20): "ROMEO: g",
    }
    rows = [{"step": s, "prompt": p, "text": t} for (p, s), t in texts.items()]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = ET.fromstring(samples_html(tmp_path))  # well-formed, the texts escaped
    cells = [c for tr in table.iter("tr") for c in tr]
    # a header row, one row per step; a step without a prompt's sample: an empty cell
    assert len(cells) == 3 * 3
    assert all(
        "vertical-align:top" in c.get("style") and "text-align:left" in c.get("style")
        for c in cells
    )
    grid = [["".join(c.itertext()) for c in tr] for tr in table.iter("tr")]
    assert grid == [
        ["step", "'ROMEO:'", "'JULIET:'"],
        ["10", texts["ROMEO:", 10], texts["JULIET:", 10]],
        ["20", texts["ROMEO:", 20], ""],
    ]


def test_one_tokens_per_s_figure_in_the_bar_the_plot_and_the_closing_line(
    tmp_path, char_data, monkeypatch
):
    """Notebook 03 showed figures that disagreed: the closing line's rates, and the last log interval's in
    the bar and the plot's title. Every live figure is now the session's tokens/s while stepping,
    the closing line's first, and each text says what it counts."""
    from gptlib.training.logs import LivePlot
    from gptlib.training.throughput import RunProgress, fmt_tokens

    # a progress line (the bar's details) at every log step
    monkeypatch.setattr(RunProgress, "TEXT_EVERY_S", 0.0)
    shown = []
    r = train(
        char_data,
        tmp_path / "run",
        "phase1",
        TINY + ["log_interval=4"],
        max_steps=24,
        progress=True,
        log=shown.append,
    )
    rows = [row for row in r.history if "tokens_per_s" in row]
    # several intervals: their rates differ, their average is one
    assert len(rows) >= 4 and rows[-1]["step"] == 24
    assert rows[-1]["tokens_per_s"] == round(r.steady_tokens_per_s, 1)
    fig = f"{r.steady_tokens_per_s:,.0f}"
    speed = f"{fmt_tokens(r.steady_tokens_per_s)} tok/s"
    assert [ln for ln in shown if ln.startswith("step 24/24:")][-1].count(
        f", {speed},"
    ) == 1  # the bar's details
    title = LivePlot(tmp_path / "run").figure().axes[0].get_title()
    assert f"{fmt_tokens(rows[-1]['tokens_per_s'])} tok/s" in title
    # notebook 03's one view of the split
    assert re.search(r"time data \d+% fwd_bwd \d+% optim \d+%", title), title
    assert re.search(
        rf"val loss \d\.\d{{4}}, {fig} tokens/s while stepping; [\d.]+ s this session, its "
        r"first step, validations and saves included \(max_steps\)",
        r.summary(),
    ), r.summary()


def test_the_live_plots_title_fits_the_figure_and_drops_the_eta_once_training_stopped(tmp_path):
    """Notebook 03's title ran off both edges of the figure ("...fwd_bwd 97% optim 3%" cut off) and kept its ETA
    after an interrupt. The speed goes on a line of its own, everything inside the figure; the title names the last
    validation, also when the last row (an interrupt's save) has none; without a row (train() returned) no ETA."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from gptlib.training.logs import LivePlot

    speed = {
        "tokens_per_s": 1234567.0,
        "mfu": 0.4567,
        "eta_s": 45240.0,
        "time_split": {"data": 0.001, "fwd_bwd": 0.97, "optim": 0.03},
    }
    rows = [
        {"step": s, "train_loss": 3 - s / 1e4, "tokens_seen": s * 524288}
        for s in range(1, 12001, 100)
    ]
    rows[-2].update(val_loss=2.25, **speed)  # the last validation, at step 11,801
    rows[-1].update(speed)  # the interrupt's row: no val loss
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot = LivePlot(
        tmp_path,
        title="gpt2-small · my-second-run-with-the-modern-recipe-on-fineweb-edu-10B-and-muon",
    )

    def drawn_title(fig):
        FigureCanvasAgg(fig).draw()
        title = fig.axes[0].title
        box, page = title.get_window_extent(), fig.bbox
        assert (
            page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
        ), (box, page)
        return title.get_text()

    running = drawn_title(plot.figure(rows[-2]))  # train()'s on_log, at the validation
    assert "step 11,801: val 2.2500" in running and "ETA 12h34m" in running, running
    assert "time data 0% fwd_bwd 97% optim 3%" in running.splitlines()[-1], running
    stopped = drawn_title(plot.figure())  # notebook 03's plot.update() after train() returned
    assert (
        "ETA" not in stopped and "step 11,801: val 2.2500" in stopped and "1.23M tok/s" in stopped
    ), stopped


def test_a_resume_on_a_fresh_vm_draws_the_runs_history_before_its_first_step(tmp_path, char_data):
    """After a disconnect notebook 03's plot stayed empty until the next validation, minutes away on gpt2-small,
    though the earlier steps were on Drive: train()'s on_log now draws them as soon as the run is resumed."""
    from gptlib.training.logs import LivePlot

    args = dict(
        preset="phase1",
        overrides=TINY + ["eval_interval=5"],
        progress=False,
        log=quiet,
        mirror_dir=tmp_path / "drive",
    )
    train(char_data, tmp_path / "vm1", max_steps=10, **args)
    drawn = []

    def on_log(row):  # notebook 03's plot.update, and what it drew
        fig = LivePlot(tmp_path / "vm2").figure(row)
        drawn.append((row["step"], list(fig.axes[0].lines[0].get_xdata()), fig.axes[0].get_title()))

    # a fresh VM: the history on Drive
    r = train(char_data, tmp_path / "vm2", max_steps=15, on_log=on_log, **args)
    assert r.resumed_from == 10 and [step for step, _, _ in drawn] == [10, 15]
    step, train_steps, title = drawn[0]
    assert train_steps == list(range(1, 11)) and "step 10: val" in title and "tok/s" not in title, (
        title
    )


def test_an_on_log_that_fails_at_a_resume_still_releases_the_run(tmp_path, char_data):
    """on_log is the caller's code, called at a resume before the first step: if it raises, its error reaches the
    caller and the run is released, so the next call in the same kernel trains (it was refused as 'in use by a
    training still running in this process' until the kernel restarted)."""
    args = dict(preset="phase1", overrides=TINY, progress=False, log=quiet)
    train(char_data, tmp_path / "run", max_steps=4, **args)

    def broken_plot(row):
        raise RuntimeError("the plot broke")

    with pytest.raises(RuntimeError, match="the plot broke"):
        train(char_data, tmp_path / "run", max_steps=8, on_log=broken_plot, **args)
    r = train(char_data, tmp_path / "run", max_steps=8, **args)
    assert (r.resumed_from, r.step) == (4, 8)


def test_runs_figure_draws_several_runs_val_loss_against_tokens_seen(
    tmp_path, char_data, monkeypatch
):
    """Notebook 04's run comparison: this run and the others under the runs folder (one only on "Drive", its mirror),
    each a line of val loss against tokens seen, the legend naming it with its preset and recipe; a run of another
    vocabulary (loss per character vs per token) or without a checkpoint is left out unless named, and one line says
    which and why; a comparison of this run alone says so (04 drew a single dot without a word)."""
    skip_without_muon()
    from gptlib import find_runs, runs_figure
    from gptlib.errors import CheckpointError

    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "root"))
    runs, args = (
        tmp_path / "root" / "runs",
        dict(preset="phase1", max_steps=10, progress=False, log=quiet),
    )
    train(char_data, runs / "a", overrides=TINY + ["eval_interval=5"], **args)
    # the VM's copy is gone; on Drive the rows are in each checkpoint
    train(
        char_data,
        tmp_path / "vm" / "b",
        overrides=TINY + ["eval_interval=5", "batch_size=4"],
        recipe="modern",
        mirror_dir=runs / "b",
        **args,
    )
    chars = json.loads((runs / "a" / "config.json").read_text())["model"]["vocab_size"]
    for name, vocab in (("bpe", 32768), ("new", chars)):  # "new": no checkpoint yet
        (runs / name).mkdir()
        (runs / name / "config.json").write_text(json.dumps({"model": {"vocab_size": vocab}}))
    said = []
    found = find_runs("", runs / "a", log=said.append)
    assert found == [runs / "a", runs / "b"], found
    # what was left out, and why, in one line (04 drew the runs without a word of the others)
    assert said == [
        f"compare: 2 runs; left out bpe (vocabulary 32768, not this run's {chars}: losses do not "
        f"compare), new (no checkpoint yet)"
    ], said
    # a run of its own vocabulary: drawn alone, and said so
    said.clear()
    assert find_runs("", runs / "bpe", log=said.append) == [runs / "bpe"]
    assert said == [
        "compare: only this run; left out "
        + ", ".join(
            f"{name} (vocabulary {chars}, not this run's 32768: losses do not compare)"
            for name in ("a", "b", "new")
        )
    ], said
    ax = runs_figure(found).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "a (phase1, gpt2)",
        "b (phase1, modern)",
    ]
    assert [list(line.get_xdata()) for line in ax.lines] == [
        [5 * 256, 10 * 256],
        [5 * 128, 10 * 128],
    ]
    assert all(len(line.get_ydata()) == 2 for line in ax.lines)
    # named: those, each once
    assert find_runs(f"{runs / 'a'}, b", runs / "a") == [
        runs / "a",
        runs / "b",
    ]
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        find_runs("new", runs / "a")
    # named with another vocabulary: drawn as asked, and said (they were drawn on one axis without a word)
    shutil.copytree(runs / "a", runs / "c")
    config = json.loads((runs / "c" / "config.json").read_text())
    config["model"]["vocab_size"] = 32768
    (runs / "c" / "config.json").write_text(json.dumps(config))
    said.clear()
    assert find_runs("b, c", runs / "a", log=said.append) == [runs / "a", runs / "b", runs / "c"]
    assert said == [f"compare: c has vocabulary 32768, not a's {chars}: losses do not compare"], (
        said
    )
    # no other run at all
    monkeypatch.setenv("GPTLIB_ROOT", str(tmp_path / "alone"))
    said.clear()
    assert find_runs("", runs / "a", log=said.append) == [runs / "a"]
    assert said == [f"compare: only this run; no other run in {tmp_path / 'alone' / 'runs'}"], said


def test_notebook_02s_loss_plot_and_samples_give_up_a_hung_drive(tmp_path, monkeypatch):
    """Notebook 02's loss curve and samples cells read the run's copy on Drive on a fresh VM: a Drive that stops
    answering ended neither (Image(filename=...) and the samples read had no time limit); each now raises
    HungIOError, naming the file, after Drive's time limit. loss.png is a FIFO with no writer, whose reader blocks as
    on a hung mount; the samples' read blocks until the test ends."""
    import os
    import threading

    import gptlib.training.logs as logs
    from gptlib.fsutil import HungIOError, read_jsonl

    monkeypatch.setattr(logs, "DRIVE_READ_STALL_S", 0.5)
    os.mkfifo(tmp_path / "loss.png")
    (tmp_path / "samples.jsonl").write_text('{"step": 1, "prompt": "a", "text": "b"}\n')
    answers = threading.Event()
    monkeypatch.setattr(logs, "read_jsonl", lambda path: answers.wait() and read_jsonl(path))
    try:
        with pytest.raises(HungIOError, match="loss.png made no progress for 0.5 s"):
            logs.loss_png(tmp_path)
        with pytest.raises(HungIOError, match="samples.jsonl made no progress for 0.5 s"):
            logs.samples_html(tmp_path)
    finally:
        # the abandoned readers end
        answers.set()
        threading.Thread(
            target=lambda: open(tmp_path / "loss.png", "wb").close(), daemon=True
        ).start()
    assert "<td" in logs.samples_html(tmp_path)
    png = tmp_path / "plot" / "loss.png"
    png.parent.mkdir()
    logs.plot_losses([{"step": 1, "train_loss": 2.0}], png)
    assert logs.loss_png(png.parent) == png.read_bytes()


def test_a_value_edited_in_config_json_is_said_at_a_resume_not_lost_silently(
    tmp_path, char_data, capsys
):
    """config.json records the run and a resume does not read it: a value a learner edited there (learning_rate,
    max_steps, a shape field) was overwritten without a word. Now one line names each, with the value the run uses,
    and where to ask for it; training goes on as before (the same curve as a resume of the unedited run)."""
    from gptlib.__main__ import main

    sets = [a for s in TINY + ["eval_interval=5"] for a in ("--set", s)]
    for run in ("plain", "edited"):
        args = ["train", "--data", str(char_data), "--run-dir", str(tmp_path / run), *sets]
        assert main([*args, "--max-steps", "10"]) == 0
    path = tmp_path / "edited" / "config.json"
    config = json.loads(path.read_text())
    config["train"].update(learning_rate=0.005, max_steps=40)
    config["model"].update(n_layer=3, bias=True)
    path.write_text(json.dumps(config))
    capsys.readouterr()
    for run in ("plain", "edited"):
        args = ["train", "--data", str(char_data), "--run-dir", str(tmp_path / run), *sets]
        assert main([*args, "--max-steps", "20"]) == 0
    out = capsys.readouterr().out
    said = [m for m in out.splitlines() if "config.json" in m]
    assert said == [
        f"{path} has n_layer 3 (this run: 2), bias True (this run: False), max_steps 40 (this run: 20), "
        f"learning_rate 0.005 (this run: 0.01), which this run does not use: a resume takes its config from the "
        f"call and the checkpoint, not config.json; ask for a value where the run is started (its flags and "
        f"--set FIELD=VALUE); a shape field needs a new run"
    ], out
    curve = {
        run: [(r["step"], r["train_loss"], r.get("val_loss")) for r in read_metrics(tmp_path / run)]
        for run in ("plain", "edited")
    }
    assert curve["edited"] == curve["plain"] and curve["plain"][-1][0] == 20
    # written again with what the run used: the next resume has nothing to say
    args = ["train", "--data", str(char_data), "--run-dir", str(tmp_path / "edited"), *sets]
    assert json.loads(path.read_text())["train"]["max_steps"] == 20
    assert main([*args, "--max-steps", "20"]) == 0
    assert "config.json" not in capsys.readouterr().out
    # a run already finished says it too: a longer max_steps there was the edit most often lost
    config = json.loads(path.read_text())
    config["train"]["max_steps"] = 40
    path.write_text(json.dumps(config))
    assert main([*args, "--max-steps", "20"]) == 0
    out = capsys.readouterr().out
    assert f"{path} has max_steps 40 (this run: 20), which this run does not use" in out, out
    assert read_metrics(tmp_path / "edited")[-1]["step"] == 20
