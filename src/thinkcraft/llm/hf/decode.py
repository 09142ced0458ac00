"""Generation: own decode loop over the HF model (token-in/token-out).

Temperature / top-p, stop strings, max tokens, n samples per item, sampled-token logprobs (unmodified
softmax), seeds, and a thinking budget for `<think>` models (after B thinking tokens the thought is closed
with `thinking_close_text` and the model answers). KV cache: dynamic, or static (preallocated, fixed
shapes) with optional `torch.compile` of the decode step (CUDA graphs). A shared prefix is prefilled once
(batch 1, the prefill's cached prefix KV) and copied into every row's cache; rows are laid out
[prefix][pads][suffix] with contiguous positions, so results equal the concatenated prompts. One-token
steps read the cache once with GQA heads folded (`attention.gqa_decode_attention`).

One chunk of rows (`_generate_chunk`) runs: row layout -> cache -> prompt forward -> the step loop (on the
device: no per-step sync; or on the host: stop strings / thinking budget need per-row logic each step) ->
completions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch

from thinkcraft.llm.attention import register_decode_attention
from thinkcraft.llm.constrained import GuideState, start_guide
from thinkcraft.llm.protocol import Batch, Completion, EngineCapabilityError, SamplingParams
from thinkcraft.utils.errors import UserError

_STATIC_PROMPT_BUCKET = 64
"""Static-cache prompt widths are rounded up to a multiple of this (fixed shapes across calls)."""


@dataclass
class _SeqState:
    """Per-sequence decode bookkeeping (host side)."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    forced: list[int] = field(default_factory=list)
    """Indices (into `tokens`) of tokens the engine forced (thinking-budget close), not sampled."""
    queue: list[int] = field(default_factory=list)
    in_think: bool = False
    thinking_tokens: int = 0
    think_truncated: bool = False
    done: bool = False
    finish: str = "length"
    stop_at: int | None = None
    """Character index in the decoded text where a stop string starts."""


class _Rows(NamedTuple):
    """One chunk's prompts laid out for the prompt forward."""

    ids: torch.Tensor
    """(B, S) the ids the prompt forward reads: the suffixes after a reused prefix, else the prompts."""
    mask: torch.Tensor
    """(B, T) over [prefix][pads][suffix] (or [pads][prompt]): 1 = a real token."""
    prefix_len: int
    """Tokens of the reused prefix (0: none); its KV is copied into the cache, not recomputed."""


class _Steps(NamedTuple):
    """What the step loop hands back: sampled ids and logprobs on the device, steps taken."""

    toks: torch.Tensor
    """(B, max_new_tokens) sampled ids (pads after a row ended / beyond `steps`)."""
    lps: torch.Tensor
    """(B, max_new_tokens) their logprobs (zeros unless requested)."""
    steps: int


StepFn = Callable[[torch.Tensor, int], torch.Tensor]
"""(this step's tokens (B,), step index) -> the next logits (B, V)."""


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of tokens whose probability reaches top_p (the most
    likely token is always kept); the rest get -inf."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    drop_sorted = before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _last_index(seq: Sequence[int], x: int | None) -> int:
    if x is None:
        return -1
    for i in range(len(seq) - 1, -1, -1):
        if seq[i] == x:
            return i
    return -1


def choose(
    logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token (B,), full log-softmax (B, V)) — logprobs are under the unmodified softmax."""
    logp = torch.log_softmax(logits, dim=-1)
    if sampling.temperature <= 0:
        return logits.argmax(-1), logp
    z = logits / sampling.temperature
    if sampling.top_p < 1.0:
        z = top_p_filter(z, sampling.top_p)
    probs = torch.softmax(z, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1), logp


def _sample(
    logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator | None, guide: GuideState | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`choose`, under the structured-output constraint when there is one (disallowed tokens masked)."""
    if guide is None:
        return choose(logits, sampling, gen)
    return guide.choose(logits, lambda z: choose(z, sampling, gen), sampling.logprobs)


def _guide_finished(guide: GuideState | None, tok: torch.Tensor) -> bool:
    """Structured outputs: the matchers accept this step's tokens (before the next forward is queued); True
    when every answer had already ended, so this step is all padding and the loop stops before counting it."""
    if guide is None:
        return False
    guide.advance(tok)
    return guide.finished


class DecodeMixin:
    """`HFEngine`'s generation half. Reads the engine's model facts (`_lm`, `device`, `pad_id`, `tokenizer`,
    `_cache_kw`, `max_batch_size`, `prefix_reuse`), its contexts (`_inference`, `_autocast_embeddings`,
    `_attn_impl`), `_pad`, `_encode`, `tokenize_batch` and the prefill's cached `_prefix_kv`."""

    def _init_decode(self, kv_cache: str, compile_decode: bool, thinking_close_text: str) -> None:
        # a compiled decode step needs fixed shapes: it always runs on the static cache
        self.kv_cache = "static" if compile_decode else kv_cache
        self.compile_decode = compile_decode
        self._compiled_forward = None
        self._static_cache: tuple[tuple[int, int], Any] | None = None
        self.last_generate_timing: dict[str, float] = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
        """Phase times of the last `generate` call (prefill = prompt forward; decode = the token loop)."""
        self.thinking_close_text = thinking_close_text
        self._decode_name = register_decode_attention()
        self.eos_ids = self._eos_ids()
        vocab = self.tokenizer.get_vocab()
        self.think_open_id = vocab.get("<think>")
        self.think_close_id = vocab.get("</think>")

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self._lm, "generation_config", None), self._lm.config):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, (list, tuple)):
                ids.update(int(x) for x in e)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def generate(self, batch: Batch, sampling: SamplingParams) -> list[Completion]:
        """Completions item-major (item0 × n, item1 × n, ...). Prompt = prefix + item token ids."""
        if sampling.n < 1 or sampling.max_new_tokens < 1:
            raise UserError("sampling.n and sampling.max_new_tokens must be ≥ 1")
        if sampling.thinking_budget is not None and (self.think_open_id is None or self.think_close_id is None):
            raise EngineCapabilityError("thinking_budget needs a model whose tokenizer has <think> and </think> tokens")
        prefix, items = self.tokenize_batch(batch)
        prompts = [prefix + it for it in items for _ in range(sampling.n)]
        if any(len(p) == 0 for p in prompts):
            raise UserError("every prompt needs at least one token")
        gen = None
        if sampling.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(sampling.seed))
        # A shared prefix is prefilled once (batch 1, cached like the hidden-states prefix KV) and copied
        # into each row's cache; only the suffixes are prefilled per row.
        prefix_len = len(prefix) if self.prefix_reuse and prefix and all(len(it) > 0 for it in items) else 0
        out: list[Completion] = []
        self.last_generate_timing = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
        # decode steps read the KV cache once, GQA heads folded (sdpa would copy it 4x for the padding mask)
        with self._inference(), self._autocast_embeddings(), self._attn_impl(self._decode_name):
            for a in range(0, len(prompts), self.max_batch_size):
                out.extend(self._generate_chunk(prompts[a : a + self.max_batch_size], sampling, gen, prefix_len))
        return out

    def _model_forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any, decode: bool) -> torch.Tensor:
        kwargs = {self._cache_kw: cache}
        fwd = self._lm.forward
        if decode and self.compile_decode:
            if self._compiled_forward is None:
                self._compiled_forward = torch.compile(self._lm.forward, mode="reduce-overhead", fullgraph=False)
            fwd = self._compiled_forward
        out = fwd(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[:, -1, :].float()

    def _clock(self) -> float:
        """Wall time after the device finished its queued work (one sync per phase, not per step)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # --- one chunk of rows -------------------------------------------------------------------------------

    def _generate_chunk(
        self, prompts: list[list[int]], sampling: SamplingParams, gen: torch.Generator | None, prefix_len: int = 0
    ) -> list[Completion]:
        """Decode one batch of rows: layout, cache, prompt forward, step loop, completions. Row layout:
        [left pads][prompt], or with a reused prefix of `prefix_len` tokens [prefix][pads][suffix] (pads
        masked, positions contiguous over real tokens either way)."""
        states = self._start_states(prompts, sampling.thinking_budget)
        rows = self._layout_rows(prompts, prefix_len)
        t = rows.mask.shape[1]
        cache, step_mask = self._new_cache(rows.mask, t + sampling.max_new_tokens)
        pos = (rows.mask.cumsum(-1) - 1).clamp(min=0)[:, rows.prefix_len :]
        t0 = self._clock()
        if rows.prefix_len:
            self._copy_prefix_kv(cache, prompts[0][: rows.prefix_len], len(prompts))
        logits = self._model_forward(rows.ids, step_mask(t), pos, cache, decode=False)
        t1 = self._clock()
        next_pos = pos[:, -1:] + 1
        guide = start_guide(sampling, self.tokenizer, self.eos_ids, logits)  # structured outputs (constrained.py)

        def step(tok: torch.Tensor, i: int) -> torch.Tensor:  # the cache holds t + i tokens; this step adds one
            nonlocal next_pos
            logits = self._model_forward(tok[:, None], step_mask(t + i + 1), next_pos, cache, decode=True)
            next_pos = next_pos + 1
            return logits

        # Stop strings and the thinking budget need per-sequence host logic every step; without them the
        # loop stays on the device (no per-step sync, EOS handled by a mask) so the GPU can run ahead.
        host = sampling.thinking_budget is not None or bool(sampling.stop)
        if host:
            out = self._steps_on_host(logits, step, sampling, gen, states, guide)
        else:
            out = self._steps_on_device(logits, step, sampling, gen, guide)
        return self._completions(states, out, sampling, host, t_prefill=(t0, t1))

    def _start_states(self, prompts: list[list[int]], budget: int | None) -> list[_SeqState]:
        states = [_SeqState(prompt=p) for p in prompts]
        if budget is not None:  # a prompt may end inside an open thought
            for st in states:
                st.in_think = _last_index(st.prompt, self.think_open_id) > _last_index(st.prompt, self.think_close_id)
        return states

    def _layout_rows(self, prompts: list[list[int]], p: int) -> _Rows:
        """Left-pad the rows (after the reused prefix, if any); for a static cache, round the width up."""
        b = len(prompts)
        if p:
            ids, smask = self._pad([q[p:] for q in prompts], "left")
            mask = torch.cat([torch.ones((b, p), dtype=torch.long, device=self.device), smask], 1)
        else:
            ids, mask = self._pad(prompts, "left")
        if self.kv_cache == "static":
            # Round the prompt width up (extra left pads, masked) so that batches of slightly different
            # prompt lengths share one static cache shape: no recompile / CUDA-graph re-capture per call.
            extra = (-mask.shape[1]) % _STATIC_PROMPT_BUCKET
            if extra:
                ids = torch.cat([torch.full((b, extra), self.pad_id, dtype=ids.dtype, device=ids.device), ids], 1)
                zeros = torch.zeros((b, extra), dtype=mask.dtype, device=mask.device)
                mask = torch.cat([mask[:, :p], zeros, mask[:, p:]], 1)
        return _Rows(ids, mask, p)

    def _new_cache(self, mask: torch.Tensor, total: int) -> tuple[Any, Callable[[int], torch.Tensor]]:
        """(KV cache for `total` = prompt width + new tokens, n -> the attention mask when the cache holds n
        tokens). Static: fixed-shape mask over the whole cache (left pads 0, everything else 1: causality
        hides the future), so the step's inputs never change shape (CUDA-graph friendly)."""
        from transformers import DynamicCache, StaticCache

        b, t = mask.shape
        full_mask = torch.ones((b, total), dtype=torch.long, device=self.device)
        full_mask[:, :t] = mask
        if self.kv_cache != "static":
            return DynamicCache(config=self._lm.config), lambda n: full_mask[:, :n]
        if self.compile_decode and self._static_cache is not None and self._static_cache[0] == (b, total):
            # Same buffers as last call: the compiled step's CUDA graphs stay valid (a new cache would mean
            # new static addresses and a re-capture).
            cache = self._static_cache[1]
            cache.reset()
        else:
            cache = StaticCache(config=self._lm.config, max_cache_len=total)
            if self.compile_decode:
                self._static_cache = ((b, total), cache)
        return cache, lambda n: full_mask

    def _copy_prefix_kv(self, cache: Any, prefix: list[int], b: int) -> None:
        """The prefix's cached per-layer KV (prefill's `_prefix_kv`, batch 1) copied into every row."""
        for i, (pk, pv) in enumerate(self._prefix_kv(prefix)):
            cache.update(pk.expand(b, -1, -1, -1).contiguous(), pv.expand(b, -1, -1, -1).contiguous(), i)

    # --- the step loop -----------------------------------------------------------------------------------

    def _steps_on_device(
        self, logits: torch.Tensor, step: StepFn, sampling: SamplingParams, gen: torch.Generator | None,
        guide: GuideState | None = None,
    ) -> _Steps:
        """Sample until max_new_tokens or every row hit EOS, without syncing per step: finished rows are
        padded by a mask; whether all are done is read back every 16 steps."""
        b, new = logits.shape[0], sampling.max_new_tokens
        toks = torch.full((b, new), self.pad_id, dtype=torch.long, device=self.device)
        lps = torch.zeros((b, new), dtype=torch.float32, device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        eos = torch.tensor(sorted(self.eos_ids) or [-1], device=self.device)
        steps = 0
        for i in range(new):
            tok, logp = _sample(logits, sampling, gen, guide)
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            toks[:, i] = tok
            if _guide_finished(guide, tok):
                break
            if sampling.logprobs:
                lps[:, i] = logp.gather(1, tok[:, None]).squeeze(1)
            steps = i + 1
            done = done | torch.isin(tok, eos)
            if (i % 16 == 15 and bool(done.all())) or i == new - 1:
                break
            logits = step(tok, i)
        return _Steps(toks, lps, steps)

    def _steps_on_host(
        self, logits: torch.Tensor, step: StepFn, sampling: SamplingParams, gen: torch.Generator | None,
        states: list[_SeqState], guide: GuideState | None = None,
    ) -> _Steps:
        """Sample with per-row host logic each step (one device->host copy, edited, copied back): forced
        thinking-close tokens, thinking-token counts, EOS and stop strings (`states` are updated)."""
        b, new, budget = logits.shape[0], sampling.max_new_tokens, sampling.thinking_budget
        close_ids = self._encode(self.thinking_close_text, first=False) if budget is not None else []
        max_stop = max((len(s) for s in sampling.stop), default=0)
        toks = torch.full((b, new), self.pad_id, dtype=torch.long, device=self.device)
        lps = torch.zeros((b, new), dtype=torch.float32, device=self.device)
        steps = 0
        for i in range(new):
            tok, logp = _sample(logits, sampling, gen, guide)
            tok_list = tok.tolist()
            self._host_step(states, tok_list, budget, close_ids)
            tok = torch.tensor(tok_list, dtype=torch.long, device=self.device)
            toks[:, i] = tok
            if _guide_finished(guide, tok):
                break
            if sampling.logprobs:
                lps[:, i] = logp.gather(1, tok[:, None]).squeeze(1)
            steps = i + 1
            self._host_after(states, tok_list, budget, sampling.stop, max_stop)
            if all(st.done for st in states) or i == new - 1:
                break
            logits = step(tok, i)
        return _Steps(toks, lps, steps)

    def _host_step(self, states: list[_SeqState], tok: list[int], budget: int | None, close_ids: list[int]) -> None:
        """Before a step's tokens are recorded: pad finished rows, force the thinking-close tokens."""
        for i, st in enumerate(states):
            if st.done:
                tok[i] = self.pad_id
                continue
            if budget is not None and st.in_think and not st.queue and st.thinking_tokens >= budget:
                st.queue = list(close_ids)
                st.in_think = False
                st.think_truncated = True
            if st.queue:
                tok[i] = st.queue.pop(0)
                st.forced.append(len(st.tokens))

    def _host_after(
        self, states: list[_SeqState], tok_host: list[int], budget: int | None, stop: Sequence[str], max_stop: int
    ) -> None:
        """After a step: record tokens, count thinking tokens, detect EOS and stop strings."""
        for i, st in enumerate(states):
            if st.done:
                continue
            x = tok_host[i]
            forced = bool(st.forced) and st.forced[-1] == len(st.tokens)
            st.tokens.append(x)
            if budget is not None and not forced:
                if x == self.think_open_id:
                    st.in_think = True
                elif x == self.think_close_id:
                    st.in_think = False
                elif st.in_think:
                    st.thinking_tokens += 1
            if x in self.eos_ids and not st.queue:
                st.done, st.finish = True, "stop"
            elif max_stop and not st.queue:
                tail = self.tokenizer.decode(st.tokens[-(max_stop + 1) :], skip_special_tokens=True)
                if any(s in tail for s in stop):
                    st.done, st.finish = True, "stop"

    # --- results ---------------------------------------------------------------------------------------------

    def _completions(
        self, states: list[_SeqState], out: _Steps, sampling: SamplingParams, host: bool, t_prefill: tuple[float, float]
    ) -> list[Completion]:
        """One device->host copy of the tokens (and logprobs), the phase times, then the completions. The
        device loop's rows end at their first EOS (kept); the host loop recorded its tokens already."""
        toks_host = out.toks[:, : out.steps].tolist()
        t2 = self._clock()
        t0, t1 = t_prefill
        timing = self.last_generate_timing
        timing["prefill_s"] += t1 - t0
        timing["decode_s"] += t2 - t1
        timing["decode_steps"] += out.steps
        lps_host = out.lps[:, : out.steps].tolist() if sampling.logprobs else None
        for i, st in enumerate(states):
            if host:
                n = len(st.tokens)
            else:
                row = toks_host[i]
                n = next((j + 1 for j, x in enumerate(row) if x in self.eos_ids), len(row))
                st.tokens = row[:n]
                st.finish = "stop" if n < len(row) or (row and row[n - 1] in self.eos_ids) else "length"
            st.logprobs = lps_host[i][:n] if lps_host is not None else []
        return [self._finish(st, sampling) for st in states]

    def _finish(self, st: _SeqState, sampling: SamplingParams) -> Completion:
        text = self.tokenizer.decode(st.tokens, skip_special_tokens=True)
        cut = [text.find(s) for s in sampling.stop if s and s in text]
        if cut:
            text = text[: min(cut)]
        finish = st.finish
        if finish != "length" and st.think_truncated:
            finish = "budget"
        return Completion(
            token_ids=list(st.tokens),
            text=text,
            logprobs=list(st.logprobs) if sampling.logprobs else None,
            finish_reason=finish,
            prompt_token_ids=list(st.prompt),
            thinking_tokens=st.thinking_tokens,
            forced_token_indices=list(st.forced),
        )
