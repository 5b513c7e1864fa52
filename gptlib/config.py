"""A run's configuration: the network (ModelConfig), its training (TrainConfig), the presets and the recipes.
Field names are unique across the two, so `--set n_layer=6` needs no prefix; configs are frozen once settled."""

from __future__ import annotations

import ast
import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

from gptlib import __version__
from gptlib.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    # tokens the tokenizer can produce; train() takes it from the data's metadata
    vocab_size: int = 65
    block_size: int = 256  # context length in tokens (learned position embeddings up to this)
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block; must divide n_embd
    n_embd: int = 128  # residual stream width
    dropout: float = 0.0  # dropout on attention/MLP outputs; 0 is best for short single-epoch runs
    # biases in Linear and LayerNorm (GPT-2 had them; without is slightly faster)
    bias: bool = False
    # embedding rows padded to a multiple of this for fast matmuls; logits cut to vocab_size
    vocab_multiple: int = 64
    # The recipe's parts (RECIPES): the defaults are GPT-2's, so configs saved before these fields load unchanged.
    # learned (GPT-2: one embedding per position) | rope (rotary: relative, no table)
    positions: str = "learned"
    norm: str = "layernorm"  # layernorm (GPT-2) | rmsnorm (no mean, no bias: Llama, Qwen3)
    # RMS-normalise each head's queries and keys (Qwen3): bounded attention logits
    qk_norm: bool = False
    mlp: str = "gelu"  # gelu (GPT-2, hidden 4C) | swiglu (SiLU-gated, hidden ~8C/3: Llama, Qwen3)
    # the output layer shares the input embedding's weights (GPT-2); False: its own
    tie_embeddings: bool = True
    zero_init: bool = False  # attention, MLP (and untied head) output projections start at 0: blocks start as identity
    rope_theta: float = 10000.0  # rotary base: the longest wavelength; 10k suits contexts up to a few thousand tokens

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def mlp_hidden(self) -> int:
        """4C, or for SwiGLU 8C/3 rounded up to a multiple of 64 (about the same parameters)."""
        return -(-8 * self.n_embd // (3 * 64)) * 64 if self.mlp == "swiglu" else 4 * self.n_embd

    def validate(self) -> None:
        _check_fields(self)
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"n_head={self.n_head} does not divide n_embd={self.n_embd}: a head is n_embd/n_head wide"
                f" (try n_head in {[h for h in range(1, 33) if self.n_embd % h == 0]})"
            )
        if self.positions == "rope" and (self.n_embd // self.n_head) % 2:
            raise ConfigError(
                f"positions=rope rotates pairs of dimensions: the head size n_embd/n_head = "
                f"{self.n_embd // self.n_head} must be even (change n_head or n_embd)"
            )


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 32  # sequences per micro-batch (per process under DDP)
    # micro-batches per optimizer step; tokens/step = batch_size * block_size * this
    grad_accum_steps: int = 1
    max_steps: int = 2000  # optimizer steps in the whole run (the schedule ends here)
    learning_rate: float = 1e-3  # peak learning rate after warmup
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
    warmup_steps: int = 100  # linear warmup from 0 to the peak
    weight_decay: float = 0.1  # AdamW decay, applied to 2-D weights only (not norms, biases)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 disables
    eval_interval: int = 250  # validate (and sample, and checkpoint) every this many steps
    eval_batches: int = 20  # micro-batches averaged for each validation loss
    log_interval: int = 10  # read the loss back to the host every this many steps (a device sync)
    # sampled at validations (chat: 2 val questions)
    sample_prompts: list[str] = field(default_factory=lambda: ["\n"])
    sample_tokens: int = 200  # new tokens per logged sample
    seed: int = 1337  # seeds model init and the batch sampler; the run is reproducible from it
    # auto (cuda, else mps, else cpu) | cpu | cuda | cuda:N (the current GPU) | mps
    device: str = "auto"
    dtype: str = "auto"  # auto (bf16 where the GPU has it, fp16 + GradScaler on a T4, fp32 on CPU) | float32 | ...
    # auto (on for CUDA runs of >= runtime.COMPILE_MIN_FLOPS, off on CPU) | on | off
    compile: str = "auto"
    # stop gracefully (with a checkpoint) after this much training time; 0 = no limit
    max_minutes: float = 0.0
    save_every_steps: int = 0  # checkpoint every this many steps; 0 = at each validation
    # also checkpoint when this much time passed since the last one; 0 disables
    save_every_minutes: float = 10.0
    keep_last: int = 2  # checkpoints kept besides the best-validation one (never fewer than 2)
    keep_every: int = 0  # keep for good the checkpoints at multiples of this step (notebook 04 compares them); 0 = none
    # score a HellaSwag subset at the first validation at or after each multiple of this many steps (so at most
    # once per eval_interval: a multiple of it keeps an even cadence), all of it at the end; 0 = off
    hellaswag_every: int = 0
    # that subset, evenly spaced (1,000 items: +-1.4 points standard error); 0 = all
    hellaswag_items: int = 1000
    # a local hellaswag_val.jsonl; "" = the canonical file, downloaded once into the cache
    hellaswag_file: str = ""
    chat_loss: str = "assistant"  # chat data: the loss on the assistants' answers and <|end|> only | all (every token)
    # adamw (GPT-2) | muon (Muon for the blocks' 2-D weights, AdamW for the rest)
    optimizer: str = "adamw"
    muon_lr: float = 0.02  # Muon's peak learning rate (the schedule scales it with learning_rate's)
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    schedule: str = "cosine"  # cosine (GPT-2) | wsd (warmup, stable, linear decay: extends to a larger max_steps)
    # wsd: the fraction of max_steps at the end over which the LR decays to min_lr_ratio
    cooldown_frac: float = 0.4
    # Colab units this runtime uses per hour; 0 = throughput.COLAB_UNITS_PER_HOUR
    colab_units_per_hour: float = 0.0
    auto_batch: bool = False  # CUDA: the largest micro-batch that fits, grad_accum_steps keeping the tokens per step

    def validate(self) -> None:
        _check_fields(self)
        if self.optimizer == "muon":
            import torch  # here only: `import gptlib.config` stays free of torch

            if not hasattr(torch.optim, "Muon"):
                raise ConfigError(
                    f"optimizer=muon (the modern recipe) needs torch.optim.Muon, in torch >= 2.9; this is"
                    f" torch {torch.__version__}: upgrade, or use --recipe gpt2 (--set optimizer=adamw)"
                )


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preset: str = "custom"  # the preset this config started from (informational)
    recipe: str = "gpt2"  # the recipe its fields started from (RECIPES); a run resumes with its own
    # the gptlib that trained with it last ("" in a config of 0.1.0 or earlier)
    gptlib_version: str = __version__

    @property
    def tokens_per_step(self) -> int:
        """Tokens one process trains on per optimizer step (a DDP run: times the world size)."""
        return self.train.batch_size * self.train.grad_accum_steps * self.model.block_size

    def validate(self) -> "RunConfig":
        _check_fields(self)
        self.model.validate()
        self.train.validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "RunConfig":
        """Strict: unknown keys are errors, missing keys take today's defaults; ReLU² and softcap are refused."""
        model, train = dict(d.get("model", {})), d.get("train", {})
        wrote = d.get("gptlib_version") or "0.1.0 or earlier"
        versions = f"written by gptlib {wrote}, read by gptlib {__version__}"
        cap = model.pop("logit_softcap", 0)
        if cap or model.get("mlp") == "relu2":
            name, value = ("logit_softcap", cap) if cap else ("mlp", "relu2")
            raise ConfigError(
                f"{source}: model.{name} is {value!r}, an option gptlib no longer has (no gain measured: "
                f"docs/benchmarks.md); {versions}: use the gptlib that trained this run"
            )
        for where, keys, known in (
            (source, d, cls),
            (f"{source}: model", model, ModelConfig),
            (f"{source}: train", train, TrainConfig),
        ):
            names = sorted(f.name for f in fields(known))
            if unknown := set(keys) - set(names):
                raise ConfigError(
                    f"{where}: unknown key(s) {sorted(unknown)} ({versions}: use that gptlib or a newer "
                    f"one, README.md 'Versions and updating'); known: {names}"
                )
        preset, recipe = d.get("preset", "custom"), d.get("recipe", "gpt2")
        gptlib_version = d.get("gptlib_version", "")
        return cls(ModelConfig(**model), TrainConfig(**train), preset, recipe, gptlib_version)

    def updated(self, overrides: dict[str, Any] | list[str] | None) -> "RunConfig":
        """A copy, not validated, with fields set by name (`n_layer` or `model.n_layer`) from a dict or FIELD=VALUE."""
        # a notebook's OVERRIDES = "n_layer=6": one setting (a string has no .items(); list() splits it into letters)
        if isinstance(overrides, str):
            overrides = [overrides]
        if isinstance(overrides, (list, tuple)):
            if bad := [item for item in overrides if "=" not in item]:
                raise ConfigError(f"override {bad[0]!r} is not FIELD=VALUE")
            overrides = dict(item.split("=", 1) for item in overrides)
        sections = {f.name: "model" for f in fields(ModelConfig)}
        sections |= {f.name: "train" for f in fields(TrainConfig)}
        changes: dict[str, dict[str, Any]] = {"model": {}, "train": {}}
        for name, value in (overrides or {}).items():
            section, _, key = name.strip().rpartition(".")  # "n_layer" or "model.n_layer"
            if section not in ("", "model", "train"):
                msg = f"unknown config section {section!r} in {name!r} (use model. or train.)"
                raise ConfigError(msg)
            if key not in sections or section not in ("", sections[key]):
                raise ConfigError(
                    f"unknown config field {name!r}; known fields: {', '.join(sorted(sections))}"
                )
            current = getattr(getattr(self, sections[key]), key)
            changes[sections[key]][key] = _parse_value(key, value, current)
        model = dataclasses.replace(self.model, **changes["model"])
        train = dataclasses.replace(self.train, **changes["train"])
        return dataclasses.replace(self, model=model, train=train)


# The modern recipe's learning rates: published values for the GPU presets, phase1's swept (docs/benchmarks.md).
_PUBLISHED_MODERN = dict(learning_rate=4e-3, muon_lr=0.02, cooldown_frac=0.4)
# The GPT-2 presets' run: ~10B tokens at ~0.5M a step, validated, sampled and scored on HellaSwag every 500 steps.
_GPT2_RUN = dict(
    max_steps=20000,
    warmup_steps=700,
    eval_interval=500,
    eval_batches=40,
    sample_prompts=["The ", "def "],
    sample_tokens=100,
    keep_every=5000,
    hellaswag_every=500,
)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {  # each: the fields it changes from their defaults
    # Tiny Shakespeare, char-level, on a laptop CPU (~0.34M parameters; chosen by measurement: docs/benchmarks.md).
    "phase1": {
        "model": dict(
            vocab_size=65, block_size=64, n_layer=3, n_head=3, n_embd=96, vocab_multiple=1
        ),
        "train": dict(
            batch_size=32,
            grad_accum_steps=1,
            max_steps=1500,
            learning_rate=1e-2,
            min_lr_ratio=0.05,
            warmup_steps=30,
            beta2=0.99,
            eval_interval=500,
            sample_prompts=["ROMEO:", "\n"],
            save_every_minutes=5.0,
            keep_every=500,
        ),
        "modern": dict(learning_rate=1e-2, muon_lr=0.01, cooldown_frac=0.4),
    },
    # Medium model: a few hours on a T4/L4, minutes per 1k steps on an A100.
    "phase2": {
        "model": dict(vocab_size=32768, block_size=512, n_layer=6, n_head=6, n_embd=384),
        "train": dict(
            batch_size=32,
            grad_accum_steps=4,
            max_steps=10000,
            learning_rate=1e-3,
            warmup_steps=500,
            eval_interval=500,
            eval_batches=40,
            sample_prompts=["The ", "def "],
            sample_tokens=100,
            keep_every=2500,
        ),
        "modern": _PUBLISHED_MODERN,
    },
    # GPT-2 Small (124M-class with a 32K vocab): ~0.5M tokens per step, as in GPT-2/3 small.
    "gpt2-small": {
        "model": dict(vocab_size=32768, block_size=1024, n_layer=12, n_head=12, n_embd=768),
        "train": dict(batch_size=16, grad_accum_steps=32, learning_rate=6e-4, **_GPT2_RUN),
        "modern": _PUBLISHED_MODERN,
    },
    # GPT-2 Medium (350M-class): gpt2-small's tokens per step in micro-batches of 8 (an A100 40 GB), a lower LR.
    "gpt2-medium": {
        "model": dict(vocab_size=32768, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
        "train": dict(batch_size=8, grad_accum_steps=64, learning_rate=3e-4, **_GPT2_RUN),
        "modern": _PUBLISHED_MODERN,
    },
    # train --init-from RUN_DIR: the shape comes from that run (placeholders here), a ~10x lower LR.
    "finetune": {
        "model": dict(vocab_size=32768, block_size=1024, n_layer=12, n_head=12, n_embd=768),
        "train": dict(
            batch_size=8,
            grad_accum_steps=4,
            max_steps=1000,
            learning_rate=5e-5,
            warmup_steps=20,
            eval_interval=50,
            sample_tokens=100,
        ),
        "modern": dict(learning_rate=4e-4, muon_lr=2e-3, cooldown_frac=0.4),
    },
}


# A recipe sets model and optimizer fields together (each can be switched back with --set); its LRs are the preset's.
# modern: the NanoGPT speedrun's and nanochat's changes that Qwen3 also has, so the export is exact.
RECIPES: dict[str, dict[str, dict[str, Any]]] = {
    "gpt2": {"model": {}, "train": {}},
    "modern": {
        "model": dict(
            positions="rope",
            norm="rmsnorm",
            qk_norm=True,
            mlp="swiglu",
            tie_embeddings=False,
            zero_init=True,
            bias=False,
        ),
        "train": dict(optimizer="muon", schedule="wsd", weight_decay=0.0),
    },
}


def get_preset(name: str, recipe: str = "gpt2") -> RunConfig:
    for kind, value, known in (("preset", name, PRESETS), ("recipe", recipe, RECIPES)):
        if value not in known:
            raise ConfigError(f"unknown {kind} {value!r}; choose one of {', '.join(known)}")
    p, r = PRESETS[name], RECIPES[recipe]
    model = ModelConfig(**{**p["model"], **r["model"]})
    # the preset's own values for the recipe win
    train = TrainConfig(**{**p["train"], **r["train"], **p.get(recipe, {})})
    return RunConfig(model, train, name, recipe)


def build_config(
    preset: str | RunConfig,
    overrides: dict | list | None = None,
    recipe: str | None = None,
    **explicit,
) -> RunConfig:
    """Preset (or RunConfig) + recipe + `--set` overrides + keyword values (None = not given), validated."""
    cfg = get_preset(preset, recipe or "gpt2") if isinstance(preset, str) else preset
    if recipe not in (None, cfg.recipe):
        raise ConfigError(
            f"recipe={recipe!r} was asked for a RunConfig made with recipe={cfg.recipe!r}; make it "
            f"with get_preset(name, recipe={recipe!r})"
        )
    explicit = {k: v for k, v in explicit.items() if v is not None}
    return cfg.updated(overrides).updated(explicit).validate()


_BOOLS = {
    **dict.fromkeys(("1", "true", "yes", "on"), True),
    **dict.fromkeys(("0", "false", "no", "off"), False),
}


def _parse_value(name: str, value: Any, current: Any) -> Any:
    """A `--set` string as the type of the field's current value; a value that is not a string is taken as is."""
    if not isinstance(value, str) or isinstance(current, str):
        # from code: an integer field takes a whole float (a budget / tokens per step), not 25.5 (a run never done)
        if isinstance(current, int) and not isinstance(current, bool) and isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{name}={value!r}: {name} takes an integer")
            return int(value)
        return value
    v = value.strip()
    try:
        if isinstance(current, bool):
            return _BOOLS[v.lower()]
        if isinstance(current, int):
            if v.lstrip("+-").isdigit():
                return int(v)  # exactly: a float would round a seed above 2**53
            if not (number := float(v)).is_integer():  # 1e3 and 2000.0 are integers too, 2.5 is not
                raise ValueError(v)
            return int(number)
        if isinstance(current, float):
            return float(v)
        # the one list field: strings, in JSON or as Python writes them (['ROMEO:'] in a notebook's OVERRIDES)
        return [str(x) for x in ast.literal_eval(v)] if v.startswith("[") else [value]
    except (ValueError, KeyError, SyntaxError):
        kinds = {bool: "true or false", int: "an integer", float: "a number"}
        kind = kinds.get(type(current), "a list of strings")
        raise ConfigError(f"{name}={value!r}: {name} takes {kind}") from None


# torch's generators take seeds in [0, 2**64), validation's is seed + 10,000; sample and chat take train's rule
SEED_RULE = ("in [0, 2**63)", lambda v: 0 <= v < 2**63)
# What a field must be: a number (not a bool) that passes a test, or one of a few names.
_RULES = {
    **dict.fromkeys(
        "vocab_size block_size n_layer n_head n_embd vocab_multiple rope_theta batch_size grad_accum_steps "
        "max_steps eval_interval eval_batches log_interval learning_rate muon_lr".split(),
        ("a positive number", lambda v: 0 < v < math.inf),
    ),
    **dict.fromkeys(
        "warmup_steps weight_decay grad_clip max_minutes save_every_steps save_every_minutes sample_tokens "
        "keep_every hellaswag_every hellaswag_items colab_units_per_hour".split(),
        (">= 0", lambda v: v >= 0),
    ),
    **dict.fromkeys(
        "dropout beta1 beta2 muon_momentum".split(), ("in [0, 1)", lambda v: 0 <= v < 1)
    ),
    "min_lr_ratio": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "cooldown_frac": ("in (0, 1]", lambda v: 0 < v <= 1),
    "keep_last": (">= 2, so that one checkpoint always survives a bad save", lambda v: v >= 2),
    "seed": SEED_RULE,
}
_CHOICES = {
    "positions": ("learned", "rope"),
    "norm": ("layernorm", "rmsnorm"),
    "mlp": ("gelu", "swiglu"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "compile": ("auto", "on", "off"),
    "chat_loss": ("assistant", "all"),
    "optimizer": ("adamw", "muon"),
    "schedule": ("cosine", "wsd"),
    "recipe": tuple(RECIPES),
}


def _check_fields(config) -> None:
    for f in fields(config):
        v = getattr(config, f.name)
        if f.name in _CHOICES and v not in _CHOICES[f.name]:
            raise ConfigError(f"{f.name}={v!r}: choose one of {', '.join(_CHOICES[f.name])}")
        must, ok = _RULES.get(f.name, ("", None))
        if ok and (isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v)):
            raise ConfigError(f"{f.name}={v!r} must be {must}")
