"""Continuous batching: requests join the running decode batch at step boundaries, leave it when they end.

One `step()` is one boundary and one decode iteration:

    1. weight updates    queued `update_weights` calls are applied here, never inside an iteration
    2. admit             queued requests take slots (free, or a parked episode's own, or evicted) and their
                         new tokens are prefilled, packed (slots.PrefillCtx); their last logits join the batch
    3. launch            sample every slot, advance the thinking/EOS/length state (rows.py), hand the host a
                         small record (non-blocking copy), run the one-token forward of every slot
                         (slots.DecodeCtx: fixed shapes, optionally compiled with CUDA graphs)
    4. collect           read the record of the *previous* iteration (the device is already running this
                         one: one host sync per step, overlapped), append tokens (vectorised over slots),
                         finish rows that ended: their slot is free (or parked for their episode) at once

A row therefore learns it ended one iteration late; the device has already stopped it (EOS, max tokens and
the thinking budget are decided on the device). Stop strings are the one host-side end: the host cuts the
text and stops the row on the device before the next iteration.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

import numpy as np
import torch

from thinkcraft.llm import compat
from thinkcraft.llm.hf.rows import RowState, ThinkTokens, advance_rows, record, sample_rows
from thinkcraft.llm.hf.slot_table import FREE, PARKED, RUNNING, SlotTable, reuse_len
from thinkcraft.llm.hf.slots import DecodeCtx, PrefillCtx, SlotKV, prefill_kernel, register_slot_attention
from thinkcraft.llm.hf.weights import apply_state
from thinkcraft.llm.protocol import (
    Completion, EngineCapabilityError, GenerationRequest, GenerationResult, WeightUpdateError,
)
from thinkcraft.utils.errors import UserError

log = logging.getLogger(__name__)
_ROUND_TOKENS = 64
_WIDTH_BUCKET = 128
"""Attention widths of the "dynamic" step are multiples of this (few distinct shapes: few CUDA graphs)."""


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass
class _Seq:
    handle: int
    req: GenerationRequest
    prompt: np.ndarray
    slot: int = -1
    offset: int = 0
    versions: list[tuple[int, int]] = field(default_factory=list)
    prefill_tokens: int = 0
    reused_tokens: int = 0
    fallback: bool = False
    released: bool = False

    @property
    def need(self) -> int:
        """Slot columns this sequence may fill (prompt after the shared prefix + new tokens)."""
        return len(self.prompt) - self.req.prefix_len + self.req.sampling.max_new_tokens


@dataclass
class _Update:
    state: Any
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Batcher:
    """The continuous-batching scheduler of one `HFEngine` (see the module docstring)."""

    def __init__(self, eng: Any, *, max_slots: int, max_seq_len: int | None, evict: str, width: str,
                 compile_step: bool, kv_cache_gb: float | None = None) -> None:
        self.eng = eng
        self.kv_cache_gb = kv_cache_gb
        self.max_slots, self.max_seq_len, self.evict, self.width = max_slots, max_seq_len, evict, width
        self.compile_step = compile_step
        self._cv = threading.Condition(threading.RLock())
        self._step_lock = threading.Lock()
        self._queue: deque[_Seq] = deque()
        self._done: dict[int, GenerationResult] = {}
        self._claimed: set[int] = set()
        self._updates: list[_Update] = []
        self._next_handle = 0
        self.kv: SlotKV | None = None
        self.table = SlotTable(0, evict)  # type: ignore[arg-type]
        self.version = 0
        self._params_version: int | None = None
        self._prefix: np.ndarray | None = None
        self._reserve = (0, 0, 0)
        self._step_fn: Callable[..., torch.Tensor] | None = None
        self.gen: torch.Generator | None = None
        self.sync_timing = False
        self.counters: dict[str, float] = dict.fromkeys(
            ("prefill_tokens", "reused_tokens", "fallbacks", "evictions", "invalidated", "decode_steps",
             "generated_tokens", "requests", "prefill_s", "decode_s", "weight_updates"), 0.0)
        self._thread: threading.Thread | None = None
        self._stop_thread = False
        self._attn = register_slot_attention()

    # ------------------------------------------------------------------------------------------ public

    def submit(self, req: GenerationRequest) -> int:
        sp = self.eng._check_sampling(req.sampling)
        prompt = np.asarray(req.prompt, dtype=np.int64)
        if prompt.ndim != 1 or len(prompt) == 0:
            raise UserError("a generation request needs at least one prompt token")
        if not 0 <= req.prefix_len < len(prompt):
            raise UserError(f"prefix_len {req.prefix_len} must be in [0, {len(prompt)}) (the prompt's length)")
        seq = _Seq(-1, req, prompt)
        if self.max_seq_len is not None and seq.need > self.max_seq_len:
            raise UserError(
                f"one sequence needs {seq.need} tokens of KV ({len(prompt)} prompt tokens, {req.prefix_len} of them a "
                f"shared prefix, + {sp.max_new_tokens} new) but a slot holds at most {self.max_seq_len} "
                "(max_seq_len): raise max_seq_len or shorten the episode (fewer turns, less history)")
        with self._cv:
            seq.handle = self._next_handle
            self._next_handle += 1
            self._queue.append(seq)
            self.counters["requests"] += 1
            self._cv.notify_all()
        return seq.handle

    def poll(self) -> list[GenerationResult]:
        with self._cv:
            out = [r for h, r in self._done.items() if h not in self._claimed]
            for r in out:
                del self._done[r.handle]
            return out

    def pending(self) -> int:
        """Requests submitted and not yet finished."""
        with self._cv:
            return len(self._queue) + sum(s is not None for s in self._slot_seq) if self.kv else len(self._queue)

    def busy(self) -> bool:
        """Requests queued or running, or weight updates waiting (a record of an iteration in which every row
        had already ended is read with the next one)."""
        with self._cv:
            return bool(self._queue or self._updates) or (self.kv is not None and bool(self.h_run.any()))

    def release(self, episode: Hashable) -> None:
        with self._cv:
            if not self.table.release(episode):
                for s in (self._slot_seq if self.kv else []):
                    if s is not None and s.req.episode == episode:
                        s.released = True

    def reserve(self, slots: int, tokens: int, prefix_tokens: int = 0) -> None:
        """Size the cache for at least `slots` sequences of `tokens` KV columns each (after a shared prefix of
        up to `prefix_tokens`): allocated at the next admission if nothing runs (a rollout calls this once, so
        the cache - and a compiled step's graphs - are not rebuilt as episodes grow). Capped by `max_slots` and
        `max_seq_len`; the KV budget may give fewer slots (`_fit_slots`)."""
        if self.max_seq_len is not None:
            tokens = min(tokens, self.max_seq_len)
        self._reserve = (min(slots, self.max_slots), tokens, prefix_tokens)

    def step(self) -> bool:
        """One boundary + one decode iteration (see the module docstring); True while work remains."""
        with self._step_lock, self._contexts():
            self._apply_updates()
            t0 = self._clock()
            self._admit()
            t1 = self._clock()
            launched = self._launch()
            self._collect(drain=not launched)
            self.counters["prefill_s"] += t1 - t0
            self.counters["decode_s"] += self._clock() - t1
        with self._cv:
            self._cv.notify_all()
        return self.busy()

    def run_until(self, handles: list[int]) -> dict[int, GenerationResult]:
        """Step (or wait for the engine's thread) until these requests finished; their results."""
        with self._cv:
            self._claimed.update(handles)
        try:
            while True:
                with self._cv:
                    if all(h in self._done for h in handles):
                        return {h: self._done.pop(h) for h in handles}
                    if self._thread is not None:
                        self._cv.wait(0.05)
                        continue
                self.step()
        finally:
            with self._cv:
                self._claimed.difference_update(handles)

    def update_weights(self, state: Any, version: int) -> None:
        """Apply at the next step boundary (now, if no step is running); raises WeightUpdateError (stale version,
        bad tensors) and then the engine keeps its weights and version."""
        with self._cv:
            newest = max([self.version] + [u.version for u in self._updates])
            if version <= newest:
                raise WeightUpdateError(f"stale weight update: version {version} is not newer than {newest}; "
                                        "kept the current weights")
            u = _Update(state, version)
            self._updates.append(u)
            self._cv.notify_all()
        while not u.done.wait(0.01):
            if self._thread is None and self._step_lock.acquire(blocking=False):
                try:
                    with self._contexts():
                        self._apply_updates()
                finally:
                    self._step_lock.release()
        if u.error is not None:
            raise u.error

    def start(self, context: Callable[[], Any] | None = None) -> None:
        """Step on a background thread while there is work (inside `context()`, e.g. an autocast)."""
        if self._thread is not None:
            return
        self._stop_thread = False

        def loop() -> None:
            with (context() if context is not None else contextlib.nullcontext()):
                while not self._stop_thread:
                    if self.busy():
                        self.step()
                    else:
                        with self._cv:
                            self._cv.wait(0.05)

        self._thread = threading.Thread(target=loop, name="hf-engine-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        t, self._thread = self._thread, None
        if t is not None:
            self._stop_thread = True
            with self._cv:
                self._cv.notify_all()
            t.join()

    def free(self) -> None:
        """Drop the cache (and anything queued, running or unpolled): the engine is closing."""
        with self._step_lock, self._cv:
            self.kv, self._step_fn, self._prefix = None, None, None
            self.table = SlotTable(0, self.evict)  # type: ignore[arg-type]
            self._queue.clear()
            self._done.clear()

    def metrics(self) -> dict[str, float]:
        c = dict(self.counters)
        c["evictions"] = float(self.table.evictions)
        c["slots"] = float(len(self.table))
        c["slot_tokens"] = float(self.kv.tokens if self.kv else 0)
        c["weights_version"] = float(self.version)
        return c

    # ---------------------------------------------------------------------------------------- contexts

    @contextlib.contextmanager
    def _contexts(self) -> Iterator[None]:
        """No grad, eval mode (switched only if the learner left the model training: a module walk), the SM
        partition's stream, embeddings in the autocast dtype, the slot attention."""
        eng = self.eng
        was_training = eng.model.training
        if was_training:
            eng.model.eval()
        try:
            with torch.no_grad(), eng._on_partition(), eng._autocast_embeddings(), eng._attn_impl(self._attn):
                yield
        finally:
            if was_training:
                eng.model.train()

    def _clock(self) -> float:
        if self.sync_timing and self.eng.device.type == "cuda":
            torch.cuda.synchronize(self.eng.device)
        return time.perf_counter()

    # -------------------------------------------------------------------------------- cache allocation

    def _kv_dtype(self) -> torch.dtype:
        kind = self.eng.device.type
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else self.eng.dtype

    def _ensure_kv(self) -> None:
        """Allocate the cache, or grow it while nothing runs (parked episodes' KV is carried over): slots for
        the queue, columns for its longest request (rounded, so that growing episodes rarely reallocate)."""
        q = list(self._queue)
        want_slots, want_tokens, want_prefix = self._reserve
        want_slots = max(want_slots, min(self.max_slots, _round_up(len(q), 8)))
        want_tokens = _round_up(max([want_tokens] + [s.need for s in q]), _ROUND_TOKENS)
        want_prefix = _round_up(max([want_prefix] + [s.req.prefix_len for s in q]), _ROUND_TOKENS)
        dtype = self._kv_dtype()
        kv = self.kv
        if kv is not None and kv.dtype == dtype and want_tokens <= kv.tokens and want_prefix <= kv.prefix_cap \
                and (want_slots <= kv.slots or self._budget_limited):
            return
        if kv is not None and bool(self.h_run.any()):
            if kv.dtype != dtype:
                raise UserError(f"the engine's KV cache holds {kv.dtype} and this call computes in {dtype} while "
                                "sequences run: use one autocast setting for all calls")
            return  # requests that do not fit wait until the running ones end
        old = None
        if kv is not None:
            self._collect(drain=True)
            want_slots, want_tokens = max(want_slots, kv.slots), max(want_tokens, kv.tokens)
            want_prefix = max(want_prefix, kv.prefix_cap)
            if kv.dtype == dtype and bool((self.table.status == PARKED).any()):
                old = (kv, self.table, self._prefix)
            else:
                self.counters["evictions"] += self.table.drop_parked()
        try:
            self._allocate(want_slots, want_tokens, want_prefix, dtype)
        except torch.OutOfMemoryError:
            if old is None:
                raise
            # the old cache and the new one do not fit together: drop the parked episodes' KV instead
            self.counters["evictions"] += old[1].drop_parked()
            old = None
            self._allocate(want_slots, want_tokens, want_prefix, dtype)
        if old is not None:
            self._carry_over(*old)

    def _carry_over(self, kv: SlotKV, table: SlotTable, prefix: np.ndarray | None) -> None:
        """Parked episodes and the shared prefix from the old cache into the new, larger one (same slot
        indices; episodes whose slot no longer exists - a smaller KV budget - are evicted)."""
        new = self.kv
        parked = np.flatnonzero(table.status == PARKED)
        lost = parked[parked >= new.slots]
        for s in lost:
            table.free(int(s))
        table.evictions += len(lost)
        keep = torch.as_tensor(parked[parked < new.slots], device=new.device)
        if len(keep):
            for src, dst in zip(kv.keys + kv.values, new.keys + new.values):
                dst[keep, :, : kv.tokens] = src[keep, :, : kv.tokens]  # not the old scratch column
        for src, dst in zip(kv.prefix_keys + kv.prefix_values, new.prefix_keys + new.prefix_values):
            dst[:, :, : src.shape[2]].copy_(src)
        new.prefix_len, self._prefix = kv.prefix_len, prefix
        self.prefix_mask.copy_((new.pcols < new.prefix_len)[None, :].expand_as(self.prefix_mask))
        self.table.adopt(table)

    def _allocate(self, slots: int, tokens: int, prefix_cap: int, dtype: torch.dtype) -> None:
        eng = self.eng
        cfg = compat.text_config(eng._lm)
        hkv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        dev = eng.device
        self.kv = None  # free the old buffers first
        wanted = slots
        slots = self._fit_slots(slots, tokens, prefix_cap, SlotKV.bytes_per_token(eng.num_layers, hkv, head_dim, dtype))
        self._budget_limited = slots < wanted
        self.kv = SlotKV(eng.num_layers, slots, tokens, hkv, head_dim, prefix_cap, dtype, dev,
                         static_addresses=self.compile_step)
        self.table = SlotTable(slots, self.evict)  # type: ignore[arg-type]
        self.state = RowState.empty(slots, dev)
        self.prefix_mask = torch.zeros((slots, max(prefix_cap, 1)), dtype=torch.bool, device=dev)
        vocab = int(compat.lm_head(eng._lm).weight.shape[0])
        self.logits = torch.zeros((slots, vocab), dtype=torch.float32, device=dev)
        self._no_lp = torch.zeros(slots, dtype=torch.float32, device=dev)
        self._prefix = None
        self._slot_seq: list[_Seq | None] = [None] * slots
        self.h_run = np.zeros(slots, dtype=bool)
        self.h_admit = np.zeros(slots, dtype=np.int64)
        self.h_n = np.zeros(slots, dtype=np.int64)
        self.h_len = np.zeros(slots, dtype=np.int64)
        self.h_temp = np.zeros(slots, dtype=np.float32)
        self.h_topp = np.ones(slots, dtype=np.float32)
        self.h_wantlp = np.zeros(slots, dtype=bool)
        self.h_think = np.zeros(slots, dtype=np.int64)
        self.h_trunc = np.zeros(slots, dtype=bool)
        self._grow_host(1)
        pin = dev.type == "cuda"
        self._rec_host = [torch.zeros((slots, 5), dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._lp_host = [torch.zeros(slots, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._events: list[Any] = [None, None]
        self._iter = self._collected = 0
        self._think_key: Any = None
        self._step_fn = self._compiled_step() if self.compile_step else self._forward_last

    def _fit_slots(self, slots: int, tokens: int, prefix_cap: int, per_token: int) -> int:
        """As many of the wanted slots as the KV budget holds (`kv_cache_gb`; on CUDA by default 90% of the
        free memory): fewer slots than episodes means parked episodes get evicted (memory stays bounded).
        One sequence that alone exceeds the budget is a clear error."""
        budget = self.kv_cache_gb * 2**30 if self.kv_cache_gb is not None else None
        if budget is None and self.eng.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.eng.device)
            budget = 0.9 * free
        if budget is None:
            return slots
        per_slot = (tokens + 1) * per_token
        fit = int((budget - prefix_cap * per_token) // per_slot)
        if fit < 1:
            raise UserError(f"one sequence of {tokens} KV tokens needs {per_slot / 2**30:.2f} GiB, more than the KV "
                            f"cache budget of {budget / 2**30:.2f} GiB: shorten the episode, or raise kv_cache_gb / "
                            "free device memory")
        if fit < slots:
            log.warning("KV cache: %d of the %d wanted slots fit in %.1f GiB (%d tokens each); parked episodes will "
                        "be evicted", fit, slots, budget / 2**30, tokens)
        return min(slots, fit)

    def _grow_host(self, cap: int) -> None:
        old = getattr(self, "h_tok", None)
        if old is not None and old.shape[1] >= cap:
            return
        s = len(self.h_run)
        tok, lp, forced = np.zeros((s, cap), np.int64), np.zeros((s, cap), np.float32), np.zeros((s, cap), bool)
        if old is not None:
            n = old.shape[1]
            tok[:, :n], lp[:, :n], forced[:, :n] = self.h_tok, self.h_lp, self.h_forced
        self.h_tok, self.h_lp, self.h_forced = tok, lp, forced

    def _think_tokens(self) -> ThinkTokens:
        eng = self.eng
        key = (frozenset(eng.eos_ids), eng.thinking_close_text, eng.think_open_id, eng.think_close_id)
        if key != self._think_key:
            close = eng._encode(eng.thinking_close_text, first=False) if eng.think_close_id is not None else []
            dev = eng.device
            self._think = ThinkTokens(
                open_id=-1 if eng.think_open_id is None else int(eng.think_open_id),
                close_id=-1 if eng.think_close_id is None else int(eng.think_close_id),
                close_seq=torch.tensor(close or [eng.pad_id], dtype=torch.long, device=dev),
                eos=torch.tensor(sorted(eng.eos_ids) or [-1], dtype=torch.long, device=dev))
            self._think_key = key
        return self._think

    # ------------------------------------------------------------------------------------------ forward

    def _forward_last(self, ids: torch.Tensor, pos: torch.Tensor, ctx: Any, last: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """The decoder layers over `ids` with the slot attention, then the final norm and the LM head on the
        last token of each row (or, packed, on the positions `last`): (rows, V) float32 logits."""
        dec = self.eng._dec
        h = dec.embed_tokens(ids)
        pe = compat.rotary(dec, h, pos)
        for layer in dec.layers:
            h = compat.call_layer(layer, h, pos, pe, ctx)
        h = h[:, -1] if last is None else h[0, last]
        return compat.lm_head(self.eng._lm)(dec.norm(h)).float()

    def _compiled_step(self) -> Callable[..., torch.Tensor]:
        """The decode forward through torch.compile (CUDA graphs: "reduce-overhead"); eager, with one warning,
        if compiling fails. Its output is copied into the batcher's own logits buffer (graph outputs are
        overwritten by the next replay)."""
        compiled = torch.compile(self._forward_last, mode="reduce-overhead", fullgraph=False)
        failed = False

        def step(ids: torch.Tensor, pos: torch.Tensor, ctx: Any) -> torch.Tensor:
            nonlocal failed
            if not failed:
                try:
                    return self.logits.copy_(compiled(ids, pos, ctx))
                except Exception as e:  # noqa: BLE001 - any compiler failure: eager is always correct
                    failed = True
                    log.warning("compiled decode step unavailable (%s); running eager", e)
            return self._forward_last(ids, pos, ctx)

        return step

    # ------------------------------------------------------------------------------------------- admit

    def _admit(self) -> None:
        with self._cv:
            if not self._queue:
                return
        self._check_shared_weights()
        self._ensure_kv()
        kv, budget = self.kv, self.eng.max_batch_tokens
        chunk: list[tuple[_Seq, int, int]] = []  # (seq, slot, kept columns)
        new_tokens = key_tokens = 0
        while True:
            with self._cv:
                if not self._queue:
                    break
                seq = self._queue[0]
                if seq.need > kv.tokens:
                    break  # waits until the cache can grow (nothing running)
                slot = self.table.take(seq.req.episode)
                if slot is None:
                    break
                self._queue.popleft()
            offset = self._prefix_for(seq, chunk)
            keep, fallback = 0, False
            if self.table.status[slot] == PARKED:
                keep, fallback = reuse_len(self.table, slot, seq.prompt, offset, self.version)
            if len(seq.prompt) - offset + seq.req.sampling.max_new_tokens > kv.tokens:
                offset, keep = 0, 0  # the prefix could not be shared and the whole prompt does not fit: wait
                with self._cv:
                    self.table.free(slot)
                    self._queue.appendleft(seq)
                break
            self.table.run(slot, seq.req.episode, offset)
            seq.slot, seq.offset, seq.fallback = slot, offset, fallback
            seq.reused_tokens = offset + keep
            seq.prefill_tokens = len(seq.prompt) - seq.reused_tokens
            n_new, n_keys = seq.prefill_tokens, keep + seq.prefill_tokens + offset
            if chunk and (new_tokens + n_new > budget or key_tokens + n_keys > 4 * budget):
                self._prefill(chunk)
                chunk, new_tokens, key_tokens = [], 0, 0
            chunk.append((seq, slot, keep))
            new_tokens, key_tokens = new_tokens + n_new, key_tokens + n_keys
        if chunk:
            self._prefill(chunk)

    def _prefix_for(self, seq: _Seq, chunk: list) -> int:
        """The shared-prefix length this request's columns start after: its `prefix_len` when that prefix is
        the installed one (or can be installed: no running or parked row reads the old one), else 0."""
        p = seq.req.prefix_len
        if p <= 0 or not self.eng.prefix_reuse or p > self.kv.prefix_cap:
            return 0
        pre = seq.prompt[:p]
        if self._prefix is not None and len(self._prefix) == p and np.array_equal(self._prefix, pre):
            return p
        if self.table.uses_prefix() or any(s.offset > 0 for s, _, _ in chunk):
            return 0
        self.kv.set_prefix(self.eng._prefix_kv(pre.tolist()))
        self._prefix = pre
        self.prefix_mask.copy_((self.kv.pcols < p)[None, :].expand_as(self.prefix_mask))
        return p

    def _prefill(self, chunk: list[tuple[_Seq, int, int]]) -> None:
        """Prefill the new tokens of `chunk`'s rows packed into one sequence; their last logits join the batch
        and their slots' device state is set."""
        eng, kv = self.eng, self.kv
        dev = eng.device
        slots = np.array([s for _, s, _ in chunk], dtype=np.int64)
        keep = np.array([k for _, _, k in chunk], dtype=np.int64)
        offs = np.array([q.offset for q, _, _ in chunk], dtype=np.int64)
        news = [q.prompt[q.offset + k:] for q, _, k in chunk]
        n_new = np.array([len(x) for x in news], dtype=np.int64)
        total = keep + n_new
        tok_slot = np.repeat(slots, n_new)
        tok_col = np.concatenate([np.arange(k, t) for k, t in zip(keep, total)])
        ids = torch.from_numpy(np.concatenate(news)).to(dev)[None]
        pos = torch.from_numpy(tok_col + np.repeat(offs, n_new)).to(dev)[None]
        gather_col = np.concatenate([np.arange(t) for t in total])
        gather_slot = np.repeat(slots, total)
        p = kv.prefix_len if (offs > 0).any() else 0
        key_index = None
        k_len = total + np.where(offs > 0, p, 0)
        if p:
            starts = np.concatenate([[0], np.cumsum(total)[:-1]]) + p
            key_index = torch.from_numpy(np.concatenate([
                np.concatenate([np.arange(p) if o > 0 else np.zeros(0, np.int64), np.arange(s, s + t)])
                for o, s, t in zip(offs, starts, total)])).to(dev)
        cu_q = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(k_len)]).astype(np.int32)
        t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        ctx = PrefillCtx(kv.keys, kv.values, kv.prefix_keys if p else None, kv.prefix_values if p else None, p,
                         t(tok_slot), t(tok_col), t(gather_slot), t(gather_col), key_index, t(cu_q), t(cu_k),
                         int(n_new.max()), int(k_len.max()), prefill_kernel(dev, kv.dtype))
        logits = self._forward_last(ids, pos, ctx, last=t(cu_q[1:].astype(np.int64) - 1))
        idx = t(slots)
        self.logits[idx] = logits
        self._start_rows(chunk, slots, total, offs)
        self.counters["prefill_tokens"] += float(n_new.sum())
        self.counters["reused_tokens"] += float(sum(q.reused_tokens for q, _, _ in chunk))
        self.counters["fallbacks"] += float(sum(q.fallback for q, _, _ in chunk))

    def _start_rows(self, chunk: list[tuple[_Seq, int, int]], slots: np.ndarray, length: np.ndarray,
                    offs: np.ndarray) -> None:
        """Device and host state of freshly prefilled rows: active from the next iteration on."""
        eng = self.eng
        sps = [q.req.sampling for q, _, _ in chunk]
        think_open, think_close = eng.think_open_id, eng.think_close_id
        in_think = [think_open is not None and _last(q.prompt, think_open) > _last(q.prompt, think_close)
                    for q, _, _ in chunk]
        budget = [sp.thinking_budget if sp.thinking_budget is not None else 1 << 40 for sp in sps]
        ints = np.stack([np.ones(len(slots)), np.zeros(len(slots)), [sp.max_new_tokens for sp in sps], in_think,
                         np.zeros(len(slots)), budget, -np.ones(len(slots)), np.zeros(len(slots)), length, offs], 1)
        floats = np.array([[sp.temperature, sp.top_p] for sp in sps], dtype=np.float32)
        dev = eng.device
        idx = torch.from_numpy(slots).to(dev)
        iv = torch.from_numpy(ints.astype(np.int64)).to(dev)
        fv = torch.from_numpy(floats).to(dev)
        st = self.state
        for j, name in enumerate(("active", "n_gen", "max_new", "in_think", "think_tokens", "budget", "force_pos",
                                  "truncated", "length", "offset")):
            tgt = getattr(st, name)
            tgt[idx] = iv[:, j].to(tgt.dtype)
        st.temperature[idx] = fv[:, 0]
        st.top_p[idx] = fv[:, 1]
        p = self.kv.prefix_len
        self.prefix_mask[idx] = (self.kv.pcols[None, :] < p) & (torch.from_numpy(offs).to(dev) > 0)[:, None]
        self._grow_host(max(sp.max_new_tokens for sp in sps))
        self.h_run[slots] = True
        self.h_admit[slots] = self._iter
        self.h_n[slots] = 0
        self.h_len[slots] = length
        self.h_temp[slots] = floats[:, 0]
        self.h_topp[slots] = floats[:, 1]
        self.h_wantlp[slots] = [sp.logprobs for sp in sps]
        for q, s, _ in chunk:
            q.versions = [(0, self.version)]
            self._slot_seq[s] = q

    # ------------------------------------------------------------------------------------------ launch

    def _launch(self) -> bool:
        if self.kv is None:
            return False
        k = self._iter
        rows = self.h_run & (self.h_admit <= k)
        if not rows.any():
            return False
        kv, st = self.kv, self.state
        any_sampled = bool((self.h_temp[rows] > 0).any())
        any_top_p = bool((self.h_topp[rows] < 1).any())
        tok = sample_rows(self.logits, st.temperature, st.top_p, any_sampled, any_top_p, self.gen)
        st, tok, forced, done = advance_rows(st, tok, self._think_tokens())
        if self.h_wantlp[rows].any():
            lp = torch.log_softmax(self.logits, dim=-1).gather(1, tok[:, None]).squeeze(1)
        else:
            lp = self._no_lp
        buf = k % 2
        self._rec_host[buf].copy_(record(tok, done, forced, st), non_blocking=True)
        self._lp_host[buf].copy_(lp, non_blocking=True)
        if self.eng.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._events[buf] = ev
        nxt = st.active & ~done
        write_col = torch.where(nxt, st.length, kv.tokens)
        pos = st.offset + st.length
        length = st.length + nxt.long()
        key_len = torch.where(nxt, length, 1)
        self.state = st._replace(active=nxt, length=length)
        self.h_len[rows] += 1
        width = kv.tokens
        if self.width == "dynamic":
            width = min(kv.tokens, _round_up(int(self.h_len[self.h_run].max()) + 1, _WIDTH_BUCKET))
        use_prefix = kv.prefix_len > 0 and bool(self.table.uses_prefix())
        ctx = DecodeCtx(kv.keys, kv.values, kv.prefix_keys if use_prefix else None,
                        kv.prefix_values if use_prefix else None, kv.rows, write_col, key_len, kv.cols[:width],
                        self.prefix_mask)
        self.logits = self._step_fn(tok[:, None], pos[:, None], ctx)
        self._iter += 1
        self.counters["decode_steps"] += 1
        return True

    # ----------------------------------------------------------------------------------------- collect

    def _collect(self, drain: bool) -> None:
        """Read the records of finished iterations (all of them with `drain`, else all but the newest, which
        the device is still computing) and finish the rows that ended."""
        if self.kv is None:
            return
        while self._collected < self._iter - (0 if drain else 1):
            k = self._collected
            buf = k % 2
            if self._events[buf] is not None:
                self._events[buf].synchronize()
            rows = np.flatnonzero(self.h_run & (self.h_admit <= k))
            self._collected += 1
            if not len(rows):
                continue
            rec = self._rec_host[buf].numpy()[rows]
            n = self.h_n[rows]
            self.h_tok[rows, n] = rec[:, 0]
            self.h_lp[rows, n] = self._lp_host[buf].numpy()[rows]
            self.h_forced[rows, n] = rec[:, 2].astype(bool)
            self.h_n[rows] = n + 1
            self.h_think[rows] = rec[:, 3]
            self.h_trunc[rows] = rec[:, 4].astype(bool)
            self.counters["generated_tokens"] += len(rows)
            ended = [(int(s), "device") for s in rows[rec[:, 1] == 1]]
            ended += [(int(s), "stop") for s in rows[rec[:, 1] == 0] if self._hit_stop(int(s))]
            if ended:
                self._finish(ended)

    def _hit_stop(self, s: int) -> bool:
        stop = self._slot_seq[s].req.sampling.stop
        if not stop:
            return False
        n = self.h_n[s]
        if self._forcing(s):
            return False
        tail = self.eng.tokenizer.decode(self.h_tok[s, max(0, n - 1 - max(len(x) for x in stop)):n].tolist(),
                                         skip_special_tokens=True)
        return any(x in tail for x in stop)

    def _forcing(self, s: int) -> bool:
        """Is the row inside its forced close sequence, tokens of it still to come (stop strings wait)?"""
        n, c = int(self.h_n[s]), len(self._think.close_seq)
        forced = np.flatnonzero(self.h_forced[s, :n])
        return 0 < len(forced) < c

    # ------------------------------------------------------------------------------------------ finish

    def _finish(self, ended: list[tuple[int, str]]) -> None:
        """Completions of the rows that ended; their slots are freed (or parked for their episode) and the
        device stops them (rows the host ended on a stop string are still running there)."""
        eng = self.eng
        slots = [s for s, _ in ended]
        toks = [self.h_tok[s, : self.h_n[s]].tolist() for s in slots]
        texts = eng.tokenizer.batch_decode(toks, skip_special_tokens=True)
        idx = torch.as_tensor(slots, device=eng.device)
        self.state.active[idx] = False
        results = []
        for (s, how), tokens, text in zip(ended, toks, texts):
            seq = self._slot_seq[s]
            sp = seq.req.sampling
            n = len(tokens)
            cut = [text.find(x) for x in sp.stop if x and x in text]
            if cut:
                text = text[: min(cut)]
            forced = np.flatnonzero(self.h_forced[s, :n]).tolist()
            if how == "stop" or (tokens[-1] in eng.eos_ids and (n - 1) not in forced):
                finish = "stop"
            else:
                finish = "length"
            if finish != "length" and self.h_trunc[s]:
                finish = "budget"
            comp = Completion(token_ids=tokens, text=text,
                              logprobs=self.h_lp[s, :n].tolist() if sp.logprobs else None, finish_reason=finish,
                              prompt_token_ids=seq.prompt.tolist(), thinking_tokens=int(self.h_think[s]),
                              forced_token_indices=forced)
            results.append(GenerationResult(
                handle=seq.handle, completion=comp, tag=seq.req.tag, episode=seq.req.episode,
                weight_versions=list(seq.versions), prefill_tokens=seq.prefill_tokens,
                reused_tokens=seq.reused_tokens, kv_fallback=seq.fallback, thinking_budget=sp.thinking_budget))
            self.h_run[s] = False
            self._slot_seq[s] = None
            keep = (seq.req.episode is not None and not seq.released and len(seq.versions) == 1
                    and seq.versions[0][1] == self.version)
            with self._cv:
                if keep:
                    self.table.park(s, np.concatenate([seq.prompt, np.asarray(tokens[:-1], dtype=np.int64)]),
                                    seq.offset, self.version)
                else:
                    self.table.free(s)
        with self._cv:
            for r in results:
                self._done[r.handle] = r
            self._cv.notify_all()

    # ---------------------------------------------------------------------------------- weight versions

    def _apply_updates(self) -> None:
        with self._cv:
            ups, self._updates = self._updates, []
        for u in ups:
            try:
                if u.version <= self.version:
                    raise WeightUpdateError(f"stale weight update: version {u.version} is not newer than "
                                            f"{self.version}; kept the current weights")
                if self.kv is not None:
                    self._collect(drain=True)  # the host knows every row's exact token count
                if u.state is not None:
                    apply_state(self.eng.model, u.state, u.version)
                self._switch_version(u.version)
            except BaseException as e:  # noqa: BLE001 - handed to the caller of update_weights
                u.error = e if isinstance(e, WeightUpdateError) else WeightUpdateError(
                    f"weight update to version {u.version} failed ({type(e).__name__}: {e}); kept version "
                    f"{self.version}")
            finally:
                u.done.set()

    def _switch_version(self, version: int) -> None:
        """Running rows go on under the new weights (AReaL's partial rollouts), recording where: the next
        token still comes from logits of the old weights, the one after from the new. Parked episodes' KV and
        the shared prefix's are recomputed (safe default: a turn never starts on KV of older weights)."""
        self.version = version
        self.counters["weight_updates"] += 1
        if self.kv is not None:
            for s in np.flatnonzero(self.h_run):
                self._slot_seq[s].versions.append((int(self.h_n[s]) + 1, version))
        self._invalidate()
        self._params_version = self._params_now()

    def _invalidate(self) -> None:
        with self._cv:
            self.counters["invalidated"] += self.table.drop_parked()
        self._prefix = None
        self.eng.invalidate_prefix_cache()

    def _params_now(self) -> int | None:
        return compat.weights_version(self.eng._lm.parameters()) if self.eng._weight_update else None

    def _check_shared_weights(self) -> None:
        """An engine sharing the learner's parameters sees optimizer steps as in-place changes: drop KV that
        older weights computed (prefix, parked episodes) before admitting anything."""
        now = self._params_now()
        if now is not None and now != self._params_version:
            if self._params_version is not None:
                self._invalidate()
            self._params_version = now


def _last(ids: np.ndarray, x: int | None) -> int:
    if x is None:
        return -1
    hit = np.flatnonzero(ids == x)
    return int(hit[-1]) if len(hit) else -1
