"""Sampling from a GPT: a KV-cached decoding engine.

    eng = Engine.from_run("runs/shakespeare", checkpoint="best")
    out = eng.generate(["ROMEO:", "JULIET:"], SamplingConfig(max_new_tokens=200, top_p=0.9, stop=["\\n\\n"]),
                       stream=lambda i, piece: print(piece, end=""))

The prompts are prefilled once into a preallocated KV cache, then each step feeds one token. Prompts of different
lengths share one cache: every row is prefilled up to the shortest prompt, then a row still reading its prompt is
fed it one token per step while the others generate; row b's token t sits at position t, so no padding masks are
needed (as in Meta's Llama reference code). Past block_size the window slides: the newest `block_size + 1 -
window_slide` tokens are re-prefilled (the default 1 is exactly a full forward of the cropped context). Logits are
processed on the device; the host reads tokens back only when a stream, stop strings or end-of-text need them.
"""

from __future__ import annotations

import secrets
import warnings
from typing import Callable, Sequence

import torch

from gptlib.errors import GenerationError
from gptlib.inference.loading import load_run
from gptlib.inference.sampling import Completion, SamplingConfig, process_logits, sample_next
from gptlib.model import GPT, KVCache

OnStep = Callable[[list[int], list[int]], "Sequence[int] | None"]  # (rows, their new tokens) -> rows to stop


def _forward_last(model: GPT, idx: torch.Tensor, cache: KVCache | None,
                  pos: torch.Tensor | None = None) -> torch.Tensor:
    """model(idx, cache=cache) with the vocabulary projection for the last position only: (B, T) -> (B, V).
    Projecting all T positions of a prefill onto a 32K vocabulary would cost as much as several blocks."""
    return model.head(model.hidden_states(idx, cache, pos)[:, -1, :])  # (B, C) -> (B, V)


def _check_prompts(prompts: Sequence[Sequence[int]], window_slide: int, block_size: int) -> None:
    if not 1 <= window_slide <= block_size:
        raise GenerationError(f"window_slide={window_slide} must be in [1, block_size={block_size}]")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise GenerationError(f"prompt {i} is empty: give at least one token (e.g. a newline)")


def _generated(buf: list[list[int]], lens: list[int], ends: list[int], reasons: list[str], stop_ids: Sequence[int]
               ) -> tuple[list[list[int]], list[str]]:
    """Each row's new tokens, buf[b][lens[b]:ends[b]], cut after the first end-of-text id ("eot"), and reasons."""
    out = []
    for b, row in enumerate(buf):
        row = row[lens[b] : ends[b]]
        eot = next((j for j, t in enumerate(row) if t in stop_ids), None)
        if eot is not None:
            row, reasons[b] = row[: eot + 1], "eot"
        out.append(row)
    return out, reasons


class Engine:
    """Generation for one model (and optionally its tokenizer, for text in and out)."""

    def __init__(self, model: GPT, tokenizer=None, step: int | None = None, source: str = "",
                 compile: bool = False):
        self.model = model  # used as is: Engine.from_run puts it in eval mode (no dropout)
        self.tokenizer = tokenizer
        self.step = step  # the checkpoint's training step, if loaded from a run
        self.source = source  # where the weights came from (checkpoint path), for display
        # compile: the one-token decode step runs through torch.compile on a static KV cache, with CUDA graphs on
        # a GPU (one replay per token instead of ~15 kernel launches per layer); the first generation compiles.
        self.compile = compile
        self._compiled_step = None
        self._compiled_calls: dict[int, int] = {}  # batch size -> compiled steps run (its first ones compile)
        self._static_caches: dict[int, KVCache] = {}  # batch size -> cache, reused (a new one re-records the graph)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    @classmethod
    def from_run(cls, run_dir, checkpoint: str | int = "latest", device: str = "cpu", dtype="auto",
                 compile: bool = False) -> "Engine":
        """Load a checkpoint of a run directory: "latest", "best" or a step (see gptlib.inference.loading).
        dtype "auto": on a GPU the weights (and the KV cache) in bf16, fp16 on a T4, since each decoded token
        reads every weight and half the bytes take about half the time; fp32 on a CPU."""
        ld = load_run(run_dir, checkpoint, device=device, dtype=dtype)
        return cls(ld.model, ld.tokenizer, step=ld.step, source=str(ld.path), compile=compile)

    def _feed(self, idx: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """Feed idx (B, T) after what the cache holds -> (B, vocab_size) logits of its last position."""
        if cache is None or not cache.static:
            return _forward_last(self.model, idx, cache)
        B, T = idx.shape
        pos = torch.arange(cache.pos, cache.pos + T, device=idx.device)  # (T,)
        step = _forward_last
        if T == 1:  # prefills vary in length: eager; the per-token step has fixed shapes: compiled
            if self._compiled_step is None:
                mode = "reduce-overhead" if self.device.type == "cuda" else "default"  # CUDA graphs need a GPU
                self._compiled_step = torch.compile(_forward_last, mode=mode, fullgraph=True, dynamic=False)
            step = self._compiled_step
            idx = idx.clone()  # its own storage: a view into buf would change address every step
        try:
            logits = step(self.model, idx, cache, pos)
        except Exception as e:
            # A batch size's first calls compile and record the CUDA graph: a missing compiler, a Triton
            # problem or dynamo's recompile limit (one graph per batch size) must not end the session.
            compile_error = (type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))
                             or self._compiled_calls.get(B, 0) < 3)
            if step is _forward_last or not compile_error:
                raise
            warnings.warn(f"compiling the decode step failed ({type(e).__name__}: {str(e)[:300]}); "
                          f"decoding without compile", stacklevel=2)
            self._compiled_step = step = _forward_last
            logits = step(self.model, idx, cache, pos)
        if step is not _forward_last:
            self._compiled_calls[B] = self._compiled_calls.get(B, 0) + 1
            logits = logits.clone()  # a CUDA graph reuses its output buffer on the next replay
        cache.pos += T
        return logits

    def _cache_for(self, B: int) -> KVCache:
        """A fresh dynamic cache; or, compiled, the static cache of this batch size, reused (a new one
        would re-record the CUDA graph). Old keys stay in it: the mask hides slots past each position."""
        if not self.compile:
            return KVCache(self.model.config, B, self.device, self.dtype)
        if B not in self._static_caches:
            if len(self._static_caches) >= 2:  # bounded memory (gpt2-small fp32: 75 MB per row)
                self._static_caches.pop(next(iter(self._static_caches)))
            self._static_caches[B] = KVCache(self.model.config, B, self.device, self.dtype, static=True)
        cache = self._static_caches[B]
        cache.reset()
        return cache

    def _next_logits(self, buf: torch.Tensor, cur: int, cache: KVCache | None, window_slide: int) -> torch.Tensor:
        """Logits after the token at position `cur`: one cached step, or past the window a re-prefill of
        the newest block_size + 1 - window_slide tokens (without a cache: a full forward of the window)."""
        bs = self.model.config.block_size
        if cache is None:
            return _forward_last(self.model, buf[:, max(0, cur + 1 - bs) : cur + 1], None)
        if cache.pos < bs:
            return self._feed(buf[:, cur : cur + 1], cache)
        cache.reset()
        return self._feed(buf[:, cur + window_slide - bs : cur + 1], cache)

    @torch.inference_mode()
    def generate_ids(self, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, *,
                     generator: torch.Generator | None = None, use_cache: bool = True, window_slide: int = 1,
                     stop_ids: Sequence[int] = (), on_step: OnStep | None = None) -> tuple[list[list[int]], list[str]]:
        """Continue each prompt (a list of token ids) -> (generated ids per prompt, finish reason per prompt).
        on_step(rows, tokens) is called after each step with the rows that produced a new token and those tokens;
        it returns the rows that should stop ("stop"), e.g. because a stop string appeared. Generation also ends at
        a token in stop_ids ("eot") or after cfg.max_new_tokens ("length")."""
        cfg.validate()
        bs, dev, max_new = self.model.config.block_size, self.device, cfg.max_new_tokens
        _check_prompts(prompts, window_slide, bs)
        if not prompts or max_new == 0:
            return [[] for _ in prompts], ["length"] * len(prompts)
        if generator is None and cfg.temperature > 0:  # same seed, weights and settings -> same text
            generator = torch.Generator(dev).manual_seed(secrets.randbits(63) if cfg.seed is None else cfg.seed)
        lens = [len(p) for p in prompts]
        min_len, max_len, total = min(lens), max(lens), max(lens) + max_new
        buf = torch.zeros(len(prompts), total, dtype=torch.long, device=dev)  # buf[b, t]: row b's token t
        for b, p in enumerate(prompts):
            buf[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        lens_t = torch.tensor(lens, device=dev)
        is_prompt = torch.arange(total, device=dev) < lens_t[:, None]  # (B, total)
        seen = None  # (B, V) tokens in each row's context, for the repetition penalty
        if cfg.repetition_penalty != 1.0:
            seen = torch.zeros(len(prompts), self.model.config.vocab_size, dtype=torch.bool, device=dev)
            seen.scatter_(1, buf[:, :min_len], True)
        stop_t = torch.tensor(list(stop_ids), dtype=torch.long, device=dev) if stop_ids else None
        done = torch.zeros(len(prompts), dtype=torch.bool, device=dev)  # finished rows: further tokens dropped
        reasons, stop_at = ["length"] * len(prompts), [None] * len(prompts)  # stop_at: where a stop string ended
        cache = self._cache_for(len(prompts)) if use_cache else None
        logits = self._feed(buf[:, max(0, min_len - bs) : min_len], cache)
        for cur in range(min_len, total):
            nxt = sample_next(process_logits(logits, cfg, seen), cfg, generator)  # (B,)
            if cur < max_len:  # rows still reading their prompt keep their prompt token
                nxt = torch.where(is_prompt[:, cur], buf[:, cur], nxt)
            buf[:, cur] = nxt
            if seen is not None:
                seen.scatter_(1, nxt[:, None], True)
            if on_step is not None or stop_t is not None:
                new = ~is_prompt[:, cur] & ~done & (cur < lens_t + max_new)  # rows whose token at cur is new
                if stop_t is not None:
                    done |= new & torch.isin(nxt, stop_t)
                done |= cur + 1 >= lens_t + max_new
            if on_step is not None and (rows := new.nonzero().flatten().tolist()):
                stopped = list(on_step(rows, nxt[rows].tolist()) or ())
                for r in stopped:
                    reasons[r], stop_at[r] = "stop", cur
                done[stopped] = True
            # Checking "all rows done" costs a device sync: every step if we sync anyway, else every 16.
            check = on_step is not None or stop_t is not None and cur % 16 == 0
            if cur + 1 >= total or check and bool(done.all()):
                break
            logits = self._next_logits(buf, cur, cache, window_slide)

        ends = [min(cur + 1, n + max_new) if at is None else at + 1 for n, at in zip(lens, stop_at)]
        return _generated(buf.tolist(), lens, ends, reasons, stop_ids)

    def generate(self, prompts: str | Sequence[str], cfg: SamplingConfig | None = None, *,
                 stream: Callable[[int, str], None] | None = None, use_cache: bool = True,
                 window_slide: int = 1) -> list[Completion]:
        """Continue text prompts; stream(i, piece) receives each new piece of text of prompt i as it appears.
        Text that might be the start of a stop string is held back until it is clear, so a stop string never
        reaches the stream."""
        if self.tokenizer is None:
            raise GenerationError("this engine has no tokenizer: use generate_ids, or load it with Engine.from_run")
        cfg = (cfg or SamplingConfig()).validate()
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        tok, ids = self.tokenizer, []
        for i, p in enumerate(prompts):
            try:
                ids.append(tok.encode(p))
            except ValueError as e:
                raise GenerationError(f"prompt {i} ({p[:40]!r}) cannot be encoded: {e}") from None
        eot = getattr(tok, "eot_id", None)
        if eot is not None:  # an empty prompt starts a new document (BPE); a char model needs some text
            ids = [x if x else [eot] for x in ids]
        stop_ids = [eot] if cfg.stop_at_eot and eot is not None else []
        streams = [_TextStream(tok, cfg.stop) for _ in prompts]
        need_steps = stream is not None or bool(cfg.stop)
        out_ids, reasons = self.generate_ids(ids, cfg, use_cache=use_cache, window_slide=window_slide,
                                             stop_ids=stop_ids,
                                             on_step=text_steps(streams, stop_ids, stream) if need_steps else None)
        results = []
        for i, (p, gen, reason) in enumerate(zip(prompts, out_ids, reasons)):
            if need_steps:
                tail = streams[i].flush()
                if tail and stream is not None:
                    stream(i, tail)
                text = streams[i].text
            else:
                text = tok.decode([t for t in gen if t not in stop_ids])
            results.append(Completion(prompt=p, text=text, token_ids=list(gen), finish_reason=reason))
        return results


def text_steps(streams: list[_TextStream], stop_ids, stream: Callable[[int, str], None] | None) -> Callable:
    """An on_step for generate_ids: each row's tokens go to its _TextStream, its text to stream(row, piece); the
    rows whose text reached a stop string are returned (a token in stop_ids ends the row in the engine itself)."""
    def on_step(rows: list[int], toks: list[int]) -> list[int]:
        stopped = []
        for r, t in zip(rows, toks):
            piece = streams[r].push(t, final=t in stop_ids)  # end-of-text is not part of the text
            if piece and stream is not None:
                stream(r, piece)
            if streams[r].stopped and t not in stop_ids:
                stopped.append(r)
        return stopped

    return on_step


class _TextStream:
    """Incremental detokenisation of one sequence, with stop strings. Byte-level BPE tokens can end inside a UTF-8
    character: text is emitted once it decodes cleanly (no trailing U+FFFD); text that could still grow into a stop
    string is held."""

    def __init__(self, tok, stop: Sequence[str]):
        self.tok, self.stop = tok, list(stop)
        self.text = ""  # the final text so far (stable, before any stop string)
        self.emitted = 0  # characters of self.text already handed to the stream
        self._pending: list[int] = []  # tokens whose text is not complete yet
        self.stopped = False

    def push(self, token: int, final: bool = False) -> str:
        """Add one token; returns the text that may be shown now ("" while held back or after a stop)."""
        if self.stopped:
            return ""
        if final:  # end-of-text: not part of the text
            self.stopped = True
            return self.flush()
        self._pending.append(token)
        piece = self.tok.decode(self._pending)
        if piece.endswith("\ufffd") and len(self._pending) < 4:
            return ""  # an incomplete character: wait for the next token
        self._pending = []
        self.text += piece
        # Search only the region the new piece could complete.
        look = max(0, len(self.text) - len(piece) - max(map(len, self.stop), default=0) + 1)
        hits = [i for i in (self.text.find(s, look) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held())

    def _held(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        ends = [n for s in self.stop for n in range(1, min(len(s) - 1, len(self.text)) + 1)
                if self.text.endswith(s[:n])]
        return max(ends, default=0)

    def _take(self, upto: int) -> str:
        piece = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return piece

    def flush(self) -> str:
        """At the end: whatever is left (held-back text that never became a stop string)."""
        if self._pending:
            self.text += self.tok.decode(self._pending)
            self._pending = []
        return self._take(len(self.text))
