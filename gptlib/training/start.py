"""Where a run starts from, decided before anything in the run directory changes: the run's lease (claimed), then
its resume point or an --init-from base (find_start) and the recipe that goes with it (decide_recipe). Skip on a
first read: training/resume.py is the resume point itself."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlib.checkpoint.format import DRIVE_ADVICE, load_weights_into
from gptlib.config import RunConfig
from gptlib.data.shards import META_FILE, DatasetMeta, read_meta
from gptlib.data.tokenizer import Tokenizer, check_identity, load_tokenizer
from gptlib.errors import ConfigError, DataFormatError, HungIOError
from gptlib.fsutil import call_with_timeout, check_dir
from gptlib.inference.loading import LoadedModel, load_run
from gptlib.layout import LEASE_FILE, STATE_FILE, TOKENIZER_FILE, checkpoints_dir
from gptlib.lease import IO_TIMEOUT_S, RunLease
from gptlib.model import GPT
from gptlib.training import distributed
from gptlib.training.resume import Passed, Resume, find_resume


def split_init_from(spec: str) -> tuple[str, str]:
    """--init-from RUN_DIR[:latest|best|STEP] -> (RUN_DIR, which)."""
    return (
        tuple(spec.rsplit(":", 1)) if ":" in spec and not Path(spec).is_dir() else (spec, "latest")
    )


def names_this_run(spec: str, run_dir: Path, mirror_dir: Path | None) -> bool:
    """Whether --init-from names the run itself (its directory or its Drive mirror); paths only, no disk access (a
    Drive that hangs must not hang this)."""
    base = os.path.abspath(split_init_from(spec)[0])
    return any(d is not None and base == os.path.abspath(d) for d in (run_dir, mirror_dir))


def load_base(spec: str, meta: DatasetMeta, log) -> LoadedModel:
    """The weights a new run starts from (--init-from RUN_DIR[:latest|best|STEP]). The data's tokenizer must be the
    base's, or the base's with tokens appended (tokenize --tokenizer-from BASE_RUN --format chat adds chat markers)."""
    run_dir, which = split_init_from(spec)
    ld = load_run(run_dir, which, log=log)
    base, data = ld.tokenizer.identity(), meta.tokenizer
    grows = (meta.raw.get("tokenizer_base") or {}).get("hash") == base[
        "hash"
    ] and meta.vocab_size > base["vocab_size"]
    if data.get("hash") != base["hash"] and not grows:
        raise ConfigError(
            f"--init-from {spec}: its vocabulary ({base['kind']}, {base['vocab_size']:,} tokens, "
            f"tokenizer {base['hash'][:12]}) is not the data's ({meta.data_dir}: {data.get('kind')}, "
            f"{meta.vocab_size:,} tokens, tokenizer {str(data.get('hash'))[:12]}); tokenize the data "
            f"with --tokenizer-from {run_dir}"
        )
    mc, added = (
        ld.config.model,
        f"; vocabulary {base['vocab_size']:,} -> {meta.vocab_size:,} (new rows added)",
    )
    log(
        f"init-from: the weights of {ld.path} (step {ld.step:,}); {mc.n_layer} layers x {mc.n_embd}, context "
        f"{mc.block_size}" + (added if grows else "")
    )
    return ld


def start_from_base(model: GPT, base: LoadedModel) -> None:
    """The embedding and output rows of the tokens appended after the base's vocabulary start at the mean of the
    base's rows; every other weight is the base's."""
    sd, n = base.model.state_dict(), base.tokenizer.vocab_size
    for key, new in model.state_dict().items():
        # wte and lm_head (one tensor when tied): the vocabulary grew
        if key in sd and sd[key].shape != new.shape:
            grown = torch.zeros_like(new)
            grown[:n] = sd[key][:n]
            grown[n : model.config.vocab_size] = sd[key][:n].mean(dim=0)
            sd[key] = grown
    load_weights_into(model, sd, base.path)


@contextlib.contextmanager
def claimed(run_dir: Path, mirror_dir: Path | None, ddp: distributed.Dist, take_over: bool, log):
    """The run's lease, taken before anything in run_dir or the mirror changes. A set-up refused inside the block
    releases it and removes the directories it created (if still empty); otherwise the loop releases it."""
    # a lease on no directory (never acquired) checks and releases nothing: the other DDP ranks'
    created, lease = [], RunLease([])
    try:
        if ddp.is_main:
            try:
                # Drive may hang
                created = [
                    d
                    for d, what in ((run_dir, "run"), (mirror_dir, "mirror"))
                    if d is not None
                    and not call_with_timeout(
                        lambda d=d, what=what: _looked_at(d, f"{what} directory"),
                        IO_TIMEOUT_S,
                        what=f"looking at {d}",
                    )
                ]
                lease = RunLease([run_dir, mirror_dir], take_over, log).acquire()
            except HungIOError as e:  # Drive did not answer: its lease may be another process's
                raise HungIOError(
                    e.errno,
                    f"{e.strerror}: training did not start and nothing was changed; {DRIVE_ADVICE}",
                ) from None
        yield lease
    except BaseException:
        lease.release()
        for d in created:  # no other process had a lease here: this call's released one goes too
            with contextlib.suppress(OSError):
                (d / LEASE_FILE).unlink()
            for empty in (checkpoints_dir(d), d):
                with contextlib.suppress(OSError):
                    empty.rmdir()
        raise


def _looked_at(d: Path, what: str) -> bool:
    """Whether d exists; a file or a symlink loop there is one line now, not a traceback at the first save."""
    exists = check_dir(d, what)
    if exists:
        check_dir(checkpoints_dir(d), f"{what}'s checkpoints folder")
    return exists


@dataclass(frozen=True)
class StartOptions:
    """How a call starts or resumes a run (its config says what it trains)."""

    # "RUN_DIR[:latest|best|STEP]": a new run from those weights, fresh optimizer
    init_from: str | None = None
    take_over: bool = False  # take the run's lease from another process (gptlib/lease.py)
    # go on without newer checkpoints Drive cannot read now (they are kept)
    skip_unreadable: bool = False
    # resume on other tokens of the same tokenizer (recorded in state.json)
    allow_data_change: bool = False


def decide_recipe(default: str, asked: str | None, start: Start) -> str:
    """A model keeps its recipe (its layers differ): a resumed run's or an --init-from base's own. Another one asked
    for is refused; a new run takes the one asked for (default: the preset's, gpt2)."""
    held = start.held
    if held is None or held.recipe == (asked or held.recipe):
        return held.recipe if held is not None else default
    raise ConfigError(
        f"{start.run_dir}: the {start.whose} was trained with --recipe {held.recipe} but this call asks for "
        f"--recipe {asked}; a model keeps its recipe (its layers differ): drop --recipe to go on with "
        f"{held.recipe}, or use a new run directory"
    )


@dataclass
class Start:
    run_dir: Path
    mirror_dir: Path | None
    options: StartOptions
    meta: DatasetMeta
    tokenizer: Tokenizer
    resume: Resume | None
    passed: Passed
    base: LoadedModel | None  # --init-from's
    held: RunConfig | None  # the config the model already has (its shape and recipe stay)

    @property
    def whose(self) -> str:  # the held config's
        return "resumed run" if self.resume is not None else "--init-from base"


def find_start(
    data_dir: Path,
    run_dir: Path,
    mirror_dir: Path | None,
    options: StartOptions,
    log,
) -> Start:
    meta = read_meta(data_dir)
    tokenizer = load_tokenizer(meta.data_dir / meta.tokenizer.get("file", TOKENIZER_FILE))
    check_identity(tokenizer, meta.tokenizer, str(meta.data_dir))
    # the model's embedding would be too small for its ids
    if tokenizer.vocab_size > meta.vocab_size:
        raise DataFormatError(
            f"{meta.data_dir / META_FILE}: vocab_size is {meta.vocab_size:,} but the tokenizer has "
            f"{tokenizer.vocab_size:,} tokens; tokenize again (--overwrite)"
        )
    resume, passed = find_resume(run_dir, mirror_dir, log, options.skip_unreadable)
    init_from = options.init_from
    if resume is None and init_from and names_this_run(init_from, run_dir, mirror_dir):
        raise ConfigError(
            f"--init-from {init_from} is this run's own directory, which has no checkpoint yet: "
            f"--init-from starts a new run from another run's weights; drop it to train this one from "
            f"scratch"
        )
    base = load_base(init_from, meta, log) if init_from and resume is None else None
    held = (
        resume.state.run_config(str(resume.info.path / STATE_FILE))
        if resume is not None
        else base and base.config
    )
    return Start(run_dir, mirror_dir, options, meta, tokenizer, resume, passed, base, held)
