"""The modern recipe (--recipe modern): its model parts, Muon + AdamW, the WSD schedule, exact resume after a kill,
and the refusals (a model keeps its recipe; torch without Muon)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from gptlib.checkpoint.format import load_model_weights
from gptlib.config import RECIPES, build_config, get_preset
from gptlib.errors import ConfigError
from gptlib.model import GPT, KVCache
from gptlib.training.logs import read_metrics
from gptlib.training.loop import train
from gptlib.training.resume import StartOptions
from gptlib.training.start import schedule_change
from gptlib.training.step import (
    MuonAdamW,
    StepTimer,
    build_optimizer,
    lr_at,
    set_lr,
    slow_muon_note,
    train_step,
)
from tests import faulty
from tests.conftest import REPO, TINY, newest_checkpoint
from tests.test_resume import one_thread  # noqa: F401 (fixture: one thread, as the subprocesses)

MAX_STEPS = 20
SETTINGS = TINY + ["dropout=0.1", "save_every_steps=5", "keep_last=2"]


def modern(**fields):
    return get_preset("phase1", "modern").updated(
        {**dict(block_size=32, n_layer=2, n_head=2, n_embd=32), **fields}
    )


def run(data, run_dir, recipe="modern", settings=SETTINGS, max_steps=MAX_STEPS, **kw):
    logs = []
    r = train(
        data,
        run_dir,
        "phase1",
        settings,
        max_steps=max_steps,
        device="cpu",
        progress=False,
        recipe=recipe,
        log=logs.append,
        **kw,
    )
    return r, "\n".join(logs)


def curve(run_dir) -> dict[int, tuple]:
    return {r["step"]: (r["train_loss"], r.get("val_loss"), r["lr"]) for r in read_metrics(run_dir)}


# --- the model ------------------------------------------------------------------------------


def test_gpt2_recipe_is_the_default_and_changes_nothing():
    """Every recipe field at its default is the gpt2 recipe: a config saved before the fields existed loads as it."""
    assert RECIPES["gpt2"] == {"model": {}, "train": {}}
    cfg = get_preset("phase1")
    assert cfg.recipe == "gpt2" and cfg.model.positions == "learned" and cfg.model.tie_embeddings
    assert cfg.train.optimizer == "adamw" and cfg.train.schedule == "cosine"
    old = cfg.to_dict()
    for k in ("positions", "norm", "qk_norm", "mlp", "tie_embeddings", "zero_init", "rope_theta"):
        del old["model"][k]
    for k in ("optimizer", "muon_lr", "muon_momentum", "schedule", "cooldown_frac"):
        del old["train"][k]
    del old["recipe"]
    assert type(cfg).from_dict(old) == cfg
    m = GPT(cfg.model)
    assert {"transformer.wpe.weight", "transformer.h.0.ln_1.bias"} <= set(
        m.state_dict()
    ) or not cfg.model.bias
    assert m.lm_head.weight is m.transformer.wte.weight


def test_modern_model_parts():
    cfg = modern().validate()
    m = GPT(cfg.model)
    sd = m.state_dict()
    # rotary tables are derived, not saved
    assert "transformer.wpe.weight" not in sd and "rope_cos" not in sd
    assert isinstance(m.transformer.h[0].ln_1, torch.nn.RMSNorm) and hasattr(
        m.transformer.h[0].attn, "q_norm"
    )
    assert m.lm_head.weight is not m.transformer.wte.weight
    # gate + up
    assert sd["transformer.h.0.mlp.c_fc.weight"].shape == (
        2 * cfg.model.mlp_hidden,
        32,
    )
    for name in (
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.1.mlp.c_proj.weight",
        "lm_head.weight",
    ):
        assert not sd[name].any(), f"{name} is not zero-initialised"
    x = torch.randint(0, 65, (2, 32))
    logits, loss = m(x, x)
    assert logits.shape == (2, 32, 65)
    # a zero head: uniform
    assert loss.item() == pytest.approx(torch.log(torch.tensor(65.0)).item(), abs=1e-4)


def test_modern_kv_cache_decodes_as_the_full_forward():
    """Rotary positions past the prompt: prefill + one token at a time (batch 2) gives the full forward's logits."""
    torch.manual_seed(0)
    cfg = modern(zero_init=False).validate()
    m = GPT(cfg.model).eval()
    x = torch.randint(0, 65, (2, 20))
    with torch.no_grad():
        full = m(x)[0]
        cache = KVCache(cfg.model, 2, "cpu", torch.float32)
        # a prefill, then one token at a time
        chunks = [(0, 12)] + [(t, t + 1) for t in range(12, 20)]
        steps = [m.head(m.hidden_states(x[:, lo:hi], cache)) for lo, hi in chunks]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


# --- the optimizer and the schedule -----------------------------------------------------------


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    cfg = modern().validate()
    m = GPT(cfg.model)
    opt = build_optimizer(m, cfg.train, "cpu")
    assert isinstance(opt, MuonAdamW) and isinstance(opt.muon, torch.optim.Muon)
    names = {id(p): n for n, p in m.named_parameters()}
    muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert muon == {
        n for n, p in m.named_parameters() if p.dim() == 2 and n.startswith("transformer.h.")
    }
    assert {"transformer.wte.weight", "lm_head.weight", "transformer.ln_f.weight"} <= adamw
    assert not muon & adamw and len(muon | adamw) == len(list(m.parameters()))
    set_lr(opt, 1e-3)
    assert {g["lr"] for g in opt.adamw.param_groups} == {1e-3}
    muon_lr = 1e-3 * cfg.train.muon_lr / cfg.train.learning_rate
    assert [g["lr"] for g in opt.muon.param_groups] == [pytest.approx(muon_lr)]


def test_muon_adamw_steps_under_an_fp16_grad_scaler():
    """GradScaler (fp16 on a T4) unscales, skips a step with inf gradients and steps both optimizers otherwise."""
    torch.manual_seed(0)
    cfg = modern(zero_init=False).validate()
    m = GPT(cfg.model)
    opt = build_optimizer(m, cfg.train, "cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    x = torch.randint(0, 65, (4, 32))

    class Batches:
        def next_batch(self):
            return x, x

    def step():
        train_step(
            m,
            opt,
            scaler,
            Batches(),
            accum=1,
            grad_clip=1.0,
            autocast=contextlib.nullcontext(),
            timer=StepTimer("cpu"),
        )

    first = next(m.parameters())
    # an overflowed gradient
    hook = first.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    step()
    hook.remove()
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters()), (
        "a step with inf gradients was taken"
    )
    assert scaler.get_scale() == 2.0**9
    step()
    moved = {n for n, p in m.named_parameters() if not torch.equal(before[n], p)}
    assert "transformer.h.0.attn.c_attn.weight" in moved and "transformer.wte.weight" in moved
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("recipe", ["gpt2", "modern"])
def test_a_resume_takes_the_optimizers_device_flags_from_this_device(
    char_data, tmp_path, monkeypatch, recipe
):
    """Issue 26.1: torch's load_state_dict took `fused` (and foreach, capturable) from the checkpoint. A CPU run's
    checkpoint (fused=False) resumed where AdamW is fused (a GPU: the device type build_optimizer is given decides;
    CPU fused AdamW stands in) under an fp16 GradScaler: the gpt2 recipe's first step raised "Expected grad_scale and
    found_inf to be None" (the scaler saw fused at __init__), the modern recipe's AdamW half ran unfused. And the
    reverse: a fused run's checkpoint resumed where AdamW is not fused must not come back fused."""
    from gptlib.training import run as gsetup

    real, made = gsetup.build_optimizer, []

    def optimizer_as_on(device_type):
        def build(model, tc, dev):  # "meta": resume's shape check, left as it is
            made.append(real(model, tc, device_type if dev == "cpu" else dev))
            return made[-1]

        monkeypatch.setattr(gsetup, "build_optimizer", build)

    def fused():
        opt = made[-1].adamw if isinstance(made[-1], MuonAdamW) else made[-1]
        return {g["fused"] for g in opt.param_groups}

    fp16 = SETTINGS + ["dtype=float16"]  # the GradScaler on ("cpu")
    for first, then in (("cpu", "cuda"), ("cuda", "cpu")):
        run_dir = tmp_path / f"made-on-{first}"
        optimizer_as_on(first)
        run(char_data, run_dir, recipe, fp16, max_steps=10)
        assert fused() == {first == "cuda"}
        optimizer_as_on(then)
        r, out = run(char_data, run_dir, recipe, fp16, max_steps=15)
        assert r.resumed_from == 10 and r.step == 15, out
        assert fused() == {then == "cuda"}, f"resumed where fused is {then == 'cuda'}"
        assert all(
            torch.isfinite(p).all()
            for p in load_model_weights(newest_checkpoint(run_dir).path).values()
        )


def test_wsd_holds_the_peak_then_decays_linearly():
    tc = get_preset("phase1", "modern").train  # 1,500 steps, warmup 30, cooldown over the last 40%
    peak, low = tc.learning_rate, tc.learning_rate * tc.min_lr_ratio
    assert lr_at(0, tc) == pytest.approx(peak / 30)
    assert lr_at(30, tc) == lr_at(600, tc) == lr_at(900, tc) == pytest.approx(peak)
    assert lr_at(1200, tc) == pytest.approx((peak + low) / 2)
    assert lr_at(1500, tc) == pytest.approx(low)
    longer = tc.__class__(**{**tc.__dict__, "max_steps": 3000})
    # before the cooldown max_steps does not matter
    assert all(lr_at(s, longer) == lr_at(s, tc) for s in range(900))


def test_schedule_change_says_what_a_larger_max_steps_does():
    wsd = get_preset("phase1", "modern").train
    cos = get_preset("phase1").train
    longer = {"max_steps": 3000}
    assert schedule_change(wsd, _with(wsd, **longer), 600).endswith(
        "at step 600 stays 0.01: the run goes on unchanged"
    )
    assert " at step 1,200 goes 0.00525 -> 0.01" in schedule_change(wsd, _with(wsd, **longer), 1200)
    note = schedule_change(cos, _with(cos, **longer), 600)
    assert (
        note.startswith("max_steps 1,500 -> 3,000: the LR at step 600 goes ")
        and "unchanged" not in note
    )
    assert schedule_change(cos, cos, 600) is None


def _with(tc, **fields):
    return tc.__class__(**{**tc.__dict__, **fields})


# --- training, resume and refusals -------------------------------------------------------------


@pytest.fixture(scope="module")
def modern_reference(char_data, tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("modern") / "run"
    r, out = run(char_data, d)
    assert r.step == MAX_STEPS and r.resumed_from is None, out
    return d


def test_modern_sigkill_mid_step_then_resume_is_exact(char_data, modern_reference, tmp_path):
    """Muon's and AdamW's states are in the checkpoint: killed mid-step, the resumed run's losses and weights are
    the uninterrupted run's, bit for bit; re-run without --recipe, the run keeps its own."""
    run_dir = tmp_path / "run"
    cmd = faulty.gptlib_cmd(
        "kill:mid_step@13",
        "train",
        "--data",
        char_data,
        "--run-dir",
        run_dir,
        "--preset",
        "phase1",
        "--recipe",
        "modern",
        "--max-steps",
        MAX_STEPS,
        "--device",
        "cpu",
        "--quiet",
    )
    for s in SETTINGS:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    r, out = run(char_data, run_dir, recipe=None)
    assert r.resumed_from in (5, 10) and "recipe: modern (the resumed run's own)" in out, out
    assert curve(run_dir) == curve(modern_reference)
    a = load_model_weights(newest_checkpoint(modern_reference).path)
    b = load_model_weights(newest_checkpoint(run_dir).path)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_keeps_its_recipe(char_data, modern_reference, tmp_path):
    """A modern run resumed with --recipe gpt2 is refused naming both, and nothing in it changes."""
    run_dir = tmp_path / "run"
    shutil.copytree(modern_reference, run_dir)
    # but for its lease: taken by the refused call, then marked released (never deleted: issue 44)
    before = {
        p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != "lease.json"
    }
    with pytest.raises(
        ConfigError,
        match="trained with recipe modern but this call asks for gpt2; .*: drop --recipe to go on with modern",
    ):
        run(char_data, run_dir, recipe="gpt2", max_steps=MAX_STEPS + 5)
    # in a notebook (03 reopened, its RECIPE dropdown back at gpt2): the advice is the notebook's own setting
    import gptlib.training.start as start

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(start, "in_notebook", lambda: True)
        with pytest.raises(
            ConfigError, match='its layers differ\\): set RECIPE = "modern", or use a new'
        ):
            run(char_data, run_dir, recipe="gpt2", max_steps=MAX_STEPS + 5)
    after = {
        p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != "lease.json"
    }
    assert after == before
    with pytest.raises(
        ConfigError, match="optimizer='muon' but this call asks for optimizer='adamw'"
    ):
        run(char_data, run_dir, settings=SETTINGS + ["optimizer=adamw"], max_steps=MAX_STEPS + 5)


def test_a_muon_run_on_a_cpu_that_emulates_bf16_says_what_it_costs(
    char_data, tmp_path, monkeypatch
):
    """torch.optim.Muon computes in bf16: on an x86 CPU without AVX-512 the run says once that its steps are slow and
    what the alternative costs; an AVX-512 CPU, a GPU or the AdamW optimizer get no note."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    _, out = run(char_data, tmp_path / "run", max_steps=2)
    notes = [line for line in out.splitlines() if line.startswith("note: torch.optim.Muon")]
    assert (
        len(notes) == 1 and "(AVX2, no AVX-512)" in notes[0] and "--set optimizer=adamw" in notes[0]
    ), out
    tc = modern().train
    assert slow_muon_note(tc, "cuda") is None
    assert slow_muon_note(get_preset("phase1", "gpt2").train, "cpu") is None
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert slow_muon_note(tc, "cpu") is None


def test_wsd_run_extends_exactly_from_its_stable_phase(char_data, tmp_path):
    """Planned for 20 steps, stopped at 10 (stable phase), resumed with max_steps 40: the same losses as a run
    planned for 40 steps from the start."""
    settings = SETTINGS + ["save_every_steps=10"]
    planned, _ = run(char_data, tmp_path / "planned", settings=settings, max_steps=40)
    short = tmp_path / "short"
    run(char_data, short, settings=settings, max_steps=20)
    # the run as it was at step 10 of a 20-step plan (stable until step 12): its later checkpoint removed
    shutil.rmtree(short / "checkpoints" / "step_0000020")
    r, out = run(char_data, short, settings=settings, max_steps=40)
    assert r.resumed_from == 10 and "max_steps 20 -> 40: the LR at step 10 stays" in out, out
    a, b = curve(tmp_path / "planned"), curve(short)
    assert planned.step == r.step == 40
    assert all(a[s] == b[s] for s in range(1, 41)), [
        (s, a[s], b[s]) for s in range(1, 41) if a[s] != b[s]
    ][:3]


def test_init_from_takes_the_base_recipe_and_refuses_another(char_data, modern_reference, tmp_path):
    with pytest.raises(
        ConfigError,
        match="--init-from base was trained with recipe modern but this call asks for gpt2",
    ):
        run(
            char_data,
            tmp_path / "ft1",
            recipe="gpt2",
            options=StartOptions(init_from=str(modern_reference)),
            max_steps=3,
        )
    r, out = run(
        char_data,
        tmp_path / "ft2",
        recipe=None,
        options=StartOptions(init_from=str(modern_reference)),
        max_steps=3,
    )
    assert r.step == 3 and "recipe: modern (the --init-from base's own)" in out, out


def test_bad_recipe_input_is_one_line(monkeypatch, tmp_path, char_data):
    with pytest.raises(ConfigError, match="unknown recipe 'new'; choose one of gpt2, modern"):
        build_config("phase1", recipe="new")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptlib",
            "train",
            "--data",
            str(char_data),
            "--run-dir",
            str(tmp_path / "r"),
            "--recipe",
            "new",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert (
        p.returncode == 2 and "invalid choice: 'new'" in p.stderr and not (tmp_path / "r").exists()
    )
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(
        ConfigError, match=r"needs torch.optim.Muon, in torch >= 2.9; this is torch"
    ):
        build_config("phase1", recipe="modern")
    build_config("phase1", recipe="gpt2")  # the gpt2 recipe needs no Muon


DDP_WORKER = r"""
import json, os, sys
from gptlib.training import run as setup
from gptlib.training.loop import train

made = []
orig = setup.build_optimizer
setup.build_optimizer = lambda *a, **k: made.append(orig(*a, **k)) or made[-1]
r = train(sys.argv[1], sys.argv[2], "phase1", overrides=json.loads(sys.argv[4]), device="cpu", progress=False,
          recipe="modern")
with open(os.path.join(sys.argv[3], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"step": r.step, "kind": type(made[-1]).__name__,
               "weights": [p.detach().double().sum().item() for g in made[-1].param_groups for p in g["params"]]}, f)
"""


def test_modern_recipe_under_torchrun_ddp(tmp_path, char_data):
    """2 ranks (gloo): Muon steps on the all-reduced gradients, so both ranks hold the same weights."""
    worker = tmp_path / "worker.py"
    worker.write_text(DDP_WORKER)
    overrides = TINY + [
        "batch_size=4",
        "grad_accum_steps=2",
        "eval_interval=3",
        "max_steps=3",
        "sample_prompts=[]",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(worker),
        str(char_data),
        str(tmp_path / "run"),
        str(tmp_path),
        json.dumps(overrides),
    ]
    p = subprocess.run(
        cmd,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["step"] == r1["step"] == 3 and r0["kind"] == "MuonAdamW"
    assert r0["weights"] == r1["weights"]


# --- downstream: engine, export, import -------------------------------------------------------------


def test_engine_generates_with_the_modern_model(modern_reference):
    """The KV-cached engine (batch 2, past the prompt) gives the greedy tokens of a full forward at every step."""
    from gptlib.inference.engine import Engine, SamplingConfig
    from gptlib.inference.loading import load_run

    ld = load_run(modern_reference)
    ld.model.eval()
    eng = Engine(ld.model, ld.tokenizer)
    prompts = [ld.tokenizer.encode("ROMEO:"), ld.tokenizer.encode("Thou art")]
    got, _ = eng.generate_ids(prompts, SamplingConfig(max_new_tokens=12, temperature=0.0))
    for prompt, out in zip(prompts, got):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                ids.append(int(ld.model(torch.tensor([ids]))[0][0, -1].argmax()))
        assert list(out) == ids[len(prompt) :]


@pytest.mark.parametrize("qk_norm", [True, False])
def test_export_is_a_native_transformers_model_and_imports_back(char_data, tmp_path, qk_norm):
    """export-hf writes Qwen3 (Llama without QK-norm): transformers loads it without trust_remote_code, its greedy
    tokens are gptlib's; import-hf reads it back with equal logits."""
    transformers = pytest.importorskip("transformers")
    from gptlib.inference.engine import Engine, SamplingConfig
    from gptlib.inference.export import export_hf
    from gptlib.inference.hf_import import import_hf
    from gptlib.inference.loading import load_run

    run_dir = tmp_path / "run"
    run(char_data, run_dir, settings=SETTINGS + [f"qk_norm={qk_norm}", "dropout=0"], max_steps=6)
    out = export_hf(run_dir, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("qwen3" if qk_norm else "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ld = load_run(run_dir)
    ld.model.eval()
    prompt = ld.tokenizer.encode("ROMEO:")
    greedy = SamplingConfig(max_new_tokens=16, temperature=0.0)
    ours = Engine(ld.model, ld.tokenizer).generate_ids([prompt], greedy)[0][0]
    theirs = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    assert list(ours) == theirs
    back = load_run(import_hf(out, tmp_path / "imported", log=lambda m: None))
    back.model.eval()
    assert back.config.recipe == "modern" and back.config.model.qk_norm == qk_norm
    x = torch.tensor([prompt * 3])
    with torch.no_grad():
        torch.testing.assert_close(back.model(x)[0], ld.model(x)[0], rtol=1e-5, atol=1e-5)


def test_export_refuses_a_part_no_native_architecture_has(char_data, tmp_path):
    from gptlib.errors import ExportError
    from gptlib.inference.export import export_hf

    run_dir = tmp_path / "run"
    run(char_data, run_dir, settings=SETTINGS + ["mlp=gelu", "bias=true"], max_steps=2)
    with pytest.raises(
        ExportError,
        match=r"mlp='gelu', bias=True, which no native Hugging Face "
        r"architecture has \(the nearest, Qwen3/Llama, needs mlp='swiglu', bias=False",
    ):
        export_hf(run_dir, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_notebook_03s_plan_says_what_each_recipe_needs():
    """plan_run's estimate: the modern recipe's tokens are the measured fraction of the gpt2 recipe's, and on a GPU
    with a known peak so are its hours and Colab units."""
    from gptlib.training.throughput import (
        BENCHMARKS_PAGE,
        COLAB_UNITS_PER_HOUR,
        MODERN_TOKEN_FRACTION,
        DevicePeak,
        plan_run,
        recipe_estimate,
    )

    a100 = DevicePeak("A100", 312e12, "", COLAB_UNITS_PER_HOUR["A100 40GB"])
    line = recipe_estimate(get_preset("gpt2-small"), 2_000_000_000, a100)
    gpt2_units, modern_units = (
        float(u) for u in __import__("re").findall(r"~([\d.]+) Colab units", line)
    )
    assert modern_units == pytest.approx(gpt2_units * MODERN_TOKEN_FRACTION, abs=1)  # both rounded
    assert "2B tokens" in line and f"small BPE proxy, {BENCHMARKS_PAGE}" in line
    assert BENCHMARKS_PAGE == "https://github.com/gptlib/gptlib/blob/main/docs/benchmarks.md"
    assert "benchmarks/results" not in line  # a file a Colab user does not have
    plan = plan_run("gpt2-small", [], tokens=1e9, device="cpu", recipe="modern")
    assert "(modern recipe)" in plan.summary and "recipes: " in plan.summary


# --- downstream: notebook 04's and 05's tools --------------------------------------------------


def test_evaluation_comparison_and_playground_take_the_modern_model(
    modern_reference, small_text, char_data
):
    """HellaSwag (packed, padded rows) and bits per byte score the modern model as one unbatched forward does;
    checkpoint comparison and the Playground generate with it."""
    pytest.importorskip("ipywidgets")
    import numpy as np
    import torch.nn.functional as F

    from gptlib.data.shards import read_meta
    from gptlib.evaluation import hellaswag as hs
    from gptlib.evaluation.evaluate import evaluate_bpb, window_starts
    from gptlib.inference.engine import SamplingConfig
    from gptlib.inference.loading import load_run
    from gptlib.widgets import Playground
    from tests.test_evaluate import brute_ll, shakespeare_items
    from tests.tokenize_kit import split_tokens

    ld = load_run(modern_reference)
    model, tok, block = ld.model.eval(), ld.tokenizer, ld.config.model.block_size
    items = [hs.Item(**r) for r in shakespeare_items(small_text.read_text(), 6)]
    res = hs.evaluate_rendered(model, hs.render(items, tok, block), "cpu", batch_tokens=200)

    def brute_sum(
        ctx: str, ending: str
    ) -> float:  # each row (an ending longer than the window: its pieces) alone
        rows, ks, _ = hs.ending_rows(tok.encode(ctx), tok.encode(" " + ending), block)
        return sum(brute_ll(model, row, k) for row, k in zip(rows, ks))

    sums = [[brute_sum(it.ctx, e) for e in it.endings] for it in items]
    np.testing.assert_allclose(res["sums"], sums, rtol=1e-5, atol=1e-4)

    val = split_tokens(read_meta(char_data), "val")
    bpb = evaluate_bpb(model, tok, val, "cpu", limit=4)
    nll = []
    for s in window_starts(len(val), block, 4):
        x, y = (torch.tensor(val[s + i : s + i + block].astype(np.int64))[None] for i in (0, 1))
        with torch.no_grad():
            nll.append(F.cross_entropy(model(x)[0][0].double(), y[0], reduction="sum").item())
    assert bpb["windows"] == 4 and bpb["loss"] == pytest.approx(sum(nll) / (4 * block), rel=1e-5)

    from gptlib.inference.engine import Engine
    from gptlib.inference.loading import checkpoint_table

    # notebook 04's comparison: each checkpoint
    steps = [r["step"] for r in checkpoint_table(modern_reference)]
    texts = {
        Engine.from_run(modern_reference, s).generate("ROMEO:", SamplingConfig(10, seed=3))[0].text
        for s in steps
    }
    assert len(steps) >= 2 and len(texts) > 1  # same seed, different weights

    pg = Playground(modern_reference, prompt="ROMEO:")
    pg.max_tokens.value, pg.temperature.value = 12, 0.0
    ids = tok.encode("ROMEO:")
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    assert list(pg.generate().token_ids) == ids[len(tok.encode("ROMEO:")) :]


def test_chat_finetune_from_a_modern_base_then_the_chatbox(tmp_path):
    """Notebook 05 with a modern base: the chat data tokenized with the base's tokenizer, fine-tuned with
    --init-from (the base's recipe, Muon and WSD), its loss falls, and the ChatBox answers with it."""
    pytest.importorskip("ipywidgets")
    from gptlib.data.prepare import prepare
    from gptlib.widgets import ChatBox
    from tests.test_finetune import SMALL, conversation, question

    (tmp_path / "base.txt").write_text(
        "\n".join(
            f"{question(n, w)} {w}"
            for n in "ann bob cy".split()
            for w in "apple river stone cloud".split()
        )
        * 40
    )
    prepare([tmp_path / "base.txt"], tmp_path / "base_data", vocab_size=300, verbose=False)
    base = tmp_path / "base"
    small = [f"{k}={v}" for k, v in SMALL.items()]
    small += [
        "block_size=64",
        "batch_size=16",
        "sample_tokens=0",
        "eval_interval=20",
        "eval_batches=2",
        "save_every_minutes=0",
    ]
    train(
        tmp_path / "base_data",
        base,
        "phase1",
        small,
        max_steps=20,
        recipe="modern",
        device="cpu",
        progress=False,
        log=lambda s: None,
    )
    with open(tmp_path / "chat.jsonl", "w") as f:
        for n in "ann bob cy dee".split():
            for w in "apple river stone cloud tiger lamp green seven".split():
                f.write(json.dumps(conversation(n, w)) + "\n")
    prepare(
        [tmp_path / "chat.jsonl"],
        tmp_path / "chat_data",
        tokenizer_from=base,
        format="chat",
        verbose=False,
    )
    logs = []
    r = train(
        tmp_path / "chat_data",
        tmp_path / "sft",
        "finetune",
        small + ["eval_interval=10", "warmup_steps=2"],
        max_steps=40,
        device="cpu",
        compile="off",
        progress=False,
        log=logs.append,
        options=StartOptions(init_from=str(base)),
    )
    assert "recipe: modern (the --init-from base's own)" in "\n".join(logs)
    vals = [row["val_loss"] for row in r.history if row.get("val_loss") is not None]
    assert len(vals) == 4 and vals[-1] < vals[0], vals
    box = ChatBox(tmp_path / "sft")
    box.temperature.value, box.max_tokens.value = 0.0, 6
    reply = box.send(question("ann", "apple"))
    assert (
        box.turns == [("user", question("ann", "apple")), ("assistant", reply)]
        and reply is not None
    )
