"""One training step and one validation pass: train() and the benchmarks run this same code. A step reads no tensor
back to the host (one exception: fp16 with the modern recipe, where GradScaler checks for inf on the host before
Muon's update, as torch's Muon does not take the loss scale itself); the caller decides when to pay for that sync
(train(): once per log_interval). A validation pass ends with one."""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter

import torch
from torch.nn.parallel import DistributedDataParallel

from gptlib.config import TrainConfig
from gptlib.errors import CheckpointError, override
from gptlib.layout import STATE_FILE
from gptlib.model import GPT


def lr_at(step: int, cfg) -> float:
    """Linear warmup to the peak, then cosine down to min_lr_ratio * peak at max_steps; or wsd: the peak until the
    last cooldown_frac of max_steps, then linear down (before the cooldown the LR does not depend on max_steps, so
    a run extends exactly)."""
    peak = cfg.learning_rate
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        # 1 at the cooldown's start
        left = (cfg.max_steps - step) / max(1.0, cfg.cooldown_frac * cfg.max_steps)
        return peak * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * min(1.0, max(0.0, left)))
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    min_lr = peak * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - min_lr)


def set_lr(optimizer, lr: float) -> None:
    """A group with an lr_scale (MuonAdamW's, below) runs at lr * lr_scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr


def train_step(
    model,
    optimizer,
    scaler,
    batches,
    *,
    accum: int,
    grad_clip: float,
    autocast,
    timer,
    lr: float | None = None,
) -> torch.Tensor:
    """One optimizer step over `accum` micro-batches -> their mean loss, on the device. batches.next_batch() ->
    (x, y), each (micro_batch, block_size) token ids; timer: a StepTimer (the data / fwd_bwd / optim split);
    lr: None keeps the optimizer's."""
    if lr is not None:
        set_lr(optimizer, lr)
    loss_sum = torch.zeros((), device=next(model.parameters()).device)
    timer.start()
    for micro in range(accum):
        x, y = batches.next_batch()
        timer.mark("data")
        # DDP all-reduces the gradients on the last micro-batch only: the others accumulate locally
        skip_sync = isinstance(model, DistributedDataParallel) and micro < accum - 1
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            # [1]: the loss alone; the logits (B, T, vocab) are not kept past the forward
            with autocast:
                loss = model(x, y)[1]
            loss = loss / accum  # the mean over the micro-batches, as one large batch would give
            loss_sum += loss.detach()
            # fp16: the loss scaled up, so small gradients do not underflow (a no-op otherwise)
            scaler.scale(loss).backward()
        timer.mark("fwd_bwd")
    # clip (fp16: the gradients unscaled first), update (fp16: skipped on inf/nan gradients), drop the gradients
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    timer.mark("optim")
    return loss_sum


class StepTimer:
    """Seconds per phase (data, fwd_bwd, optim) with no host sync in the hot loop: on CUDA, events are read only in
    split(), where the loop syncs anyway at log time."""

    def __init__(self, device: str | torch.device):
        self.events = torch.device(device).type == "cuda"
        self.marks = []  # (phase, its start, its end): CUDA events or perf_counter seconds
        self._last = None

    def _now(self):
        if not self.events:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def start(self) -> None:
        self._last = self._now()

    def mark(self, phase: str) -> None:
        """The time since the previous start/mark belongs to `phase`."""
        self.marks.append((phase, self._last, now := self._now()))
        self._last = now

    def split(self) -> dict[str, float]:
        """{phase: seconds} since the last split."""
        if self.events and self.marks:
            self.marks[-1][2].synchronize()
        out = Counter()
        for phase, a, b in self.marks:
            out[phase] += a.elapsed_time(b) / 1000 if self.events else b - a
        self.marks.clear()
        return dict(out)


@torch.no_grad()
def validation_loss(model, sampler, n_batches: int, autocast) -> float:
    """Mean loss over n_batches of a fresh fixed-seed sampler (the same batches at every evaluation); a host sync."""
    was_training = model.training
    model.eval()
    losses = torch.zeros(n_batches, device=next(model.parameters()).device)
    for i in range(n_batches):
        x, y = sampler.next_batch()
        with autocast:
            losses[i] = model(x, y)[1].float()
    model.train(was_training)
    return float(losses.mean())


def _with_this_runs_groups(optimizer, state: dict) -> dict:
    """A saved optimizer state with each group's settings replaced by the optimizer's, built from this run's config:
    the checkpoint gives the state (moments, momentum, step counts) and the lr (the schedule's, set again before
    every step), the config every hyperparameter (a resume with --set weight_decay=0.0 trains with 0.0, as its
    "resume: ... changed" line says) and this device's flags (a CPU run's fused=False in a GPU run's fused AdamW fails
    under a GradScaler; torch places AdamW's step counts by them)."""
    saved = state["param_groups"]
    if len(saved) != len(optimizer.param_groups):  # torch's own error names the mismatch
        return state
    groups = [
        {**g, **{k: v for k, v in now.items() if k not in ("params", "lr")}}
        for g, now in zip(saved, optimizer.param_groups)
    ]
    return {**state, "param_groups": groups}


class AdamW(torch.optim.AdamW):
    """torch's AdamW, whose load_state_dict keeps this run's settings (_with_this_runs_groups)."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(_with_this_runs_groups(self, state_dict))


class MuonAdamW:
    """Each param group carries `lr_scale`, its peak LR over learning_rate: the schedule sets both from one value."""

    def __init__(self, matrices: list, others: list, tc: TrainConfig, fused: bool):
        self.muon = torch.optim.Muon(
            [{"params": matrices, "lr_scale": tc.muon_lr / tc.learning_rate}],
            lr=tc.muon_lr,
            weight_decay=tc.weight_decay,
            momentum=tc.muon_momentum,
            nesterov=True,
        )
        self.adamw = AdamW(
            [{"params": others, "lr_scale": 1.0}],
            lr=tc.learning_rate,
            betas=(tc.beta1, tc.beta2),
            weight_decay=0.0,
            fused=fused,
        )

    @property
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups + self.muon.param_groups

    def step(self) -> None:
        self.adamw.step()
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(_with_this_runs_groups(self.muon, state["muon"]))


def check_optimizer_fits(ck: dict, where) -> None:
    """Resume's check: CheckpointError (passed over as damaged) unless each saved per-parameter tensor (AdamW's
    moments, Muon's momentum) has its parameter's shape, the parameters taken from the checkpoint's own weights in the
    order its own config's optimizer holds them (no model is built). torch's load_state_dict does not check, and a
    state that does not fit would fail mid-run."""
    if not ck["optimizer"]:  # a run made by import-hf: weights only
        return
    tc = ck["state"].run_config(str(where / STATE_FILE)).train
    # the saved weights in the model's parameter order: a tied weight (lm_head is wte) once
    named, seen = [], set()
    for name, t in ck["model"].items():
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            named.append((name, t))
    params, state = optimizer_params(named, tc), ck["optimizer"]
    if tc.optimizer == "muon":
        halves = [
            ("adamw ", params["adamw"], state["adamw"]),
            ("muon ", params["muon"], state["muon"]),
        ]
    else:
        halves = [("", params["decay"] + params["no_decay"], state)]
    try:
        for name, tensors, saved in halves:
            ids = [i for g in saved["param_groups"] for i in g["params"]]
            if len(ids) != len(tensors):
                raise CheckpointError(
                    f"{where}: the {name}optimizer state has {len(ids)} parameters, this model {len(tensors)}"
                )
            shapes = {i: tuple(t.shape) for i, t in zip(ids, tensors)}
            for i, part in saved["state"].items():
                for key, v in part.items():
                    if isinstance(v, torch.Tensor) and v.dim() and tuple(v.shape) != shapes[i]:
                        raise CheckpointError(
                            f"{where}: {name}optimizer state {key} of parameter {i} has shape "
                            f"{tuple(v.shape)}, the parameter {shapes[i]} (damaged or hand-edited)"
                        )
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{where}: malformed optimizer state ({type(e).__name__}: {e})"
        ) from None


# torch.optim.Muon orthogonalises every update in bf16, which an x86 CPU without AVX-512 emulates in a plain loop
# (~1 GFLOP/s against ~120 in fp32 on a 2-core AVX2 CPU): a phase1 step there takes 4-5x the gpt2 recipe's.
SLOW_BF16_CPUS = ("NO AVX", "AVX2")  # torch.backends.cpu.get_cpu_capability() of such CPUs


def slow_muon_note(tc: TrainConfig, device_type: str) -> str | None:
    capability = torch.backends.cpu.get_cpu_capability()
    if tc.optimizer == "muon" and device_type == "cpu" and capability in SLOW_BF16_CPUS:
        return (
            f"note: torch.optim.Muon computes in bf16, which this CPU ({capability}, no AVX-512) emulates slowly: "
            f"a step takes 4-5x the gpt2 recipe's; {override('optimizer=adamw')} is faster but gives up most of "
            f"the gain"
        )
    return None


def optimizer_params(named: list[tuple[str, torch.Tensor]], tc: TrainConfig) -> dict[str, list]:
    """The parameters by how the optimizer trains them, in its order, from (name, tensor) pairs: a model's own, or a
    checkpoint's saved weights (check_optimizer_fits). adamw: "decay" (the 2-D weights: matmuls, embeddings) and
    "no_decay"; muon: "muon" (every 2-D weight of the blocks) and "adamw" (the rest)."""
    if tc.optimizer == "adamw":
        return {
            "decay": [p for _, p in named if p.dim() >= 2],
            "no_decay": [p for _, p in named if p.dim() < 2],
        }
    in_blocks = [p.dim() == 2 and n.startswith("transformer.h.") for n, p in named]
    return {
        "muon": [p for (_, p), m in zip(named, in_blocks) if m],
        "adamw": [p for (_, p), m in zip(named, in_blocks) if not m],
    }


def build_optimizer(model: GPT, tc: TrainConfig, device_type: str):
    """adamw: GPT-2's AdamW, weight decay on the 2-D weights only; muon: MuonAdamW, Muon taking every 2-D weight of
    the blocks, AdamW the rest (optimizer_params)."""
    params = optimizer_params([(n, p) for n, p in model.named_parameters() if p.requires_grad], tc)
    if tc.optimizer == "muon":
        return MuonAdamW(params["muon"], params["adamw"], tc, fused=device_type == "cuda")
    groups = [
        {"params": params["decay"], "weight_decay": tc.weight_decay},
        {"params": params["no_decay"], "weight_decay": 0.0},
    ]
    return AdamW(
        groups, lr=tc.learning_rate, betas=(tc.beta1, tc.beta2), fused=device_type == "cuda"
    )
