"""AdamW (the gpt2 recipe), or torch.optim.Muon for the blocks' 2-D matrices with AdamW for the rest (the modern
recipe). MuonAdamW steps the two as one optimizer, so the loop, GradScaler and the checkpoint see one object."""

from __future__ import annotations

import torch

from gptlib.config import TrainConfig
from gptlib.errors import CheckpointError, override
from gptlib.layout import STATE_FILE
from gptlib.model import GPT


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


def check_optimizer_state(optimizer, state: dict, where: str) -> None:
    """CheckpointError unless each saved per-parameter tensor (AdamW's moments, Muon's momentum) has its parameter's
    shape: torch's load_state_dict does not check, and a state that does not fit would fail mid-run."""
    try:
        halves = (
            [("adamw ", optimizer.adamw, state["adamw"]), ("muon ", optimizer.muon, state["muon"])]
            if isinstance(optimizer, MuonAdamW)
            else [("", optimizer, state)]
        )
        for name, opt, saved in halves:
            ids = [i for g in saved["param_groups"] for i in g["params"]]
            params = [p for g in opt.param_groups for p in g["params"]]
            if len(ids) != len(params):
                raise CheckpointError(
                    f"{where}: the {name}optimizer state has {len(ids)} parameters, this model "
                    f"{len(params)}"
                )
            shapes = {i: tuple(p.shape) for i, p in zip(ids, params)}
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


def check_optimizer_fits(ck: dict, where) -> None:
    """Resume's check: CheckpointError (passed over as damaged) unless the optimizer state fits the optimizer its own
    config builds (on the meta device: shapes only)."""
    if not ck["optimizer"]:  # a run made by import-hf: weights only
        return
    cfg = ck["state"].run_config(str(where / STATE_FILE))
    with torch.device("meta"):
        model = GPT(cfg.model)
    check_optimizer_state(build_optimizer(model, cfg.train, "meta"), ck["optimizer"], str(where))


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


def build_optimizer(model: GPT, tc: TrainConfig, device_type: str):
    """adamw: GPT-2's AdamW, weight decay on the 2-D weights (matmuls, embeddings) only; muon: MuonAdamW, Muon taking
    every 2-D weight of the blocks, AdamW the rest."""
    if tc.optimizer == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return AdamW(
            groups, lr=tc.learning_rate, betas=(tc.beta1, tc.beta2), fused=device_type == "cuda"
        )
    matrices, others = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (matrices if p.dim() == 2 and name.startswith("transformer.h.") else others).append(p)
    return MuonAdamW(matrices, others, tc, fused=device_type == "cuda")
