"""Evaluation maths: batched scoring against a one-row-at-a-time brute force, HellaSwag files and
rules, bits per byte, the training-time probe and its plot helper."""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import sys
import urllib.error
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gptlib.config import ConfigError, ModelConfig, get_preset
from gptlib.data.tokenizer import BPETokenizer, CharTokenizer
from gptlib.errors import EvalError
from gptlib.evaluation import hellaswag as hs
from gptlib.evaluation.evaluate import evaluate_bpb, format_table, token_bytes, window_starts
from gptlib.evaluation.hellaswag import pack_batches, score_rows, scored_nll
from gptlib.model import GPT
from gptlib.training.logs import add_hellaswag_axis, hellaswag_figure

from .device_ops import DeviceOps


def tiny_gpt(vocab=50, block=16, seed=0, bias=False) -> GPT:
    torch.manual_seed(seed)
    return GPT(
        ModelConfig(
            vocab_size=vocab,
            block_size=block,
            n_layer=2,
            n_head=2,
            n_embd=32,
            bias=bias,
            vocab_multiple=64,
        )
    ).eval()


def brute_ll(model: GPT, seq, k: int) -> float:
    """Log-likelihood of the last k tokens of seq from one unbatched, unpadded forward."""
    x = torch.tensor([seq[:-1]])
    with torch.no_grad():
        logits, _ = model(x)
    lp = F.log_softmax(logits[0].double(), dim=-1)
    tgt = torch.tensor(seq[1:])
    return float(lp[torch.arange(len(tgt)), tgt][-k:].sum())


def test_pack_batches_budget_and_cover():
    lengths = [5, 17, 3, 17, 9, 1, 30]
    batches = pack_batches(lengths, 34)
    # every row exactly once
    assert sorted(int(i) for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        # a row over budget still gets a batch of its own
        assert len(b) == 1 or len(b) * longest <= 34


@pytest.mark.parametrize("batch_tokens", [1, 40, 10_000])
def test_score_rows_matches_brute_force(batch_tokens):
    m = tiny_gpt(bias=True)
    rng = random.Random(batch_tokens)
    seqs, ks = [], []
    for _ in range(23):
        n = rng.randint(2, 17)  # up to block_size + 1 tokens
        seqs.append([rng.randrange(50) for _ in range(n)])
        ks.append(rng.randint(1, n - 1))
    got = score_rows(m, seqs, ks, "cpu", batch_tokens=batch_tokens)
    want = np.array([brute_ll(m, s, k) for s, k in zip(seqs, ks)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        score_rows(m, [list(range(18))], [3], "cpu")


def test_scoring_never_waits_for_the_device():
    """Scoring rows and windows queues its work without reading a device value back to the host (tests/device_ops.py):
    the scored positions are index tensors made on the host from the known lengths. A boolean mask on the GPU
    made the host wait to count its Trues, once per batch; the results stay those of the brute force above."""
    m = tiny_gpt()
    seqs, ks = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [3] * 17, [4, 5]], [2, 1, 16, 1]
    with DeviceOps() as ops:
        got = score_rows(m, seqs, ks, "cpu", batch_tokens=40)
        nll = scored_nll(m, torch.tensor([seqs[2][:-1]] * 2), torch.tensor([seqs[2][1:]] * 2)).view(
            2, -1
        )
    assert ops.syncs == []
    np.testing.assert_allclose(
        got, [brute_ll(m, s, k) for s, k in zip(seqs, ks)], rtol=1e-5, atol=1e-5
    )
    assert nll.shape == (2, 16) and torch.equal(nll[0], nll[1])
    np.testing.assert_allclose(-nll[0].sum().item(), brute_ll(m, seqs[2], 16), rtol=1e-5)


def test_ending_rows_cover_every_ending_token_once():
    ctx, end = list(range(100, 130)), list(range(10))
    seqs, ks, cut = hs.ending_rows(ctx[:3], end, 16)
    assert (seqs, ks, cut) == ([ctx[:3] + end], [10], False)  # fits: one row, nothing cut
    seqs, ks, cut = hs.ending_rows(ctx, end, 16)
    # cut from the left to block_size + 1 tokens
    assert cut and ks == [10] and seqs == [(ctx + end)[-17:]]
    long_end = list(range(40))  # longer than the window: pieces
    seqs, ks, cut = hs.ending_rows(ctx[:5], long_end, 16)
    assert cut and sum(ks) == 40 and all(len(s) <= 17 for s in seqs)
    scored = [t for s, k in zip(seqs, ks) for t in s[-k:]]
    assert scored == long_end  # each ending token scored once, in order
    pos = 5  # where the piece's first target sits in context + ending
    # each piece's first target sees half a window of context, or all there is
    for s, k in zip(seqs, ks):
        assert len(s) - k >= min(8, pos)
        pos += k


# --- HellaSwag items ---------------------------------------------------------------------------------


def shakespeare_items(text: str, n: int, seed: int = 0) -> list[dict]:
    lines = [ln for ln in text.split("\n") if len(ln) > 12]
    rng = random.Random(seed)
    return [
        {
            "ctx": rng.choice(lines) + " " + rng.choice(lines),
            "endings": [rng.choice(lines) for _ in range(4)],
            "label": rng.randrange(4),
        }
        for _ in range(n)
    ]


def write_jsonl(path, items) -> None:
    path.write_text("".join(json.dumps(it) + "\n" for it in items))


def test_hellaswag_scoring_matches_brute_force(small_text):
    """acc/acc_norm, truncation and skipping, against each ending scored alone with the left cut by hand."""
    text = small_text.read_text()
    tok = CharTokenizer.from_text(text)
    m = tiny_gpt(vocab=tok.vocab_size, block=48, seed=3)
    raw = shakespeare_items(text, 12)
    # short: fits the window, nothing cut
    raw[0].update(ctx="KING", endings=["the end", "a rose", "no", "yes"])
    raw[1]["endings"][2] = "x" * 70  # an ending longer than the window: scored in pieces
    # not encodable
    raw.append({"ctx": "a snowman \u2603", "endings": ["a", "b", "c", "d"], "label": 1})
    items = [hs.Item(ctx=r["ctx"], endings=r["endings"], label=r["label"]) for r in raw]
    res = hs.evaluate_rendered(m, hs.render(items, tok, 48), "cpu", batch_tokens=300)
    assert res["n"] == 12 and res["skipped"] == 1
    sums, truncated = np.zeros((12, 4)), 0
    for i, it in enumerate(items[:12]):
        ctx = tok.encode(it.ctx)
        cut = False
        for e, ending in enumerate(it.endings):
            end = tok.encode(" " + ending)
            if len(end) <= 48:
                toks = (ctx + end)[-49:]
                cut |= len(ctx) + len(end) > 49
                sums[i, e] = brute_ll(m, toks, len(end))
            else:  # the piece rule, each piece alone
                seqs, ks, _ = hs.ending_rows(ctx, end, 48)
                sums[i, e] = sum(brute_ll(m, s, k) for s, k in zip(seqs, ks))
                cut = True
        truncated += cut
    np.testing.assert_allclose(res["sums"], sums, rtol=1e-5, atol=1e-4)
    counts = np.array([[len(tok.encode(" " + e)) for e in it.endings] for it in items[:12]])
    labels = np.array([it.label for it in items[:12]])
    assert res["truncated"] == truncated and 0 < truncated < 12
    assert res["acc"] == pytest.approx(float((sums.argmax(1) == labels).mean()))
    assert res["acc_norm"] == pytest.approx(float(((sums / counts).argmax(1) == labels).mean()))
    # each item right or wrong: the binomial standard error of the accuracy over 12 items
    for k in ("acc", "acc_norm"):
        assert res[f"{k}_se"] == pytest.approx(math.sqrt(res[k] * (1 - res[k]) / 12))


def test_parse_errors_name_line_field_and_value(tmp_path):
    good = {"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 2}
    cases = [
        ("{not json", "line 2 is not valid JSON"),
        (json.dumps([1, 2]), "line 2 is a JSON list"),
        (json.dumps({"ctx": "x", "endings": ["a"] * 4}), "line 2: field 'label' is missing"),
        (json.dumps({**good, "label": 7}), "line 2: field 'label' is 7, expected 0, 1, 2 or 3"),
        (
            json.dumps({**good, "endings": ["a", "b"]}),
            "line 2: field 'endings' is ['a', 'b'], expected a list of 4",
        ),
        (json.dumps({**good, "ctx": ""}), "line 2: field 'ctx' is '', expected a non-empty string"),
        # a cut emoji: an escaped surrogate without its pair, which no tokenizer can take
        (
            json.dumps({**good, "ctx": "The \ud83d man"}),
            "line 2: field 'ctx' holds '\\ud83d', half",
        ),
        (json.dumps({**good, "endings": ["a", "b\udc00", "c", "d"]}), "field 'endings' holds"),
    ]
    for bad, msg in cases:
        p = tmp_path / "hs.jsonl"
        p.write_text(json.dumps(good) + "\n" + bad + "\n")
        with pytest.raises(EvalError) as e:
            hs.load_items(p)
        assert str(p) in str(e.value) and msg in str(e.value), str(e.value)
    p.write_bytes(json.dumps(good).encode() + b"\n\n\xff\xfe\n")
    with pytest.raises(EvalError, match="line 3 is not UTF-8"):
        hs.load_items(p)
    p.write_text("\n")
    with pytest.raises(EvalError, match="no items"):
        hs.load_items(p)
    with pytest.raises(EvalError, match="does not exist"):
        hs.load_items(tmp_path / "missing.jsonl")
    items, info = hs.load_items(_write(tmp_path / "ok.jsonl", [good, {**good, "label": "3"}]))
    assert (
        [it.label for it in items] == [2, 3]
        and info["canonical"] is False
        and len(info["sha256"]) == 64
    )


def _write(path, items):
    write_jsonl(path, items)
    return path


def test_fetch_checks_sha256_and_caches(tmp_path, monkeypatch):
    src = _write(
        tmp_path / "served.jsonl", [{"ctx": "A", "endings": ["a", "b", "c", "d"], "label": 0}]
    )
    monkeypatch.setenv("GPTLIB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hs, "HELLASWAG_URL", src.as_uri())
    with pytest.raises(EvalError) as e:  # the real checksum: this file is not the canonical one
        hs.fetch_hellaswag()
    assert hs.HELLASWAG_SHA256 in str(e.value) and hashlib.sha256(
        src.read_bytes()
    ).hexdigest() in str(e.value)
    assert not (
        tmp_path / "cache" / "hellaswag" / hs.HELLASWAG_FILE
    ).exists()  # nothing unverified is cached
    monkeypatch.setattr(hs, "HELLASWAG_SHA256", hashlib.sha256(src.read_bytes()).hexdigest())
    got = hs.fetch_hellaswag()
    assert got.read_bytes() == src.read_bytes()
    monkeypatch.setattr(hs, "HELLASWAG_URL", "http://127.0.0.1:9/unreachable")
    assert hs.fetch_hellaswag() == got  # from the cache
    got.write_text("corrupted")  # a corrupt cached copy is replaced, not trusted
    with pytest.raises(
        EvalError, match="could not download HellaSwag from http://127.0.0.1:9.*--data FILE"
    ):
        hs.fetch_hellaswag()
    assert not got.exists()


def test_select_is_fixed_and_spread():
    assert hs.select(10, None) == list(range(10)) and hs.select(10, 0) == list(range(10))
    sub = hs.select(10_042, 1000)
    assert (
        len(set(sub)) == 1000 and sub[0] == 0 and sub[-1] > 9_990 and sub == hs.select(10_042, 1000)
    )


# --- bits per byte -------------------------------------------------------------------------------


def test_token_bytes_char_and_bpe(small_text):
    text = small_text.read_text()[:20_000]
    char = CharTokenizer.from_text(text + "é€")
    tb = token_bytes(char)
    assert tb[char.encode("€")[0]] == 3 and tb[char.encode("é")[0]] == 2
    bpe = BPETokenizer.train([text + " café naïve 日本語 €"], vocab_size=400)
    tb = token_bytes(bpe)
    assert tb[bpe.eot_id] == 0
    # multi-byte characters split across tokens
    for s in [
        "First Citizen: café naïve",
        "日本語 € ok",
        "x\u2603y",
    ]:
        assert int(tb[bpe.encode(s)].sum()) == len(s.encode("utf-8"))


def test_bpb_matches_brute_force(small_text):
    text = small_text.read_text()
    bpe = BPETokenizer.train([text], vocab_size=300)
    ids = []
    # documents separated by <|endoftext|>, which carries no bytes
    for doc in text.split("\n\n")[:25]:
        ids += bpe.encode(doc) + [bpe.eot_id]
    val = np.array(ids, dtype=np.uint16)
    m = tiny_gpt(vocab=bpe.vocab_size, block=16, seed=5)
    res = evaluate_bpb(m, bpe, val, "cpu", batch_tokens=50)
    tb = token_bytes(bpe)
    nats = nats_counted = 0.0
    n_bytes, window_bits, window_bytes = 0, [], []
    starts = list(range(0, (len(val) - 1) // 16 * 16, 16))
    for s in starts:
        x = torch.tensor(val[s : s + 16].astype(np.int64))[None]
        y = val[s + 1 : s + 17].astype(np.int64)
        with torch.no_grad():
            logits, _ = m(x)
        nll = F.cross_entropy(logits[0].double(), torch.tensor(y), reduction="none").numpy()
        nats += nll.sum()
        nats_counted += nll[tb[y] > 0].sum()
        n_bytes += int(tb[y].sum())
        window_bits.append(nll[tb[y] > 0].sum() / math.log(2))
        window_bytes.append(int(tb[y].sum()))
    assert (
        res["windows"] == len(starts)
        and res["tokens"] == 16 * len(starts)
        and res["bytes"] == n_bytes
    )
    assert res["bpb"] == pytest.approx(nats_counted / math.log(2) / n_bytes, rel=1e-5)
    assert res["loss"] == pytest.approx(nats / (16 * len(starts)), rel=1e-5)
    # bpb is a ratio of sums over the windows: its standard error by the delta method, n windows
    n, bpb = len(starts), nats_counted / math.log(2) / n_bytes
    resid = [b - bpb * nb for b, nb in zip(window_bits, window_bytes)]
    se = math.sqrt(sum(r * r for r in resid) / (n * (n - 1))) / (n_bytes / n)
    assert res["bpb_se"] == pytest.approx(se, rel=1e-4) and 0 < se < 0.2 * bpb
    sub = evaluate_bpb(m, bpe, val, "cpu", limit=5)
    assert evaluate_bpb(m, bpe, val, "cpu", limit=1)["bpb_se"] is None  # one window: no spread
    assert sub["windows"] == 5 and list(window_starts(len(val), 16, 5)) == [
        starts[i * len(starts) // 5] for i in range(5)
    ]
    with pytest.raises(EvalError, match="fewer than one window"):
        window_starts(10, 16, None)


# --- during training ------------------------------------------------------------------------------


def test_probe_scores_subset_and_full(small_text, tmp_path):
    text = small_text.read_text()
    tok = CharTokenizer.from_text(text)
    m = tiny_gpt(vocab=tok.vocab_size, block=32, seed=1).train()
    items, _ = hs.load_items(_write(tmp_path / "hs.jsonl", shakespeare_items(text, 9)))
    logs = []
    probe = hs.HellaSwagProbe(tok, 32, tmp_path / "hs.jsonl", limit=4, log=logs.append)
    row = hs.metrics_fields(probe.score(m, "cpu"))
    assert (
        set(row) == {"hellaswag_acc", "hellaswag_acc_norm", "hellaswag_n"}
        and row["hellaswag_n"] == 4
    )
    assert m.training  # the probe puts the model back in training mode
    full = probe.score(m, "cpu", full=True)
    direct = hs.evaluate_rendered(m, hs.render(items, tok, 32), "cpu")
    assert (
        full["n"] == 9 and full["acc_norm"] == direct["acc_norm"] and full["acc"] == direct["acc"]
    )
    assert logs == []


def test_eval_rows_append_and_read(tmp_path, small_text):
    from gptlib.evaluation.evaluate import make_row
    from gptlib.fsutil import append_jsonl, read_jsonl
    from gptlib.layout import EVAL_FILE

    tok = CharTokenizer.from_text(small_text.read_text())
    hs_file = _write(tmp_path / "hs.jsonl", shakespeare_items(small_text.read_text(), 3))
    res = hs.HellaSwagProbe(tok, 32, hs_file, limit=None).score(
        tiny_gpt(vocab=tok.vocab_size, block=32), "cpu"
    )
    append_jsonl(tmp_path / EVAL_FILE, make_row("hellaswag", 100, 51_200, res, source="training"))
    with open(tmp_path / EVAL_FILE, "a") as f:
        # a torn last line (killed mid-write) is skipped, not fatal
        f.write('{"task": "bpb", "step": 1')
    (row,) = read_jsonl(tmp_path / EVAL_FILE)
    assert (
        row["task"] == "hellaswag"
        and row["step"] == 100
        and row["tokens_seen"] == 51_200
        and row["n"] == 3
    )
    assert row["source"] == "training" and row["canonical"] is False and "time" in row
    before = (tmp_path / EVAL_FILE).read_bytes()
    append_jsonl(tmp_path / EVAL_FILE, make_row("bpb", 200, None, {"bpb": 2.5}))
    # on a line of its own
    assert [r["task"] for r in read_jsonl(tmp_path / EVAL_FILE)] == [
        "hellaswag",
        "bpb",
    ]
    assert (tmp_path / EVAL_FILE).read_bytes().startswith(before)  # earlier bytes never rewritten


def test_probe_without_network_stays_off(tmp_path, monkeypatch, small_text):
    def no_network(*a, **k):
        raise urllib.error.URLError("no network (test)")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    logs = []
    tok = CharTokenizer.from_text(small_text.read_text())
    monkeypatch.setenv("GPTLIB_CACHE", str(tmp_path))
    probe = hs.HellaSwagProbe(tok, 32, None, log=logs.append)
    assert probe.reason is not None and len(logs) == 1 and "could not download HellaSwag" in logs[0]
    # training's setting, not eval's flag
    assert "(--set hellaswag_file=FILE)" in logs[0] and "--data" not in logs[0]
    assert probe.score(tiny_gpt(vocab=tok.vocab_size, block=32), "cpu") is None and len(logs) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    probe = hs.HellaSwagProbe(tok, 32, bad, log=logs.append)
    assert probe.reason is not None and "line 1 is not valid JSON" in logs[-1]
    unencodable = _write(
        tmp_path / "snow.jsonl", [{"ctx": "\u2603", "endings": ["a"] * 4, "label": 0}]
    )
    assert hs.HellaSwagProbe(tok, 32, unencodable, log=logs.append).reason is not None
    # a notebook's training run: its OVERRIDES (notebooks 02, 03 and 05 pass them to train)
    kernel = SimpleNamespace(get_ipython=lambda: SimpleNamespace(kernel=object()))
    monkeypatch.setitem(sys.modules, "IPython", kernel)
    hs.HellaSwagProbe(tok, 32, None, log=logs.append)
    assert logs[-1].endswith('(OVERRIDES = ["hellaswag_file=FILE"]))'), logs[-1]


def test_config_fields_and_preset():
    assert get_preset("gpt2-small").train.hellaswag_every == 500
    cfg = get_preset("phase1")
    assert cfg.train.hellaswag_every == 0 and cfg.train.hellaswag_items == 1000
    cfg = cfg.updated(["hellaswag_every=100", "hellaswag_file=/x/hs.jsonl"]).validate()
    assert cfg.train.hellaswag_every == 100 and cfg.train.hellaswag_file == "/x/hs.jsonl"
    with pytest.raises(ConfigError, match="hellaswag_items=-1 must be >= 0"):
        cfg.updated({"hellaswag_items": -1}).validate()


def test_plot_helpers(tmp_path):
    from gptlib.training.logs import loss_figure

    rows = [
        {"step": s, "train_loss": 3 - s / 100, "val_loss": 3.1 - s / 100} for s in range(0, 300, 50)
    ]
    fig = loss_figure(rows)
    # nothing logged: nothing drawn
    assert add_hellaswag_axis(fig.axes[0], rows) is None and len(fig.axes) == 1
    for r, a in zip(rows[1:], [0.25, 0.26, 0.27, 0.28, 0.29]):
        r.update(hellaswag_acc_norm=a, hellaswag_n=1000)
    ax2 = add_hellaswag_axis(fig.axes[0], rows)
    assert ax2 is not None and len(fig.axes) == 2 and ax2.get_ylabel() == "HellaSwag acc_norm"
    labels = [t.get_text() for t in ax2.get_legend().get_texts()]
    assert "train" in labels and "HellaSwag acc_norm" in labels
    fig.savefig(tmp_path / "loss.png")
    # loss.png and the live plot draw it when the rows have it
    assert len(loss_figure(rows).axes) == 2
    evals = [
        {"task": "hellaswag", "tokens_seen": t, "acc_norm": a}
        for t, a in [(1e6, 0.25), (2e6, 0.27)]
    ]
    hellaswag_figure(evals).savefig(tmp_path / "hs.png")
    assert (tmp_path / "loss.png").stat().st_size > 0 and (tmp_path / "hs.png").stat().st_size > 0
    table = format_table(
        [
            {
                "task": "hellaswag",
                "step": 5,
                "tokens_seen": 1280,
                "n": 3,
                "acc": 0.5,
                "acc_norm": 0.25,
                "truncated": 0,
                "skipped": 1,
                "seconds": 0.3,
            }
        ]
    )
    assert "acc_norm" in table and "0.2500" in table and "1,280" in table


def test_table_shows_standard_errors_and_says_when_a_difference_is_within_noise():
    """Each figure ± its standard error; the newest two checkpoints compared on each task's first figure: a
    difference under 2 x the combined standard error sqrt(se_a^2 + se_b^2) is within noise, else the better checkpoint
    is named (lower bpb, higher accuracy). Rows without standard errors (eval.jsonl before them) print bare and are
    not compared."""

    def hs_row(step, acc_norm, n):
        se = math.sqrt(acc_norm * (1 - acc_norm) / n)
        row = dict(task="hellaswag", step=step, tokens_seen=step * 10, n=n, truncated=0, skipped=0)
        return row | dict(acc=acc_norm, acc_se=se, acc_norm=acc_norm, acc_norm_se=se)

    def bpb_row(step, bpb, se):
        return dict(task="bpb", step=step, tokens_seen=step * 10, bpb=bpb, bpb_se=se, loss=bpb)

    # 0.30 vs 0.32 on 1,000 items each: 2 x sqrt(2 x .31 x .69 / 1000) = 0.041 > 0.02
    rows = [hs_row(500, 0.30, 1000), hs_row(1000, 0.32, 1000)]
    # step 200's row has no standard error (eval.jsonl before them): shown, never compared
    rows += [bpb_row(500, 2.000, 0.004), bpb_row(1000, 1.980, 0.004), {"task": "bpb", "step": 200}]
    table = format_table(rows)
    assert "0.3200 ± 0.0148" in table and "1.9800 ± 0.0040" in table
    lines = table.splitlines()
    assert (
        "HellaSwag acc_norm, step 1,000 - step 500: +0.0200; 2 x combined standard error 0.0414: "
        "within noise" in lines
    )
    # 2 x sqrt(2) x 0.004 = 0.0113 < 0.02: the lower bits per byte is better
    assert (
        "val bpb, step 1,000 - step 500: -0.0200; 2 x combined standard error 0.0113: step 1,000 is "
        "better" in lines
    )
    # 10,000 items: 2 x SE = 0.013 < 0.02
    big = format_table([hs_row(500, 0.32, 10_000), hs_row(1000, 0.30, 10_000)])
    assert (
        "HellaSwag acc_norm, step 1,000 - step 500: -0.0200; 2 x combined standard error 0.0131: step 500 "
        "is better" in big.splitlines()
    )
    old = [{k: v for k, v in r.items() if not k.endswith("_se")} for r in rows]
    table = format_table(old)
    assert "±" not in table.split("\n± ")[0] and "noise" not in table and "better" not in table
    assert re.search(r"step 1,000 +10,000 +1\.9800 ", table), table


def test_notebook_04s_eval_cell_says_a_dropped_drive_in_one_line_and_goes_on(monkeypatch, capsys):
    """Drive dropped while a task read the run or its data (ENOTCONN, not a hang: a plain OSError, no GptlibError):
    the Evaluate cell showed a traceback and the next task did not run. It is one line, as a task that cannot run."""
    import errno

    import torch

    from gptlib.evaluation import evaluate as ev
    from tests.test_eval_cli import eval_cell

    def fake_run(run_dir, task, checkpoints, device, data, limit, file_option):
        if task == "bpb":
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
        return [{"task": task}]

    monkeypatch.setattr(ev, "evaluate_run", fake_run)
    monkeypatch.setattr(ev, "format_table", lambda rows: "")
    rows = eval_cell(capsys, run_dir="r", EVAL_TASKS="bpb, hellaswag", device=torch.device("cpu"))
    assert rows == [{"task": "hellaswag"}]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "bpb: not evaluated: [Errno 107] Transport endpoint is not connected", out


def test_notebook_04s_eval_cell_sizes_hellaswag_by_device_and_reports_a_task_that_cannot_run(
    monkeypatch, capsys
):
    """Notebook 04's eval cell: -1 items means all on a GPU and 1,000 on a CPU; a failing task is one line and the
    next task still runs."""
    import torch

    from gptlib.errors import EvalError
    from gptlib.evaluation import evaluate as ev
    from tests.test_eval_cli import eval_cell

    calls = []

    def fake_run(run_dir, task, checkpoints, device, data, limit, file_option):
        calls.append((task, device, limit))
        if task == "hellaswag":
            raise EvalError("hellaswag_val.jsonl: not found")
        return [{"task": task}]

    monkeypatch.setattr(ev, "evaluate_run", fake_run)
    monkeypatch.setattr(ev, "format_table", lambda rows: "")
    rows = eval_cell(capsys, run_dir="r", EVAL_TASKS="hellaswag, bpb", device=torch.device("cpu"))
    assert rows == [{"task": "bpb"}]
    assert (
        capsys.readouterr().out.splitlines()[0]
        == "hellaswag: not evaluated: hellaswag_val.jsonl: not found"
    )
    assert calls == [("hellaswag", "cpu", 1000), ("bpb", "cpu", 1000)]
    calls.clear()
    eval_cell(
        capsys, run_dir="r", EVAL_TASKS="hellaswag", device=torch.device("cuda"), BPB_WINDOWS=0
    )
    assert calls == [("hellaswag", "cuda", 0)]  # all items on a GPU
