"""train(): the run started in plain order (the config asked for, the lease, where it starts from, the config decided,
the run's parts built), then the loop: a step (training/step.py), log, validate, save, stop; the stop button. The
same call again resumes from the newest valid checkpoint, exactly: on CPU bit for bit."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from gptlib import colab
from gptlib.batches import BatchSampler
from gptlib.config import RunConfig, build_config
from gptlib.data.staging import stage_for_training
from gptlib.errors import OutOfMemoryAdvice, loud
from gptlib.evaluation.evaluate import make_row
from gptlib.evaluation.hellaswag import metrics_fields
from gptlib.layout import LOSS_PLOT
from gptlib.lease import claimed
from gptlib.runtime import dtype_name, resolve_device, resolve_dtype
from gptlib.training.logs import MetricsLog, log_samples, plot_losses, run_title
from gptlib.training.memory import free_memory, is_oom, oom_advice
from gptlib.training.resume import StartOptions, find_start
from gptlib.training.run import TrainingRun, build_run, setup_ddp
from gptlib.training.start import decide_config, say_config_edits
from gptlib.training.step import StepTimer, lr_at, train_step, validation_loss
from gptlib.training.throughput import RunProgress

# validation batches come from their own fixed seed: the same batches every time
VAL_SEED_OFFSET = 10_000


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # optimizer steps completed
    tokens_seen: int
    train_loss: float | None  # last logged training loss
    val_loss: float | None  # last validation loss (None if no validation ran) ...
    val_step: int | None  # ... measured at this step
    best_val_loss: float | None
    # training wall time of this call (start-up and the final wait for Drive excluded)
    elapsed_s: float
    # over elapsed_s: the first (compile) step, validations, samples and saves included
    tokens_per_s: float
    # while stepping: those left out; the bar's and metrics.jsonl's (None: too short)
    steady_tokens_per_s: float | None
    resumed_from: int | None  # step of the checkpoint this call resumed from
    # "max_steps" | "finished" (nothing to do) | "max_minutes" | "interrupt" | "sigterm" | "stop" (DDP: another
    # rank's)
    stopped_by: str
    history: list[dict] = field(default_factory=list)  # metrics.jsonl rows
    # with a mirror_dir: the newest checkpoint's step if its Drive copy failed
    not_on_drive: int | None = None

    def summary(self, steps_setting: str = "max_steps") -> str:
        """The closing line. steps_setting: what a finished run raises to train further, in the caller's terms
        (train()'s max_steps; the CLI's --max-steps; a notebook's MAX_STEPS or TOKEN_BUDGET_M)."""
        drive = self.not_on_drive is not None and (
            f"; !! step {self.not_on_drive:,} is NOT on Drive, only on this disk: its copy failed (see above); "
            f"re-run once Drive works"
        )
        end = f"-> {self.run_dir}{drive or ''}"
        val = "" if self.val_loss is None else f"{self.val_loss:.4f}"
        if self.stopped_by == "finished":
            return (
                f"already finished at step {self.step:,}{val and f' (val {val})'}; nothing to do "
                f"(raise {steps_setting} to train further) {end}"
            )
        if val and self.val_step != self.step:
            val += f" (at step {self.val_step:,})"
        # one tokens/s figure (two, 15,166 and 15,104, read as a contradiction): while stepping, once measured
        steady = self.steady_tokens_per_s
        speed = f"{steady or self.tokens_per_s:,.0f} tokens/s{' while stepping' if steady else ''}"
        return (
            f"done: step {self.step:,}, val loss {val or 'n/a'}, {speed}; {self.elapsed_s:.1f} s this session, its "
            f"first step, validations and saves included ({self.stopped_by}) {end}"
        )


def train(
    data_dir: str | Path,
    run_dir: str | Path,
    preset: str | RunConfig = "phase1",
    overrides: dict | list | None = None,
    *,
    recipe: str | None = None,
    options: StartOptions | None = None,
    mirror_dir: str | Path | None = None,
    max_steps: int | None = None,
    max_minutes: float | None = None,
    seed: int | None = None,
    device: str | None = None,
    compile: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    on_log: Callable[[dict], None] | None = None,
    stage_data: bool = True,
) -> TrainResult:
    """Train (or resume: the same call again) a GPT on a data directory into run_dir.

    preset, overrides (["n_layer=6", ...] or a dict), recipe (gpt2 | modern; None: a resumed run's or a base's own,
    else gpt2) and the keywords max_steps ... compile make the config (gptlib/config.py). options: how to start
    (StartOptions: --init-from, --take-over, --skip-unreadable, --allow-data-change). mirror_dir (Drive): a copy of
    every checkpoint, searched at resume. on_log(row) after each validation and at a resume ({"step": N}: a live
    plot draws the run so far). stage_data: read data on Drive from a local copy (gptlib/data/staging.py)."""
    explicit = dict(
        max_steps=max_steps, max_minutes=max_minutes, seed=seed, device=device, compile=compile
    )
    # the config asked for: a bad setting is refused before anything
    asked = build_config(preset, overrides, recipe=recipe, **explicit)
    # under torchrun: join the process group (rank 0 alone logs, shows progress and writes files); else a no-op
    ddp = setup_ddp(asked.train.device)
    if not ddp.is_main:
        progress, log, on_log = False, (lambda msg: None), None
    # the device (no recipe changes it); bf16 on a GPU without it is refused before anything changes
    dev = ddp.device(resolve_device(asked.train.device))
    resolve_dtype(asked.train.dtype, dev)
    options, run_dir = options or StartOptions(), Path(run_dir)
    mirror_dir = Path(mirror_dir) if mirror_dir is not None else None
    # the lease first: a set-up refused inside leaves no lease and no directory it created behind
    with claimed(run_dir, mirror_dir, ddp.is_main, options.take_over, log) as lease:
        # where the run starts from: its newest checkpoint that loads, an --init-from base, or nothing
        start = find_start(Path(data_dir), run_dir, mirror_dir, options, log)
        # a run already at max_steps says only that (its summary): set-up lines would read as if it trained again
        finished = start.resume is not None and start.resume.state.step >= asked.train.max_steps
        say = (lambda msg: None) if finished else log
        # the config it trains with, decided once: recipe, data, base, what a resume keeps, checks
        config_for = functools.partial(build_config, preset, overrides, **explicit)
        fixed = recipe if isinstance(preset, str) else preset.recipe  # None: the run's own
        cfg, measure = decide_config(asked, config_for, fixed, start, dev, say)
        # config.json is written again below: a value there this run does not use is said, even for a finished run
        if start.resume is not None:
            say_config_edits(start, cfg, measure, log)
        # data on Drive is read from a verified copy on the VM's disk, made after the checks; a finished run reads none
        on_drive = Path(data_dir).resolve().is_relative_to(colab.DRIVE_MOUNT.resolve())
        if stage_data and on_drive and not finished:
            start.meta = replace(start.meta, data_dir=stage_for_training(data_dir, True, log))
        # its parts: model, data, optimizer, scaler, sampler, the checkpoint loaded, compile, DDP
        run = build_run(cfg, measure, start, ddp, dev, lease, verbose=progress, log=log, say=say)
    # the loaded checkpoint is dropped: its state is in the run's parts now (gpt2-small's: ~1.3 GB of host RAM)
    del start
    # checkpoints name the data's lasting place, not the VM's copy; absolute, for eval run from another folder
    run.state.data_dir = str(Path(data_dir).absolute())
    if run.state.step >= run.cfg.train.max_steps:
        return _finished(run)
    return _loop(run, progress, log, on_log)


def _loop(run: TrainingRun, progress: bool, log, on_log) -> TrainResult:
    """However the steps end (max_steps, max_minutes, a stop, an OOM, an error), the run is closed (_close).
    max_steps, max_minutes and a stop save the last complete step; after an OOM, or an interrupt that cut a step in
    two, the last checkpoint stands."""
    tc, state = run.cfg.train, run.state
    timer = StepTimer(run.device)
    # the record of the losses (metrics.jsonl), and what shows the run (bar, lines, MFU, ETA, on_log)
    metrics, shown = MetricsLog(run), RunProgress(run, timer, progress, log, on_log)
    tokens_at_start, stopped_by = state.tokens_seen, "max_steps"
    # read once: the step below runs thousands of times
    autocast, tokens_per_step = run.autocast, run.tokens_per_step
    stop = GracefulStop(log).install()  # stop button / SIGTERM: finish the step, save, return
    try:
        # inside the try: it calls on_log (the caller's code), and a failure there must still release the run
        shown.started()
        while state.step < tc.max_steps:
            # one optimizer step and its counters, as one: a second stop press takes effect when they are done
            with stop.deferred():
                loss = train_step(
                    run.train_model,
                    run.optimizer,
                    run.scaler,
                    run.sampler,
                    accum=tc.grad_accum_steps,
                    grad_clip=tc.grad_clip,
                    autocast=autocast,
                    timer=timer,
                    lr=lr_at(state.step, tc),
                )
                state.step, state.tokens_seen = state.step + 1, state.tokens_seen + tokens_per_step
                metrics.add(loss)
            if not shown.warm:
                shown.warmed_up(loss)
            # log, validate, checkpoint; stop early when out of time or asked to
            stopped_by = _after_step(run, metrics, shown, stop, log) or stopped_by
            if stopped_by != "max_steps":
                break
    except Exception as e:  # an OOM, also one torch.compile wrapped in its own exception
        if not is_oom(e):
            raise
        stopped_by = "oom"  # (e goes at the end of this block: its frames would pin GPU memory)
    # a second stop press outside a step, or an interrupt without the signal handlers
    except KeyboardInterrupt:
        stopped_by = "interrupt"
        _interrupted(run, metrics, shown, stop.cut, log)
    finally:
        # training time: start-up and the wait for Drive excluded
        train_s = _close(run, metrics, shown, stop)
    if stopped_by == "oom":
        _raise_oom_advice(run)
    return TrainResult(
        run_dir=run.run_dir,
        step=state.step,
        tokens_seen=state.tokens_seen,
        train_loss=metrics.train_loss,
        val_loss=metrics.val_loss,
        val_step=metrics.val_step,
        best_val_loss=state.best_val_loss,
        elapsed_s=train_s,
        tokens_per_s=(state.tokens_seen - tokens_at_start) / max(train_s, 1e-9),
        steady_tokens_per_s=shown.steady_tokens_per_s(),
        resumed_from=run.resumed_from,
        stopped_by=stopped_by,
        history=metrics.history,
        not_on_drive=run.writer.status()["mirror_missing"],
    )


def _after_step(
    run: TrainingRun, metrics: MetricsLog, shown: RunProgress, stop: GracefulStop, log
) -> str | None:
    """-> why training stops early ("max_minutes", the stop's reason), or None to go on."""
    tc, state = run.cfg.train, run.state
    # decisions on time and stop requests: the same on every DDP rank (agreed at log steps)
    over_time = tc.max_minutes > 0 and shown.session_s() >= 60 * tc.max_minutes
    time_due = (
        tc.save_every_minutes > 0
        and time.time() - run.writer.last_save >= 60 * tc.save_every_minutes
    )
    over_time, time_due, stop_now = run.ddp.agree(
        state.step, tc.log_interval, over_time, time_due, bool(stop.reason)
    )
    is_last = state.step == tc.max_steps
    validating = state.step % tc.eval_interval == 0 or is_last or over_time
    milestone = tc.keep_every and state.step % tc.keep_every == 0
    saving = (
        stop_now
        or validating
        or time_due
        or milestone
        or state.step % (tc.save_every_steps or tc.eval_interval) == 0
    )
    if state.step % tc.log_interval == 0 or saving:
        # another process took the run over (this one was frozen, say): stop before writing anything more
        run.lease.check()
        # a Drive copy that hangs is given up here: a save runs no watchdog thread of its own
        run.writer.watch()
        # log the losses: the host sync, once per log_interval and before a checkpoint (on a log boundary)
        metrics.flush(validating, shown.measure())
        shown.show(metrics.train_loss)
    if validating or saving:
        # their time counts in the ETA, not in tokens/s or MFU
        with shown.paused():
            val_loss = _validate(run, metrics, shown, is_last, log) if validating else None
            if saving:
                # the run's last save (a stop's, the last step's, max_minutes'): a second press waits for it
                stop.saving_last = stop_now or is_last or over_time
                _save(run, val_loss, shown.elapsed())
    shown.bar.update(1)
    if not (over_time or stop_now) or is_last:
        return None
    stopped_by = "max_minutes" if over_time else (stop.reason or "stop")
    why = f"max_minutes={tc.max_minutes} reached" if over_time else f"stopped ({stopped_by})"
    # how to continue: the caller's last line says it
    log(f"{why} at step {state.step:,}; checkpoint saved")
    return stopped_by


def _save(run: TrainingRun, val_loss: float | None, elapsed_s: float, gather: bool = True) -> None:
    """The checkpoint of now, written in the background (gptlib/checkpoint/writer.py)."""
    run.state.val_loss, run.state.elapsed_s = val_loss, elapsed_s
    run.writer.save(run.state_dict(gather))


def _validate(
    run: TrainingRun, metrics: MetricsLog, shown: RunProgress, is_last: bool, log
) -> float:
    """Validation loss on fixed batches (the same every time: their own seed), the best so far, HellaSwag, the
    fixed prompts sampled, loss.png, a log row."""
    tc, state, data = run.cfg.train, run.state, run.data
    val_sampler = BatchSampler(
        data.splits["val"],
        tc.batch_size,
        run.cfg.model.block_size,
        tc.seed + VAL_SEED_OFFSET,
        run.device,
        data.loss_masks.get("val"),
    )
    val_loss = validation_loss(run.model, val_sampler, tc.eval_batches, run.autocast)
    if state.best_val_loss is None or val_loss < state.best_val_loss:
        state.best_val_loss, state.best_step = val_loss, state.step
    hellaswag = _hellaswag(run, metrics, is_last)
    row = metrics.validation_row(val_loss, shown.speed(), hellaswag)
    samples = []
    if run.ddp.is_main:
        if data.sample_prompts and tc.sample_tokens:
            samples = log_samples(
                run.model,
                data.tokenizer,
                data.sample_prompts,
                tc.sample_tokens,
                tc.seed,
                run.autocast,
                state.step,
                run.run_dir,
                log,
                data.sample_stop_ids,
            )
        plot_losses(
            metrics.history,
            run.run_dir / LOSS_PLOT,
            title=run_title(run.cfg.preset, run.run_dir.name),
        )
    shown.report_validation(row, samples, run.writer.status_line())
    return val_loss


def _hellaswag(run: TrainingRun, metrics: MetricsLog, is_last: bool) -> dict:
    """The fixed subset when a multiple of hellaswag_every was passed since the last validation (or this call's
    start), every item at the end of the run (also in eval.jsonl) -> the metrics row's fields."""
    probe, every, st = run.data.hellaswag, run.cfg.train.hellaswag_every, run.state
    since = metrics.val_step if metrics.val_step is not None else (run.resumed_from or 0)
    if probe is None or not (is_last or st.step // every > since // every):
        return {}
    res = probe.score(run.model, run.device, run.dtype, full=is_last)
    if res is not None and is_last:
        # the save that follows appends it to eval.jsonl with the weights' sha256 (notebook 04 reuses it)
        extra = dict(source="training", dtype=dtype_name(run.dtype))
        run.writer.eval_row = make_row("hellaswag", st.step, st.tokens_seen, res, **extra)
    return metrics_fields(res)


def _interrupted(run: TrainingRun, metrics: MetricsLog, shown: RunProgress, cut: bool, log) -> None:
    """Save the last complete step, unless the interrupt cut a step in two: its state is then half-made."""
    if cut:
        log(
            f"interrupted during step {run.state.step + 1:,}; nothing saved: the last checkpoint stands"
        )
        return
    log(f"interrupted at step {run.state.step:,}; saving it")
    # the checkpoint's log boundary (under DDP the ranks may be anywhere: no collective)
    if not run.ddp.enabled:
        metrics.flush(False, shown.measure())
    _save(run, None, shown.elapsed(), gather=False)


def _close(run: TrainingRun, metrics: MetricsLog, shown: RunProgress, stop: GracefulStop) -> float:
    """The bar, the last save (a stop press waits for it; then the signal handlers are put back, so Ctrl-C ends the
    wait for Drive), the wait for Drive, then the lease and the process group, whatever raised. -> this session's
    training seconds, read before the wait. A lease lost (another process took the run over) is raised, once: nothing
    is waited for."""
    train_s = shown.session_s()
    try:
        try:
            shown.close(metrics.train_loss)
            metrics.close()  # metrics.jsonl (a full disk raises here)
        finally:
            # local save errors raise; Drive problems are only reported
            if run.lease.lost is None:
                run.writer.close(saving=stop.last_save(), given_up=stop.pressed_again)
        run.lease.check()
    finally:
        stop.restore()
        run.lease.release()
        run.ddp.teardown()
    return train_s


def _finished(run: TrainingRun) -> TrainResult:
    """A run already at max_steps: nothing changes (its summary() says so: the line a notebook or the CLI shows)."""
    try:
        # a fresh VM: its logs came back with the checkpoint, its loss.png (which notebook 02 shows next) is drawn
        if run.ddp.is_main and not (run.run_dir / LOSS_PLOT).exists():
            title = run_title(run.cfg.preset, run.run_dir.name)
            plot_losses(run.history, run.run_dir / LOSS_PLOT, title=title)
        run.writer.close()  # resumed from the local disk: Drive still gets the final checkpoint
    finally:
        run.lease.release()
        run.ddp.teardown()
    st, val = run.state, run.state.val_loss
    return TrainResult(
        run_dir=run.run_dir,
        step=st.step,
        tokens_seen=st.tokens_seen,
        train_loss=run.history[-1].get("train_loss") if run.history else None,
        val_loss=val,
        val_step=st.step if val is not None else None,
        best_val_loss=st.best_val_loss,
        elapsed_s=0.0,
        tokens_per_s=0.0,
        steady_tokens_per_s=None,
        resumed_from=run.resumed_from,
        stopped_by="finished",
        history=run.history,
        not_on_drive=run.writer.status()["mirror_missing"],
    )


def _raise_oom_advice(run: TrainingRun) -> None:
    """Out of GPU memory: drop this call's GPU tensors, so the notebook's runtime stays usable, then say
    which setting to try next (not chained to the OOM, whose frames would pin GPU memory)."""
    hint = oom_advice(run.cfg, run.ddp.world_size)
    run.model = run.train_model = run.optimizer = run.scaler = run.sampler = run.data = None
    torch._dynamo.reset()  # compiled graphs (and CUDA-graph pools) hold GPU memory too: dropped before freeing
    free_memory()
    raise OutOfMemoryAdvice(hint)


class GracefulStop:
    """The first signal only sets `reason`: the loop finishes its step, saves and returns. A second SIGINT raises
    KeyboardInterrupt at once (a loop stuck in validation, say), except inside deferred(), which it waits for, so no
    half update is saved, and once the run's last save is handed to the writer (saving_last), which it waits for too.
    Handlers install from the main thread only; elsewhere KeyboardInterrupt is as usual. What a press does is said
    through `log` (the user's own press: the normal output); a SIGTERM, loudly."""

    def __init__(self, log=print):
        self.log = log
        self.reason: str | None = None  # "interrupt" | "sigterm" once asked to stop
        self._old: dict[int, Any] = {}
        self.cut = False  # an interrupt cut a deferred() block in two (deferred says when)
        # _interrupted: a second press arrived inside deferred(), raised when it ends
        self._deferring = self._interrupted = False
        # a second press during the last save: it stops the wait for Drive that follows, too
        self.pressed_again = threading.Event()
        # the run's last save was handed to the writer: a second press waits for it
        self.saving_last = False

    def install(self) -> "GracefulStop":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, OSError):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.reason is not None:
            if signum == signal.SIGINT and (self._deferring or self.saving_last):
                self._interrupted = True
                self.log("interrupted again: stopping when the update or save in progress ends")
            elif signum == signal.SIGINT:
                # before the stop's save (a validation, say): _interrupted saves; the wait for Drive is skipped too
                self.pressed_again.set()
                raise KeyboardInterrupt
            return
        self.reason = "sigterm" if signum == signal.SIGTERM else "interrupt"
        if signum == signal.SIGINT:
            self.log(
                "interrupted: finishing this step, saving a checkpoint, then stopping (press stop again to stop at "
                "once: the last complete step is saved)"
            )
        else:
            loud("SIGTERM: finishing this step, saving a checkpoint, then stopping")

    @contextlib.contextmanager
    def deferred(self):
        """A block a second stop press must not cut in two: the press takes effect when it ends. An interrupt that
        cuts it all the same (the handlers could not be installed: training outside the main thread) marks the stop
        `cut`: what the block changed is half done, not to be saved."""
        self._deferring = True
        try:
            yield
        except KeyboardInterrupt:
            self.cut = True
            raise
        finally:
            self._deferring = False
        if self._interrupted:
            self._interrupted = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def last_save(self):
        """The run's last save: a stop press waits for it (its thread cannot be stopped mid-write), and sets
        pressed_again. Then the handlers are put back, so that Ctrl-C ends the wait for Drive that follows."""
        self._deferring = True
        try:
            yield
        finally:
            if self._interrupted:
                self.pressed_again.set()
            self._deferring = self._interrupted = False
            self.restore()

    def restore(self) -> None:
        for sig, old in self._old.items():
            if old is not None:
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(sig, old)
        self._old.clear()
