"""Generation with a KV cache. Prompts of different lengths share one cache without padding (as Meta's Llama code):
all rows are prefilled up to the shortest prompt, then a row still reading its prompt is fed its own next token.
A full cache keeps its newest half (a context shift). Above the Engine: the sampling settings, the next token
drawn from a batch of logits on the device, and what a generation returns."""

from __future__ import annotations

import contextlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from gptlib.config import SEED_RULE
from gptlib.errors import GenerationError
from gptlib.inference.loading import load_run
from gptlib.model import GPT, KVCache


@dataclass
class SamplingConfig:
    # tokens generated per prompt (a stop string or end-of-text may end it earlier)
    max_new_tokens: int = 200
    temperature: float = 0.8  # divides the logits; 0 = greedy (argmax), higher = more random
    top_k: int | None = None  # sample only among the k most likely tokens; None or 0 = no limit
    # nucleus: the fewest tokens whose probability sums to >= top_p; None or 1 = off
    top_p: float | None = None
    # > 1 makes tokens already in the context less likely (CTRL); 1 = off
    repetition_penalty: float = 1.0
    # a sequence ends when its text contains one of these (cut off)
    stop: list[str] = field(default_factory=list)
    # end a sequence at the tokenizer's end-of-text token (BPE), if it has one
    stop_at_eot: bool = True
    # fixes the sampling RNG: same seed, weights and settings -> same text; None = random
    seed: int | None = None

    def validate(self) -> "SamplingConfig":
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 0")
        if not self.temperature >= 0:
            raise GenerationError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            msg = f"top_k={self.top_k!r} must be a positive integer (or None/0 for no limit)"
            raise GenerationError(msg)
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p={self.top_p!r} must be in (0, 1] (or None for off)")
        if not self.repetition_penalty > 0:
            msg = f"repetition_penalty={self.repetition_penalty!r} must be > 0 (1 = off)"
            raise GenerationError(msg)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise GenerationError(f"stop={self.stop!r}: stop strings must be non-empty strings")
        # torch's manual_seed fails past 2**64 with an overflow traceback; train's rule, one line
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_RULE[1](self.seed)):
            raise GenerationError(f"seed={self.seed!r} must be {SEED_RULE[0]} (or None for random)")
        return self


@dataclass
class Completion:
    prompt: str  # the prompt text ("" when generating from ids)
    text: str  # the generated text, without the prompt and without the stop string
    token_ids: list[int]  # the generated tokens (up to and including the one that completed a stop)
    # "length" (max_new_tokens), "stop" (a stop string) or "eot" (end-of-text token)
    finish_reason: str


def process_logits(
    logits: torch.Tensor, cfg: SamplingConfig, seen: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, V) logits -> float logits to sample from; seen (B, V): the tokens in each row's context."""
    logits = logits.float()
    p = cfg.repetition_penalty
    if seen is not None and p != 1.0:
        # Dividing a negative logit would make it *more* likely, so negative ones are multiplied (CTRL / HF).
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalised, logits)
    if cfg.temperature == 0:
        return logits
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.size(-1):
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the most likely token always stays.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None
) -> torch.Tensor:
    """(B, V) -> (B,): argmax(p / q), q ~ Exp(1), wins with probability p_i; torch.multinomial's .item() check would
    make the host wait for the GPU at every token."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits, dim=-1)
    # training's samples pass a CPU one
    gen_device = probs.device if generator is None else generator.device
    q = torch.empty(probs.shape, device=gen_device).exponential_(1, generator=generator)
    q = q.to(probs.device)
    # the CPU kernel can return exactly 0, and 0 / 0 = NaN would win argmax
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


class Engine:
    def __init__(self, model: GPT, tokenizer=None, step: int | None = None, source: str = ""):
        # used as is: from_run puts the model in eval mode
        self.model, self.tokenizer = model, tokenizer
        # the checkpoint's training step and path, for display
        self.step, self.source = step, source
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        # a CPU's few-row matmuls split (SplitFewRows, below): measured at first use
        self.split_matmuls: bool | None = None

    @classmethod
    def from_run(cls, run_dir, checkpoint: str | int = "latest", device: str = "cpu") -> "Engine":
        # bf16 (a T4: fp16) on a GPU: each token reads every weight, and half the bytes take about half the time
        ld = load_run(run_dir, checkpoint, device=device, dtype="auto")
        return cls(ld.model, ld.tokenizer, step=ld.step, source=str(ld.path))

    def _logits(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        # Only the last position: all T of a prefill onto a 32K vocabulary would cost as much as several blocks.
        with self._matmuls():
            return self.model.head(self.model.hidden_states(idx, cache)[:, -1])

    def _matmuls(self):
        """On a CPU, decoding's few-row matmuls split into row blocks where this CPU runs them faster so."""
        if self.device.type != "cpu":
            return contextlib.nullcontext()
        if self.split_matmuls is None:
            self.split_matmuls = split_is_faster(self.model)
        return SplitFewRows() if self.split_matmuls else contextlib.nullcontext()

    def _next_logits(self, buf: torch.Tensor, cur: int, cache: KVCache) -> torch.Tensor:
        """Token cur into the cache. A full cache keeps its newest half, refilled once from the tokens (llama.cpp's
        context shift), then decodes one token a step again. Rotating rotary keys instead would be inexact: a
        deeper layer's cached keys hold what the dropped tokens added to the kept ones."""
        start, bs = cur, self.model.config.block_size
        if cache.pos == bs:
            cache.pos, start = 0, cur + 1 - max(1, bs // 2)
        return self._logits(buf[:, start : cur + 1], cache)

    @torch.inference_mode()
    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        cfg: SamplingConfig,
        *,
        generator: torch.Generator | None = None,
        stop_ids: Sequence[int] = (),
        on_step: Callable[[list[int], list[int]], Sequence[int] | None] | None = None,
    ) -> tuple[list[list[int]], list[str]]:
        """-> (each prompt's new ids, why it ended: "eot", "length", or "stop" when on_step(rows with a new token,
        those tokens) returned the row)."""
        cfg.validate()
        bs, dev = self.model.config.block_size, self.device
        max_new, B = cfg.max_new_tokens, len(prompts)
        if empty := [i for i, p in enumerate(prompts) if len(p) == 0]:
            msg = f"prompt {empty[0]} is empty: give at least one token (e.g. a newline)"
            raise GenerationError(msg)
        if not prompts or max_new == 0:
            return [[] for _ in prompts], ["length"] * B
        # same seed, weights and settings -> same text
        if generator is None and cfg.temperature > 0:
            seed = secrets.randbits(63) if cfg.seed is None else cfg.seed
            generator = torch.Generator(dev).manual_seed(seed)
        # A prompt past the context: its last block_size tokens, all the model reads of it. A batch then prefills
        # every row's window (a longer row read token by token beside a short one would shift the cache on the way).
        whole, prompts = prompts, [list(p)[-bs:] for p in prompts]
        lens = [len(p) for p in prompts]
        min_len, max_len, total = min(lens), max(lens), max(lens) + max_new
        # more tokens than memory holds (10**10): one line naming max_new_tokens, not the allocator's traceback
        try:
            buf = torch.zeros(B, total, dtype=torch.long, device=dev)  # buf[b, t]: row b's token t
        except RuntimeError:  # a GPU's torch.OutOfMemoryError is one too
            msg = f"max_new_tokens={max_new}: a buffer of {B} x {total:,} tokens does not fit in {dev} memory"
            raise GenerationError(f"{msg}; ask for fewer new tokens") from None
        for b, p in enumerate(prompts):
            buf[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        lens_t = torch.tensor(lens, device=dev)
        is_prompt = torch.arange(total, device=dev) < lens_t[:, None]  # (B, total)
        seen = None  # (B, V) the tokens in each row's context, for the repetition penalty
        if cfg.repetition_penalty != 1.0:
            seen = torch.zeros(B, self.model.config.vocab_size, dtype=torch.bool, device=dev)
            seen.scatter_(1, buf[:, :min_len], True)
            for b, p in enumerate(whole):  # a long prompt's tokens before its window count too
                seen[b, torch.as_tensor(list(p)[:-bs], dtype=torch.long, device=dev)] = True
        stop_t = torch.tensor(list(stop_ids), dtype=torch.long, device=dev) if stop_ids else None
        # finished rows: their further tokens are dropped
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        reasons, ends = ["length"] * B, [n + max_new for n in lens]
        cache = KVCache(self.model.config, B, dev, self.dtype)
        logits = self._logits(buf[:, max(0, min_len - bs) : min_len], cache)
        for cur in range(min_len, total):
            nxt = sample_next(process_logits(logits, cfg, seen), cfg, generator)  # (B,)
            if cur < max_len:  # rows still reading their prompt keep their prompt token
                nxt = torch.where(is_prompt[:, cur], buf[:, cur], nxt)
            buf[:, cur] = nxt
            if seen is not None:
                seen.scatter_(1, nxt[:, None], True)
            if on_step is not None or stop_t is not None:
                # rows whose token at cur is new (a row is done from its last token on)
                new = ~is_prompt[:, cur] & ~done
                if stop_t is not None:
                    done |= new & torch.isin(nxt, stop_t)
                done |= cur + 1 >= lens_t + max_new
            if on_step is not None and (rows := new.nonzero().flatten().tolist()):
                stopped = list(on_step(rows, nxt[rows].tolist()) or ())
                for r in stopped:
                    reasons[r], ends[r] = "stop", cur + 1
                done[stopped] = True
            # Checking "all rows done" costs a device sync: every step if we sync anyway, else every 16.
            check = on_step is not None or stop_t is not None and cur % 16 == 0
            if cur + 1 >= total or check and bool(done.all()):
                break
            logits = self._next_logits(buf, cur, cache)
        out = [row[n : min(end, cur + 1)] for row, n, end in zip(buf.tolist(), lens, ends)]
        for b, row in enumerate(out):  # each row ends at its first end-of-text
            if (eot := next((j for j, t in enumerate(row) if t in stop_ids), None)) is not None:
                out[b], reasons[b] = row[: eot + 1], "eot"
        return out, reasons

    def generate(
        self,
        prompts: str | Sequence[str],
        cfg: SamplingConfig | None = None,
        *,
        stream: Callable[[int, str], None] | None = None,
    ) -> list[Completion]:
        """stream(i, piece) gets prompt i's new text as it becomes final."""
        if self.tokenizer is None:
            raise GenerationError(
                "this engine has no tokenizer: use generate_ids, or load it with Engine.from_run"
            )
        cfg = (cfg or SamplingConfig()).validate()
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(self.tokenizer.encode(p))
            except ValueError as e:
                raise GenerationError(f"prompt {i} ({p[:40]!r}) cannot be encoded: {e}") from None
        eot = self.tokenizer.eot_id
        # an empty prompt starts a new document (BPE); a char model needs some text
        if eot is not None:
            ids = [x or [eot] for x in ids]
        stop_ids = [eot] if cfg.stop_at_eot and eot is not None else []
        texts, out, reasons = self.generate_text(ids, cfg, stop_ids, stream)
        return [
            Completion(prompt=p, text=t, token_ids=list(g), finish_reason=r)
            for p, t, g, r in zip(prompts, texts, out, reasons)
        ]

    def generate_text(
        self,
        prompts: Sequence[Sequence[int]],
        cfg: SamplingConfig,
        stop_ids: Sequence[int] = (),
        stream: Callable[[int, str], None] | None = None,
    ) -> tuple[list[str], list[list[int]], list[str]]:
        """generate_ids and each row's new text (no end-of-text or stop string), decoded per token only if needed."""
        if stream is None and not cfg.stop:
            out, reasons = self.generate_ids(prompts, cfg, stop_ids=stop_ids)
            texts = [self.tokenizer.decode([t for t in g if t not in stop_ids]) for g in out]
            return texts, out, reasons
        streams = [_TextStream(self.tokenizer, cfg.stop) for _ in prompts]

        # -> the rows whose text reached a stop string
        def on_step(rows: list[int], toks: list[int]) -> list[int]:
            stopped = []
            for r, t in zip(rows, toks):
                # end-of-text is not part of the text
                piece = streams[r].push(t, final=t in stop_ids)
                if piece and stream is not None:
                    stream(r, piece)
                if streams[r].stopped and t not in stop_ids:
                    stopped.append(r)
            return stopped

        out, reasons = self.generate_ids(prompts, cfg, stop_ids=stop_ids, on_step=on_step)
        for i, st in enumerate(streams):
            if (tail := st.flush()) and stream is not None:
                stream(i, tail)
        return [st.text for st in streams], out, reasons


class _TextStream:
    """One row's text, token by token. A byte-level BPE token can end inside a UTF-8 character: text is emitted once
    it decodes cleanly (no trailing U+FFFD); text that could still grow into a stop string is held back."""

    def __init__(self, tok, stop: Sequence[str]):
        self.tok, self.stop = tok, list(stop)
        # the final text so far (before any stop string), and how much was shown
        self.text, self.emitted = "", 0
        self._pending: list[int] = []  # tokens whose text is not complete yet
        self.stopped = False

    def push(self, token: int, final: bool = False) -> str:
        """Add one token (final: end-of-text, not part of the text) -> the text that may be shown now."""
        if self.stopped:
            return ""
        if final:
            self.stopped = True
            return self.flush()
        self._pending.append(token)
        piece = self.tok.decode(self._pending)
        if piece.endswith("\ufffd") and len(self._pending) < 4:
            return ""  # an incomplete character: wait for the next token
        self._pending = []
        return self._add(piece, hold=True)

    def _add(self, piece: str, hold: bool) -> str:
        """Append `piece`; cut the text at a stop string it completes -> the text that may be shown now (hold: not
        the end that could still grow into a stop string)."""
        self.text += piece
        look = max(0, len(self.text) - len(piece) - max(map(len, self.stop), default=0) + 1)
        if hits := [i for i in (self.text.find(s, look) for s in self.stop) if i >= 0]:
            self.text, self.stopped = self.text[: min(hits)], True
            return self._take(len(self.text))
        # held back: the longest end of the text that is a proper prefix of a stop string
        held = 0
        for s in self.stop if hold else ():
            for n in range(1, min(len(s) - 1, len(self.text)) + 1):
                if self.text.endswith(s[:n]):
                    held = max(held, n)
        return self._take(len(self.text) - held)

    def _take(self, upto: int) -> str:
        piece, self.emitted = self.text[self.emitted : upto], max(self.emitted, upto)
        return piece

    def flush(self) -> str:
        """At the end: the held-back text and the tokens of an unfinished character (as U+FFFD), up to a stop string
        they make."""
        piece, self._pending = self.tok.decode(self._pending) if self._pending else "", []
        return self._add(piece, hold=False)


FEW_ROWS = 64  # up to this many rows (a decoding step's batch); a prefill's longer inputs stay on MKL's gemm
FASTER = 0.9  # the split is used where it takes at most this share of the plain call's time


def split_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: int
) -> torch.Tensor:
    """F.linear(x, weight, bias) as `blocks` row blocks of weight: x (..., K), weight (N, K) -> (..., N)."""
    N, K = weight.shape
    x2 = x.reshape(-1, K)  # (R, K)
    w = weight.view(blocks, N // blocks, K).transpose(1, 2)  # (blocks, K, N/blocks), a view
    xb = x2.expand(blocks, *x2.shape)  # (blocks, R, K): the same rows for every block, no copy
    if bias is None:
        y = torch.bmm(xb, w)
    else:
        y = torch.baddbmm(bias.view(blocks, 1, N // blocks), xb, w)
    return y.transpose(0, 1).reshape(*x.shape[:-1], N)  # (blocks, R, N/blocks) -> (..., N)


def row_blocks(n_rows: int) -> int:
    """One block per thread, fewer where n_rows does not divide evenly."""
    blocks = torch.get_num_threads()
    while n_rows % blocks:
        blocks -= 1
    return blocks


class SplitFewRows(TorchFunctionMode):
    """Inside `with SplitFewRows():`, every F.linear of a few rows on the CPU (nn.Linear calls it) runs split."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.device.type == "cpu" and x.numel() <= FEW_ROWS * weight.shape[1]:
                if (blocks := row_blocks(weight.shape[0])) > 1:
                    return split_linear(x, weight, bias, blocks)
        return func(*args, **kwargs)


@torch.inference_mode()
def split_is_faster(model: torch.nn.Module, repeats: int = 3) -> bool:
    """Both ways on the model's own weights, one row each, best of `repeats` (~0.2 s for gpt2-small)."""
    weights = [p for p in model.parameters() if p.dim() == 2 and p.device.type == "cpu"]
    if torch.get_num_threads() < 2 or not weights:
        return False
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}

    def best(linear) -> float:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            for w in weights:
                linear(xs[w.shape[1]], w)
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    plain = best(F.linear)
    split = best(lambda x, w: split_linear(x, w, None, row_blocks(w.shape[0])))
    return split <= FASTER * plain
