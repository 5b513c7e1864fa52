import math

import pytest

from gptlib.config import PRESETS, ConfigError, RunConfig, get_preset
from gptlib.model import model_size


def test_presets_have_the_promised_shapes():
    p1 = get_preset("phase1").validate()
    assert model_size(p1.model).params <= 1_050_000  # "at most ~1M parameters"
    p2 = get_preset("phase2").validate()
    assert (
        4 <= p2.model.n_layer <= 6 and 256 <= p2.model.n_embd <= 384 and p2.model.block_size == 512
    )
    g = get_preset("gpt2-small").validate()
    m = g.model
    assert (m.n_layer, m.n_embd, m.n_head, m.block_size, m.vocab_size) == (12, 768, 12, 1024, 32768)


def test_gpt2_small_is_124m_class():
    n = model_size(get_preset("gpt2-small").model).params
    assert 100e6 < n < 130e6, n


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="unknown preset 'tiny'.*phase1"):
        get_preset("tiny")


def test_updated_parses_types_and_rejects_unknown_fields():
    preset = get_preset("phase1")
    cfg = preset.updated(
        [
            "n_layer=6",
            "learning_rate=3e-4",
            "model.dropout=0.1",
            "max_steps=1e3",
            'sample_prompts=["a", "b"]',
            "bias=true",
        ]
    )
    assert cfg.model.n_layer == 6 and cfg.train.learning_rate == 3e-4 and cfg.model.dropout == 0.1
    assert (
        cfg.train.max_steps == 1000
        and cfg.train.sample_prompts == ["a", "b"]
        and cfg.model.bias is True
    )
    assert preset.model.n_layer == 3  # a copy: the preset is unchanged
    # exactly, not via float
    assert preset.updated(["seed=12345678901234567891"]).train.seed == 12345678901234567891
    with pytest.raises(ConfigError, match="unknown config field 'n_layers'"):
        cfg.updated({"n_layers": "3"})
    for name, value, kind in (
        ("n_layer", "three", "an integer"),
        ("max_steps", "2.5", "an integer"),
        ("learning_rate", "fast", "a number"),
        ("bias", "maybe", "true or false"),
    ):
        with pytest.raises(ConfigError) as e:  # the field, the value and the type, in a sentence
            cfg.updated([f"{name}={value}"])
        assert str(e.value) == f"{name}={value!r}: {name} takes {kind}", e.value
    with pytest.raises(ConfigError, match="not FIELD=VALUE"):
        cfg.updated(["n_layer"])
    with pytest.raises(ConfigError, match="unknown config section 'optim'"):
        cfg.updated({"optim.lr": 1})


def test_overrides_given_as_one_string_or_a_tuple():
    """A notebook's OVERRIDES = "n_layer=6" (one setting, not a list of them) or a tuple: notebook 02's train cell
    raised AttributeError: 'str' object has no attribute 'items' (a tuple: 'tuple' object ...); notebook 03's plan
    cell split the string into characters: "override 'n' is not FIELD=VALUE"."""
    import nbformat

    from tests.nbrun import NOTEBOOKS

    preset = get_preset("phase1")
    assert preset.updated("n_layer=6").model.n_layer == 6
    assert preset.updated(("n_layer=6", "dropout=0.1")).model.dropout == 0.1
    with pytest.raises(ConfigError, match=r"n_layer='6, dropout=0.1': n_layer takes an integer"):
        preset.updated("n_layer=6, dropout=0.1")  # two settings in one string: named, not guessed
    cell = next(
        c
        for c in nbformat.read(NOTEBOOKS / "03_phase3_train.ipynb", as_version=4).cells
        if c.cell_type == "code" and "plan_run(" in c.source
    )
    scope = dict(PRESET="phase1", RECIPE="gpt2", TOKEN_BUDGET_M=0.0, DEVICE="cpu", AUTO_BATCH=True)
    exec(cell.source, {**scope, "OVERRIDES": "n_layer=6"}, scope)
    assert scope["overrides"][:2] == ["n_layer=6", "auto_batch=true"], scope["overrides"]


def test_sample_prompts_as_python_writes_a_list():
    """A notebook's OVERRIDES = ["sample_prompts=['ROMEO:', 'JULIET:']"] (a list as Python writes it, in a string in
    double quotes) was refused as "sample_prompts takes a list of strings": only JSON's double quotes were read."""
    preset = get_preset("phase1")
    got = preset.updated(["sample_prompts=['ROMEO:', 'JULIET:']"]).train.sample_prompts
    assert got == ["ROMEO:", "JULIET:"]
    assert preset.updated(['sample_prompts=["a", "\\u00e9"]']).train.sample_prompts == [
        "a",
        "\u00e9",
    ]
    with pytest.raises(ConfigError, match="sample_prompts takes a list of strings"):
        preset.updated(["sample_prompts=['ROMEO:'"])


def test_integer_fields_from_code_take_whole_numbers_only():
    """train(max_steps=budget / tokens_per_step) with 25.5 trained 26 steps and never finished (step == max_steps never
    held); batch_size=8.0 failed in the sampler with a bare TypeError; a seed of 2**64 - 1 crashed at the first
    validation (its seed + 10,000 overflowed)."""
    from gptlib.config import build_config

    with pytest.raises(ConfigError, match=r"max_steps=25\.5: max_steps takes an integer"):
        build_config("phase1", {"max_steps": 25.5})
    cfg = build_config("phase1", {"batch_size": 8.0}, max_steps=30.0)
    assert (cfg.train.batch_size, cfg.train.max_steps) == (8, 30)
    assert type(cfg.train.batch_size) is int and type(cfg.train.max_steps) is int
    with pytest.raises(ConfigError, match=r"seed=18446744073709551615 must be in \[0, 2\*\*63\)"):
        build_config("phase1", seed=2**64 - 1)


def test_a_config_is_frozen():
    """Decided once, then only read (torchtitan's habit): an assignment anywhere is an error, not a silent change."""
    import dataclasses

    cfg = get_preset("phase1")
    for section, name, value in (
        (cfg.model, "vocab_size", 50257),
        (cfg.train, "batch_size", 4),
        (cfg, "preset", "x"),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, name, value)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("n_layer", "0", "n_layer=0 must be a positive number"),
        ("n_head", "5", "n_head=5 does not divide n_embd=96"),
        ("learning_rate", "-1e-3", "learning_rate=-0.001 must be a positive number"),
        ("keep_last", "1", "keep_last=1"),
        ("keep_every", "-500", "keep_every=-500"),
        ("dtype", "int8", "dtype='int8': choose one of"),
    ],
)
def test_invalid_values_are_named(field, value, message):
    cfg = get_preset("phase1").updated({field: value})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        cfg.validate()


def test_from_dict_is_strict_on_unknown_keys_and_lenient_on_missing_ones():
    d = get_preset("phase1").to_dict()
    del d["train"]["keep_last"]  # an older config without a newer field
    cfg = RunConfig.from_dict(d)
    assert cfg.train.keep_last == 2
    d["model"]["n_layerz"] = 3
    with pytest.raises(ConfigError, match=r"model: unknown key\(s\) \['n_layerz'\]"):
        RunConfig.from_dict(d, source="x.json")


def test_padded_vocab():
    cfg = get_preset("gpt2-small").updated({"vocab_size": 50257}).model
    assert cfg.padded_vocab_size == 50304 and cfg.padded_vocab_size % 64 == 0
    assert all(isinstance(PRESETS[p]["model"]["n_layer"], int) for p in PRESETS)
    assert math.isclose(
        get_preset("phase1").train.learning_rate, PRESETS["phase1"]["train"]["learning_rate"]
    )
