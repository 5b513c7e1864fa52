"""Sampling from a GPT: a KV-cached decoding engine.

    eng = Engine.from_run("runs/shakespeare", checkpoint="best")
    out = eng.generate(["ROMEO:", "JULIET:"], SamplingConfig(max_new_tokens=200, top_p=0.9, stop=["\\n\\n"]),
                       stream=lambda i, piece: print(piece, end=""))

How decoding works:
- The prompts are prefilled once into a preallocated KV cache; then each step feeds one token.
- A batch of prompts of different lengths shares one cache: all rows are prefilled up to the
  shortest prompt, then a row that still has prompt tokens is fed them one per step (its sampled
  token is replaced by the prompt token) while the other rows already generate. Every row's token
  t sits at position t, so no padding masks are needed (the scheme of Meta's Llama reference code).
- Past the context length (block_size) the window slides: the newest `block_size + 1 - window_slide`
  tokens are re-prefilled. With the default `window_slide=1` every step sees exactly the last
  block_size tokens, i.e. the same result as a full forward of the cropped context (slow past the
  window, but exact); a larger slide re-prefills less often at the price of a shorter context.
- Logits processing runs on the device, vectorised over the batch; the host reads tokens back only
  when something needs them (a streaming callback, stop strings, an end-of-text token).

Training's samples use the same engine (gptlib.training.logs); gptlib.inference.compare continues the same
prompts with several checkpoints.
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch

from gptlib.errors import GenerationError
from gptlib.inference.loading import load_run
from gptlib.inference.sampling import Completion, SamplingConfig, process_logits, sample_next
from gptlib.model import GPT, KVCache


def _forward_last(model: GPT, idx: torch.Tensor, cache: KVCache | None,
                  pos: torch.Tensor | None = None) -> torch.Tensor:
    """Like model(idx, cache=cache) but the vocabulary projection runs for the last position only.

    During a prefill or a no-cache step only the last position's logits are used; projecting T
    positions onto a 32K vocabulary would cost as much as several transformer blocks.
    (B, T) -> (B, vocab_size) logits. pos (T,): the positions, for a static cache.
    """
    x = model.transformer.ln_f(model.hidden_states(idx, cache, pos)[:, -1, :])  # (B, C)
    return model.lm_head(x)[:, : model.config.vocab_size]  # (B, V)


def _check_prompts(prompts: Sequence[Sequence[int]], window_slide: int, block_size: int) -> None:
    if not 1 <= window_slide <= block_size:
        raise GenerationError(f"window_slide={window_slide} must be in [1, block_size={block_size}]")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise GenerationError(f"prompt {i} is empty: give at least one token (e.g. a newline)")


def _seeded_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """The sampling RNG: seeded (same seed, weights and settings -> same text), else from OS entropy."""
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    return generator


def _prompt_buffer(prompts: Sequence[Sequence[int]], total: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, total) token buffer with the prompts written at their positions, and the mask of prompt slots."""
    buf = torch.zeros(len(prompts), total, dtype=torch.long, device=device)
    is_prompt = torch.zeros(len(prompts), total, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):
        buf[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        is_prompt[b, : len(p)] = True
    return buf, is_prompt


def _generated_rows(buf: list[list[int]], lens: list[int], last: int, max_new: int, stop_at: list[int | None],
                    reasons: list[str], stop_ids: Sequence[int]) -> tuple[list[list[int]], list[str]]:
    """Each row's new tokens (up to `last`, the last position written; cut after a stop string or at
    the first end-of-text id) and why it ended."""
    out, out_reasons = [], []
    stop_set = set(stop_ids)
    for b, row_buf in enumerate(buf):
        end = min(last + 1, lens[b] + max_new)
        if stop_at[b] is not None:
            end = stop_at[b] + 1
        row, reason = row_buf[lens[b] : end], reasons[b]
        for j, t in enumerate(row):
            if t in stop_set:
                row, reason = row[: j + 1], "eot"
                break
        out.append(row)
        out_reasons.append(reason)
    return out, out_reasons


# --- the engine -------------------------------------------------------------------------------


class Engine:
    """Generation for one model (and optionally its tokenizer, for text in and out)."""

    def __init__(self, model: GPT, tokenizer=None, step: int | None = None, source: str = "",
                 compile: bool = False):
        self.model = model  # used as is: Engine.from_run puts it in eval mode (no dropout)
        self.tokenizer = tokenizer
        self.step = step  # the checkpoint's training step, if loaded from a run
        self.source = source  # where the weights came from (checkpoint path), for display
        # compile: the one-token decode step runs through torch.compile on a static KV cache, with
        # CUDA graphs on a GPU (one replay per token instead of ~15 kernel launches per layer from
        # Python). The first generation pays the compile (tens of seconds); worth it for long outputs.
        self.compile = compile
        self._compiled_step = None
        self._compiled_calls: dict[int, int] = {}  # batch size -> compiled steps run (its first ones compile)
        self._static_caches: dict[int, KVCache] = {}  # batch size -> cache, reused (a new one re-records the graph)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    @classmethod
    def from_run(cls, run_dir, checkpoint: str | int = "latest", device: str = "cpu", dtype=None,
                 compile: bool = False) -> "Engine":
        """Load a checkpoint of a run directory: "latest", "best" or a step (see gptlib.inference.loading)."""
        ld = load_run(run_dir, checkpoint, device=device, dtype=dtype)
        return cls(ld.model, ld.tokenizer, step=ld.step, source=str(ld.path), compile=compile)

    def _feed(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feed idx (B, T) after what the cache holds -> (B, vocab_size) logits of its last position."""
        if not cache.static:
            return _forward_last(self.model, idx, cache)
        T = idx.size(1)
        pos = torch.arange(cache.pos, cache.pos + T, device=idx.device)  # (T,)
        step = _forward_last
        if T == 1:  # prefills vary in length: eager; the per-token step has fixed shapes: compiled
            if self._compiled_step is None:
                mode = "reduce-overhead" if self.device.type == "cuda" else "default"  # CUDA graphs need a GPU
                self._compiled_step = torch.compile(_forward_last, mode=mode, fullgraph=True, dynamic=False)
            step = self._compiled_step
            idx = idx.clone()  # its own storage: a view into buf would change address every step
        B = idx.size(0)
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

    # -- token level ----------------------------------------------------------------------------

    @torch.inference_mode()
    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        cfg: SamplingConfig,
        *,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        window_slide: int = 1,
        stop_ids: Sequence[int] = (),
        on_step: Callable[[list[int], list[int]], Sequence[int] | None] | None = None,
    ) -> tuple[list[list[int]], list[str]]:
        """Continue each prompt (a list of token ids) -> (generated ids per prompt, finish reason per prompt).

        on_step(rows, tokens) is called after each step with the rows that produced a new token and
        those tokens; it returns the rows that should stop ("stop"), e.g. because a stop string appeared.
        Generation ends at a token in stop_ids ("eot") or after cfg.max_new_tokens ("length").
        """
        cfg.validate()
        model, bs = self.model, self.model.config.block_size
        _check_prompts(prompts, window_slide, bs)
        if not prompts:
            return [], []
        B, dev = len(prompts), self.device
        lens = [len(p) for p in prompts]
        min_len, max_len, total = min(lens), max(lens), max(l + cfg.max_new_tokens for l in lens)
        if cfg.max_new_tokens == 0:
            return [[] for _ in prompts], ["length"] * B
        if generator is None and cfg.temperature > 0:
            generator = _seeded_generator(cfg.seed, dev)
        buf, is_prompt = _prompt_buffer(prompts, total, dev)  # buf[b, t]: row b's token at position t
        ends = torch.tensor([l + cfg.max_new_tokens for l in lens], device=dev)  # (B,) row b stops before this
        seen = None
        if cfg.repetition_penalty != 1.0:
            seen = torch.zeros(B, model.config.vocab_size, dtype=torch.bool, device=dev)
            seen.scatter_(1, buf[:, :min_len], True)
        stop_t = torch.tensor(list(stop_ids), dtype=torch.long, device=dev) if stop_ids else None
        done = torch.zeros(B, dtype=torch.bool, device=dev)  # finished rows (their further tokens are dropped)
        no_rows = torch.zeros(B, dtype=torch.bool, device=dev)
        reasons = ["length"] * B
        stop_at: list[int | None] = [None] * B  # position of the token that completed a stop string
        need_host = on_step is not None  # read tokens back every step only when someone needs them

        cache = self._cache_for(B) if use_cache else None
        start = max(0, min_len - bs)
        prompt_ids = buf[:, start:min_len]
        logits = self._feed(prompt_ids, cache) if cache is not None else _forward_last(model, prompt_ids, None)

        for cur in range(min_len, total):
            nxt = sample_next(process_logits(logits, cfg, seen), cfg, generator)  # (B,)
            if cur < max_len:  # some rows are still reading their prompt: keep their prompt token
                forced = is_prompt[:, cur]
                nxt = torch.where(forced, buf[:, cur], nxt)
            else:
                forced = no_rows
            buf[:, cur] = nxt
            if seen is not None:
                seen.scatter_(1, nxt[:, None], True)
            if need_host or stop_t is not None:
                generated = ~forced & ~done & (cur < ends)  # rows whose token at cur is a real new token
                if stop_t is not None:
                    done |= generated & torch.isin(nxt, stop_t)
                done |= ~forced & (cur + 1 >= ends)
            if need_host:
                gen_rows = generated.nonzero().flatten().tolist()
                if gen_rows:
                    toks = nxt[gen_rows].tolist()
                    stop_rows = on_step(gen_rows, toks) or ()
                    for r in stop_rows:
                        reasons[r], stop_at[r] = "stop", cur
                    if stop_rows:
                        done[list(stop_rows)] = True
            if cur + 1 >= total:
                break
            # Checking "all rows done" costs a device sync: every step if we sync anyway, else every 16.
            if (need_host or stop_t is not None and cur % 16 == 0) and bool(done.all()):
                break
            logits = self._next_logits(buf, cur, cache, window_slide)

        return _generated_rows(buf.tolist(), lens, cur, cfg.max_new_tokens, stop_at, reasons, stop_ids)

    def _next_logits(self, buf: torch.Tensor, cur: int, cache: KVCache | None, window_slide: int) -> torch.Tensor:
        """Logits after the token at position `cur`: one cached step, or past the window a re-prefill of
        the newest block_size + 1 - window_slide tokens (without a cache: a full forward of the window)."""
        bs = self.model.config.block_size
        if cache is None:
            return _forward_last(self.model, buf[:, max(0, cur + 1 - bs) : cur + 1], None)
        if cache.pos < bs:
            return self._feed(buf[:, cur : cur + 1], cache)
        cache.reset()
        keep = bs + 1 - window_slide
        return self._feed(buf[:, cur + 1 - keep : cur + 1], cache)

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

    # -- text level -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[str],
        cfg: SamplingConfig | None = None,
        *,
        stream: Callable[[int, str], None] | None = None,
        use_cache: bool = True,
        window_slide: int = 1,
    ) -> list[Completion]:
        """Continue text prompts; stream(i, piece) receives each new piece of text of prompt i as it appears.

        Text that might be the start of a stop string is held back until it is clear, so a stop
        string never reaches the stream.
        """
        if self.tokenizer is None:
            raise GenerationError("this engine has no tokenizer: use generate_ids, or load it with Engine.from_run")
        cfg = (cfg or SamplingConfig()).validate()
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        tok = self.tokenizer
        ids = []
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

        def on_step(rows: list[int], toks: list[int]) -> list[int]:
            stopped = []
            for r, t in zip(rows, toks):
                st = streams[r]
                if st.stopped:
                    continue
                is_eot = t in stop_ids  # the engine itself ends the row at end-of-text
                piece = st.push(t, final=is_eot)
                if piece and stream is not None:
                    stream(r, piece)
                if st.stopped and not is_eot:
                    stopped.append(r)
            return stopped

        need_steps = stream is not None or bool(cfg.stop)
        out_ids, reasons = self.generate_ids(ids, cfg, use_cache=use_cache, window_slide=window_slide,
                                             stop_ids=stop_ids, on_step=on_step if need_steps else None)
        results = []
        for i, (p, gen, reason) in enumerate(zip(prompts, out_ids, reasons)):
            st = streams[i]
            if need_steps:
                tail = st.flush()
                if tail and stream is not None:
                    stream(i, tail)
                text = st.text
            else:
                text = tok.decode([t for t in gen if t not in stop_ids])
            results.append(Completion(prompt=p, text=text, token_ids=list(gen), finish_reason=reason))
        return results


class _TextStream:
    """Incremental detokenisation of one sequence, with stop strings.

    Byte-level BPE tokens can end in the middle of a UTF-8 character: text is emitted only once it
    decodes cleanly (no trailing U+FFFD), and text that could still grow into a stop string is held.
    """

    def __init__(self, tok, stop: Sequence[str]):
        self.tok, self.stop = tok, list(stop)
        self.ids: list[int] = []
        self.text = ""  # the final text so far (stable, before any stop string)
        self.emitted = 0  # characters of self.text already handed to the stream
        self._pending: list[int] = []  # tokens whose text is not complete yet
        self.stopped = False

    def push(self, token: int, final: bool = False) -> str:
        """Add one token; returns the text that may be shown now ("" while held back or after a stop)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        if final:  # end-of-text: not part of the text
            self.stopped = True
            return self.flush()
        self._pending.append(token)
        piece = self.tok.decode(self._pending)
        if piece.endswith("\ufffd") and len(self._pending) < 4:
            return ""  # an incomplete character: wait for the next token
        self._pending = []
        self.text += piece
        if self.stop:
            # Search only the region the new piece could complete.
            look = max(0, len(self.text) - len(piece) - max(map(len, self.stop)) + 1)
            hits = [i for i in (self.text.find(s, look) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self._take(len(self.text))
            return self._take(len(self.text) - self._held())
        return self._take(len(self.text))

    def _held(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        piece = self.text[self.emitted : upto]
        self.emitted = upto
        return piece

    def flush(self) -> str:
        """At the end: whatever is left (held-back text that never became a stop string)."""
        if self._pending:
            self.text += self.tok.decode(self._pending)
            self._pending = []
        return self._take(len(self.text))
