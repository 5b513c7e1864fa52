import math

import pytest
import torch

from gptlib.config import ModelConfig
from gptlib.model import GPT, KVCache


def tiny(**kw):
    base = dict(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32, vocab_multiple=1)
    base.update(kw)
    return ModelConfig(**base)


def test_shapes_and_initial_loss_is_ln_vocab():
    torch.manual_seed(0)
    cfg = tiny()
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    y = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))  # independent of x: tied embeddings favour y == x
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
    opt = model.configure_optimizer(0.1, 1e-3, (0.9, 0.95), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n == sum(p.numel() for p in model.parameters())
