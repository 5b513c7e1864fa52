import dataclasses
import math
import warnings

import pytest
import torch

from gptlib.config import ModelConfig, get_preset
from gptlib.model import GPT, KVCache, model_size


def tiny(**kw):
    base = dict(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32, vocab_multiple=1)
    base.update(kw)
    return ModelConfig(**base)


def test_shapes_and_initial_loss_is_ln_vocab():
    torch.manual_seed(0)
    cfg = tiny()
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    # independent of x: tied embeddings favour y == x
    y = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    logits, loss = model(x, y)
    assert logits.shape == (4, cfg.block_size, cfg.vocab_size)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1  # uniform prediction at init
    logits, loss = model(x[:, :5])
    assert logits.shape == (4, 5, cfg.vocab_size) and loss is None


def test_padded_vocab_never_predicts_padding():
    cfg = tiny(vocab_size=65, vocab_multiple=64)
    model = GPT(cfg)
    assert model.lm_head.weight.shape[0] == 128
    x = torch.randint(0, 65, (2, 8))
    logits, loss = model(x, torch.randint(0, 65, (2, 8)))
    assert logits.shape[-1] == 65
    assert abs(loss.item() - math.log(65)) < 0.1


def test_tied_embeddings_and_scaled_residual_init():
    torch.manual_seed(0)
    cfg = tiny(n_layer=8, n_embd=256, n_head=4)
    model = GPT(cfg)
    assert model.transformer.wte.weight.data_ptr() == model.lm_head.weight.data_ptr()
    std_proj = model.transformer.h[0].attn.c_proj.weight.std().item()
    std_fc = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert abs(std_fc - 0.02) < 0.002
    assert abs(std_proj - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.001


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    x = torch.randint(0, 65, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 65  # change the future
    a, _ = model(x)
    b, _ = model(y)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    cfg = tiny()
    model = GPT(cfg).eval()
    x = torch.randint(0, 65, (2, 20))
    full, _ = model(x)
    cache = KVCache(cfg, 2, "cpu", torch.float32)
    pre, _ = model(x[:, :12], cache=cache)  # prefill
    chunk, _ = model(x[:, 12:15], cache=cache)  # a chunk after cached tokens
    steps = [model(x[:, i : i + 1], cache=cache)[0] for i in range(15, 20)]  # one token at a time
    inc = torch.cat([pre, chunk, *steps], dim=1)
    assert torch.allclose(full, inc, atol=1e-5)


def test_too_long_sequence_is_a_clear_error():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="exceeds block_size=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_weight_decay_only_on_2d_params():
    model = GPT(tiny(bias=True))
    from gptlib.config import TrainConfig
    from gptlib.training.step import build_optimizer

    opt = build_optimizer(model, TrainConfig(weight_decay=0.1, learning_rate=1e-3), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n == sum(p.numel() for p in model.parameters())


# --- the one parameter / FLOP count ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["phase1", "phase2", "gpt2-small"])
@pytest.mark.parametrize(
    "recipe,fields",
    [
        ("gpt2", {}),
        ("gpt2", {"bias": True}),
        ("gpt2", {"tie_embeddings": False, "vocab_multiple": 1}),
        ("modern", {}),
        ("modern", {"tie_embeddings": True}),
        ("modern", {"bias": True, "qk_norm": False}),
        ("modern", {"norm": "layernorm", "positions": "learned", "mlp": "gelu"}),
    ],
)
def test_model_size_counts_the_built_model(preset, recipe, fields):
    """model_size(cfg) against the model cfg builds: its parameters as model.parameters() has them, its matmul
    weights read off the built nn.Linear modules (the tied head counted once, as the matmul it is), and the FLOPs
    of those matmuls (6 per weight per token) plus attention's 12*L*C*T; the input embedding is a lookup."""
    cfg = dataclasses.replace(get_preset(preset, recipe).model, **fields)
    with torch.device("meta"):  # the real modules, no memory
        model = GPT(cfg)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    matmul = sum(m.weight.numel() for m in linears)
    got = model_size(cfg)
    assert got.params == sum(p.numel() for p in model.parameters())
    assert got.matmul_params == matmul
    assert got.flops_per_token == 6 * matmul + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def test_the_modern_recipes_untied_embedding_is_no_matmul():
    """gpt2-small: both recipes do the same matmuls per token (SwiGLU's 8C/3 hidden matches GELU's 4C), so the
    same FLOPs, ~774M (issue 26: the modern recipe's was 6 x all parameters, ~925M, and its MFU ~20% high)."""
    gpt2, modern = (model_size(get_preset("gpt2-small", r).model) for r in ("gpt2", "modern"))
    # 12 layers x (4 x 768^2 attention + 2 x 768 x 3,072 MLP) + the 32,768 x 768 head = 110,100,480 matmul weights
    assert (
        gpt2.flops_per_token
        == modern.flops_per_token
        == 6 * 110_100_480 + 12 * 12 * 768 * 1024
        == 773_849_088
    )
    # its own input embedding, no position table, and the QK-norms' gains (2 x 64 per layer)
    assert modern.params - gpt2.params == (32768 - 1024) * 768 + 12 * 2 * 64


# --- RMSNorm: the input's dtype on every torch version ---------------------------------------------------------


@pytest.fixture
def cuda_autocast_policy_on_cpu():
    """CPU autocast given the rule CUDA autocast has for rms_norm from torch 2.12 on (pytorch#188955): the inputs
    cast to fp32 whatever their dtypes. No GPU here; the norm's way around the rule runs for real."""
    key = torch._C.DispatchKey.AutocastCPU

    def fp32_policy(x, shape, weight=None, eps=None):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return torch.ops.aten.rms_norm(
                x.float(), shape, None if weight is None else weight.float(), eps
            )

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("rms_norm", fp32_policy, "AutocastCPU")
    yield
    lib._destroy()


def modern_tiny():
    return dataclasses.replace(
        get_preset("phase1", "modern").model, block_size=32, n_layer=2, n_head=2, n_embd=32
    )


def qk_norm_outputs(model, x):
    """The dtypes the model's QK-norms hand on during a forward of x under CPU autocast bf16."""
    seen = []
    for block in model.transformer.h:
        for norm in (block.attn.q_norm, block.attn.k_norm):
            norm.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, x)
    return seen


def test_rmsnorm_under_autocast_takes_the_fused_path_in_the_inputs_dtype():
    """The QK-norm's bf16 queries and keys meet the fp32 weight: no fallback from the fused kernel (torch warns when it
    falls back), and the output stays bf16."""
    torch.manual_seed(0)
    model = GPT(modern_tiny())
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*[Mm]ismatch dtype.*")
        seen = qk_norm_outputs(model, x)
    assert seen and all(pair == (torch.bfloat16, torch.bfloat16) for pair in seen), seen


def test_rmsnorm_keeps_bf16_under_the_fp32_autocast_rule_of_torch_2_12(cuda_autocast_policy_on_cpu):
    torch.manual_seed(0)
    plain = torch.nn.RMSNorm(8)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain(x).dtype == torch.float32  # the rule in force: nn.RMSNorm hands on fp32
    model = GPT(modern_tiny())
    seen = qk_norm_outputs(model, torch.randint(0, model.config.vocab_size, (2, 16)))
    assert seen and all(pair == (torch.bfloat16, torch.bfloat16) for pair in seen), seen


def test_rmsnorm_in_fp32_is_nn_rmsnorm_bit_for_bit():
    """Same state dict keys, and the same fp32 forward as the model with torch's nn.RMSNorm in every norm."""
    torch.manual_seed(0)
    model = GPT(modern_tiny())
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    keys = list(model.state_dict())
    logits, loss = model(x, x)
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.RMSNorm):
                plain = torch.nn.RMSNorm(child.normalized_shape, eps=child.eps)
                plain.weight = child.weight
                setattr(parent, name, plain)
                swapped += 1
    assert swapped == 2 * 2 + 2 * 2 + 1  # per block ln_1, ln_2, q_norm, k_norm; ln_f
    before_logits, before_loss = model(x, x)
    assert list(model.state_dict()) == keys
    assert torch.equal(logits, before_logits) and torch.equal(loss, before_loss)
