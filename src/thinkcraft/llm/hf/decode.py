"""Generation: continuous batching over a slot KV cache (token in, token out).

Requests (`GenerationRequest`: prompt ids, sampling, an optional shared-prefix length and episode key) are
submitted, join the running decode batch at the next step boundary and leave it as soon as they end; their
results (`GenerationResult`) are polled (`batcher.py`). `generate(batch, sampling)` is a thin wrapper: it
submits every (item, sample) and steps until they are done. Temperature / top-p per row, stop strings, max
tokens, n samples per item, sampled-token logprobs (unmodified softmax), seeds (reproducible for a call that
runs alone), and a thinking budget for `<think>` models: after B thinking tokens the thought is closed with
`thinking_close_text` in the same sequence (forced tokens, marked) and the model answers.

KV cache: slots of the static cache (`slots.py`); the shared prefix stored once; an episode's KV kept between
turns (`slot_table.py`). `kv_cache` picks the decode attention width: "static" reads the whole slot every
step (one shape: one CUDA graph), "dynamic" a bucket of the longest running sequence. `compile_decode`
compiles the one-token step (torch.compile "reduce-overhead": CUDA graphs); without it the step runs eagerly
(the CPU path). Weights: `update_weights(state, version)` at a step boundary, versions recorded per token.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Hashable, Sequence

import torch

from thinkcraft.llm.hf.batcher import Batcher
from thinkcraft.llm.hf.rows import top_p_filter
from thinkcraft.llm.protocol import (
    Batch, Completion, EngineCapabilityError, GenerationRequest, GenerationResult, SamplingParams,
)
from thinkcraft.utils.errors import UserError

__all__ = ["DecodeMixin", "eos_ids_of", "top_p_filter"]


def eos_ids_of(lm: Any, tokenizer: Any) -> set[int]:
    """The ids that end a generation: the model's generation config's and config's EOS ids and the
    tokenizer's (what the engine stops on and a grammar's stop tokens are; a learner replaying constrained
    answers needs the same set)."""
    ids: set[int] = set()
    for src in (getattr(lm, "generation_config", None), lm.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class DecodeMixin:
    """`HFEngine`'s generation half. Reads the engine's model facts (`_lm`, `_dec`, `device`, `pad_id`,
    `tokenizer`, `max_batch_tokens`, `max_batch_size`, `prefix_reuse`), its contexts (`_on_partition`,
    `_autocast_embeddings`, `_attn_impl`), `_encode`, `tokenize_batch` and the prefill's cached `_prefix_kv`."""

    def _init_decode(self, kv_cache: str, compile_decode: bool, thinking_close_text: str, max_slots: int | None,
                     max_seq_len: int | None, evict: str, kv_cache_gb: float | None) -> None:
        if evict not in ("oldest", "longest"):
            raise UserError(f"evict must be 'oldest' or 'longest', got {evict!r}")
        if max_slots is not None and max_slots < 1:
            raise UserError(f"max_slots must be >= 1, got {max_slots}")
        if kv_cache_gb is not None and kv_cache_gb <= 0:
            raise UserError(f"kv_cache_gb must be > 0, got {kv_cache_gb}")
        self.kv_cache = kv_cache
        self.compile_decode = compile_decode
        self.last_generate_timing: dict[str, float] = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
        """Phase times of the last `generate` call (prefill = admissions; decode = the token loop)."""
        self.thinking_close_text = thinking_close_text
        self.eos_ids = self._eos_ids()
        vocab = self.tokenizer.get_vocab()
        self.think_open_id = vocab.get("<think>")
        self.think_close_id = vocab.get("</think>")
        self._batcher = Batcher(self, max_slots=max_slots or self.max_batch_size, max_seq_len=max_seq_len,
                                evict=evict, width=kv_cache, compile_step=compile_decode, kv_cache_gb=kv_cache_gb)

    def _eos_ids(self) -> set[int]:
        return eos_ids_of(self._lm, self.tokenizer)

    def _check_sampling(self, sampling: SamplingParams) -> SamplingParams:
        if sampling.n < 1 or sampling.max_new_tokens < 1:
            raise UserError("sampling.n and sampling.max_new_tokens must be ≥ 1")
        if sampling.thinking_budget is not None and (self.think_open_id is None or self.think_close_id is None):
            raise EngineCapabilityError("thinking_budget needs a model whose tokenizer has <think> and </think> tokens")
        return sampling

    # --- the synchronous wrapper ---------------------------------------------------------------------------

    def generate(self, batch: Batch, sampling: SamplingParams) -> list[Completion]:
        """Completions item-major (item0 × n, item1 × n, ...). Prompt = prefix + item token ids; a shared
        prefix is prefilled once and stored once (`prefix_reuse`)."""
        self._check_sampling(sampling)
        prefix, items = self.tokenize_batch(batch)
        prompts = [prefix + it for it in items]
        if any(len(p) == 0 for p in prompts):
            raise UserError("every prompt needs at least one token")
        p = len(prefix) if self.prefix_reuse and prefix and all(len(it) > 0 for it in items) else 0
        one = replace(sampling, n=1)
        b = self._batcher
        if not b.busy():  # a seeded call that runs alone is reproducible
            b.gen = None
            if sampling.seed is not None:
                b.gen = torch.Generator(device=self.device).manual_seed(int(sampling.seed))
        before = dict(b.counters)
        b.sync_timing = b._thread is None
        try:
            handles = [b.submit(GenerationRequest(pr, one, prefix_len=p)) for pr in prompts for _ in range(sampling.n)]
            done = b.run_until(handles)
        finally:
            b.sync_timing = False
        self.last_generate_timing = {k: b.counters[k] - before[k] for k in ("prefill_s", "decode_s", "decode_steps")}
        return [done[h].completion for h in handles]

    # --- continuous batching (Capabilities.continuous_batching) ---------------------------------------------

    def submit(self, request: GenerationRequest) -> int:
        """Queue a request (any thread); it joins the decode batch at the next step. Returns its handle."""
        return self._batcher.submit(request)

    def submit_many(self, requests: Sequence[GenerationRequest]) -> list[int]:
        """`submit` of each request, queued together (one lock, one wake-up); all checked before any is queued."""
        return self._batcher.submit_many(requests)

    def poll(self) -> list[GenerationResult]:
        """Results of the requests that finished since the last poll (any thread; never blocks)."""
        return self._batcher.poll()

    def step(self) -> bool:
        """One step boundary + one decode iteration, on the calling thread (the engine's thread does this
        after `start()`). True while submitted work remains."""
        return self._batcher.step()

    def admit(self) -> bool:
        """Prefill the queued requests without a decode iteration (`Batcher.admit`): they decode from the next
        `step`, in lockstep with the rows already admitted. True while submitted work remains."""
        return self._batcher.admit()

    def pending(self) -> int:
        """Submitted requests not finished yet."""
        return self._batcher.pending()

    def release(self, episode: Hashable) -> None:
        """The episode ended: drop the KV the engine keeps for it."""
        self._batcher.release(episode)

    def reserve(self, slots: int, tokens: int, prefix_tokens: int = 0) -> None:
        """Size the KV cache for `slots` sequences of up to `tokens` columns each (after a shared prefix of up
        to `prefix_tokens`), so that it is not rebuilt while episodes grow."""
        self._batcher.reserve(slots, tokens, prefix_tokens)

    def start(self, context: Callable[[], Any] | None = None) -> None:
        """Run the steps on the engine's own thread (inside `context()`, e.g. bf16 autocast) until `stop()`."""
        self._batcher.start(context)

    def stop(self) -> None:
        self._batcher.stop()

    def update_weights(self, state: Any, version: int) -> None:
        """New weights at the next decode-step boundary (never mid-step): `state` maps names to tensors (the
        whole model, or LoRA adapters only), copied into this engine's weights (same or another device); None
        when the engine shares the learner's parameters (they changed in place: only the version moves).
        Raises WeightUpdateError - and keeps the old weights and version - for tensors that do not fit, and its
        subclass StaleWeightsError for a version not newer than the current (or a queued) one. Running sequences continue under the new weights (their
        results say from which token); the KV of parked episodes and of the shared prefix is recomputed."""
        self._batcher.update_weights(state, version)

    def free_cache(self) -> None:
        """Give the slot KV cache's memory back (parked episodes' KV with it); allowed only while nothing is
        queued or running. The next request allocates a new one (and a compiled step records new graphs)."""
        if self._batcher.busy():
            raise UserError("free_cache: requests are still queued or running")
        self._batcher.free()

    @property
    def weights_version(self) -> int:
        return self._batcher.version

    def decode_metrics(self) -> dict[str, float]:
        """Cumulative counters: prefill / reused tokens, turn-KV fallbacks, evictions, invalidations, steps,
        generated tokens, weight updates, and the cache's size."""
        return self._batcher.metrics()
