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
from typing import Any, Callable, Hashable, Iterator, Sequence

import numpy as np
import torch

from thinkcraft.llm import compat
from thinkcraft.llm.hf import autocast_shadow, fused_mlp, fused_proj, fused_rope, fused_sampler, lora_fast
from thinkcraft.llm.hf.cache import CacheMixin, Seq
from thinkcraft.llm.hf.device_timing import DeviceTiming, device_timing_on
from thinkcraft.llm.hf.guides import compile_for
from thinkcraft.llm.hf.iteration import IterationMixin
from thinkcraft.llm.hf.prefill_graphs import PrefillGraphs, prefill_graphs_on
from thinkcraft.llm.hf.prefix_graph import PrefixGraph, prefix_graph_on
from thinkcraft.llm.hf.slot_table import SlotTable
from thinkcraft.llm.hf.slots import SlotKV, register_slot_attention
from thinkcraft.llm.hf.weights import apply_state
from thinkcraft.llm.protocol import (
    EngineError, GenerationRequest, GenerationResult, StaleWeightsError, WeightUpdateError,
)
from thinkcraft.utils.errors import UserError, env_int, env_switch

log = logging.getLogger(__name__)


AHEAD_MAX = 8


def decode_ahead() -> int:
    """THINKCRAFT_DECODE_AHEAD: decode iterations a step launches before the host reads a record (1, the default:
    one; up to `AHEAD_MAX`). More divides the engine's fixed host work per token - and, in a process whose learner
    runs beside the engine's thread, its share of the interpreter lock - by that much; not measured on a GPU yet."""
    return env_int("THINKCRAFT_DECODE_AHEAD", 1, least=1, most=AHEAD_MAX)


def skip_ended_launches() -> bool:
    """THINKCRAFT_SKIP_ENDED_LAUNCH: "1" (default) launches no decode iteration once every running row's last
    allowed token is in flight (iteration.py `_ends_in_flight`); "0" launches it as before (the A/B switch)."""
    return env_switch("THINKCRAFT_SKIP_ENDED_LAUNCH", default=True)


@dataclass
class _Update:
    state: Any
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Batcher(CacheMixin, IterationMixin):
    """The continuous-batching scheduler of one `HFEngine` (see the module docstring)."""

    def __init__(self, eng: Any, *, max_slots: int, max_seq_len: int | None, evict: str, width: str,
                 compile_step: bool, kv_cache_gb: float | None = None) -> None:
        self.eng = eng
        self.kv_cache_gb = kv_cache_gb
        self._free_budget: float | None = None  # the default KV budget, measured once (cache.py `_kv_budget`)
        self.max_slots, self.max_seq_len, self.evict, self.width = max_slots, max_seq_len, evict, width
        self.compile_step = compile_step
        self._cv = threading.Condition(threading.RLock())
        self._step_lock = threading.Lock()
        self._queue: deque[Seq] = deque()
        self._done: dict[int, GenerationResult] = {}
        self._claimed: set[int] = set()
        self._updates: list[_Update] = []
        self._next_handle = 0
        self.kv: SlotKV | None = None
        self.table = SlotTable(0, evict)  # type: ignore[arg-type]
        self.version = 0
        self._params_version: int | None = None
        self._param_list: tuple[Any, int, list] | None = None
        """(model, parameter epoch, its parameters) for `_params_now`: resolved again only when a Parameter was
        registered anywhere (`compat.parameter_epoch`) or the model changed."""
        self._prefix: np.ndarray | None = None
        self._pgraph: PrefixGraph | None = None  # the shared prefix's forward as a CUDA graph (prefix_graph.py)
        self._fgraphs: PrefillGraphs | None = None  # the packed prefill from CUDA graphs (prefill_graphs.py)
        self._sample_seed: torch.Tensor | None = None  # the one-pass sampler's seed (set with the cache)
        self._reserve = (0, 0, 0)
        self._step_fn: Callable[..., torch.Tensor] | None = None
        self._fused_fn: Callable[..., Any] | None = None  # the whole iteration as one graph (cache.py)
        self.gen: torch.Generator | None = None
        self.sync_timing = False
        self.counters: dict[str, float] = dict.fromkeys(
            ("prefill_tokens", "reused_tokens", "fallbacks", "evictions", "invalidated", "decode_steps",
             "generated_tokens", "requests", "prefill_s", "decode_s", "weight_updates", "failed",
             "host_length_ends", "decode_wait_s", "cache_allocations", "prefill_calls", "graph_captures",
             "graph_capture_s", "weight_drain_s", "weight_copy_s", "weight_switch_s", "prefix_recompute_s",
             "prefix_graph_replays", "prefix_graph_failed", "ahead_launches", "prefill_graph_captures",
             "prefill_graph_capture_s", "prefill_graph_replays", "prefill_graph_declined", "prefill_graph_failed",
             "launches_skipped", "prefill_pad_tokens"),
            0.0)
        self._ahead = decode_ahead()  # iterations launched per step before the host reads a record (opt-in)
        self._skip_ended = skip_ended_launches()  # no launch after every row's last token (iteration.py)
        self._device_wait_s = 0.0  # every wait for a record (collect); decode_wait_s: those inside decode_s
        # the phases timed on the device (opt-in diagnostic, device_timing.py): None off or off CUDA
        self._dtiming = DeviceTiming(eng.device) if device_timing_on() and eng.device.type == "cuda" else None
        self._thread: threading.Thread | None = None
        self._stop_thread = False
        self._restore_train = False
        self._attn = register_slot_attention()

    # ------------------------------------------------------------------------------------------ public

    def submit(self, req: GenerationRequest) -> int:
        return self.submit_many([req])[0]

    def submit_many(self, reqs: Sequence[GenerationRequest]) -> list[int]:
        """`submit` of each request, in order, queued together (one lock and one wake-up for all: the rollout's
        boundary submits 256 at once). Every request is checked before any is queued: a bad one queues none."""
        seqs = [self._checked(req) for req in reqs]
        with self._cv:
            for seq in seqs:
                seq.handle = self._next_handle
                self._next_handle += 1
                self._queue.append(seq)
            self.counters["requests"] += len(seqs)
            self._cv.notify_all()
        return [seq.handle for seq in seqs]

    def _checked(self, req: GenerationRequest) -> Seq:
        """The request's `Seq` (its handle still unset), or a UserError saying what is wrong with it."""
        sp = self.eng._check_sampling(req.sampling)
        prompt = self._prompt_array(req)
        if prompt.ndim != 1 or len(prompt) == 0:
            raise UserError("a generation request needs at least one prompt token")
        if not 0 <= req.prefix_len < len(prompt):
            raise UserError(f"prefix_len {req.prefix_len} must be in [0, {len(prompt)}) (the prompt's length)")
        if sp.structured is not None:
            compile_for(self.eng, sp.structured)  # a bad schema or no xgrammar: one line, now
        seq = Seq(-1, req, prompt)
        if self.max_seq_len is not None and seq.need > self.max_seq_len:
            raise UserError(
                f"one sequence needs {seq.need} tokens of KV ({len(prompt)} prompt tokens, {req.prefix_len} of them a "
                f"shared prefix, + {sp.max_new_tokens} new) but a slot holds at most {self.max_seq_len} "
                "(max_seq_len): raise max_seq_len or shorten the episode (fewer turns, less history)")
        return seq

    def _prompt_array(self, req: GenerationRequest) -> np.ndarray:
        """The request's prompt as an int64 array. A list that extends what its episode's parked slot holds
        (a multi-turn episode's next turn: previous prompt + reply + new observation) is the parked array + the
        new tail, after the lists compare equal: `np.asarray` of a whole ~1,500-token list was ~34 us a turn on a
        2-core CPU (~9 ms for 256 episodes, on the rollout's path between the env and the next prefill), the list
        comparison ~4 us. The result equals `np.asarray(req.prompt)` either way."""
        p = req.prompt
        if type(p) is list and req.episode is not None:
            with self._cv:
                s = self.table.parked(req.episode)
                head, arr = (self.table.token_lists[s], self.table.tokens[s]) if s is not None else (None, None)
            if head is not None and len(head) < len(p) and p[: len(head)] == head:  # (park sets both or only arr)
                return np.concatenate([arr, np.asarray(p[len(head):], dtype=np.int64)])
        return np.asarray(p, dtype=np.int64)

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
            try:
                t1 = self._boundary()
                w1 = self._device_wait_s
                launched = self._launch()
                if launched and self._ahead > 1:
                    self._launch_ahead()
                self._collect(drain=not launched)
                self.counters["decode_wait_s"] += self._device_wait_s - w1
            except BaseException as e:
                self._fail_all(e)
                raise
            self.counters["decode_s"] += time.perf_counter() - t1
        with self._cv:
            self._cv.notify_all()
        return self.busy()

    def admit(self) -> bool:
        """One step boundary without the decode iteration: pending weight updates applied, the queued requests
        prefilled (launched; the device runs them while the caller goes on) and made active - they decode from the
        next `step`, together with every row admitted before it. Why: a caller that builds a turn's prompts in
        chunks (the Craftax rollout) lets the device prefill one chunk while the host builds the next, and the
        whole turn still decodes in lockstep (a `step` between chunks would start the first chunk's decode a step
        ahead of the others, and their turns would come back apart). True while work remains."""
        with self._step_lock, self._contexts():
            try:
                self._boundary()
            except BaseException as e:
                self._fail_all(e)
                raise
        return self.busy()

    def _boundary(self) -> float:
        """A step boundary (under the step lock): weight updates, the derived copies, the queue's admission (timed
        into `prefill_s`); returns the clock after it."""
        self._apply_updates()
        self._refresh_copies()
        # a synchronous `generate` times prefill apart from decode: the device is drained after a step that
        # prefilled (its prefill time then holds up to one decode step's device time too), never at a plain decode
        # step - that stopped host and device from overlapping at every step
        calls = self.counters["prefill_calls"]
        t0 = time.perf_counter()
        self._admit()
        t1 = self._clock(self.counters["prefill_calls"] != calls)
        self.counters["prefill_s"] += t1 - t0
        return t1

    def _refresh_copies(self) -> None:
        """Bring the weights' derived copies up to date (in place): a graphed step - or the prefix graph - reads
        them, and cannot run the eager forward's own checks."""
        if getattr(self.eng, "_lora_fast", None):  # the adapters' copies
            lora_fast.refresh(self.eng._lora_fast)
        if getattr(self.eng, "_fused_proj", None):  # and the fused projections' (sources: the above)
            fused_proj.refresh(self.eng._fused_proj)
        self._autocast_shadows()

    def _autocast_shadows(self) -> None:
        """fp32 weights served under half-precision autocast (full fine-tuning's master weights, shared with the
        learner): their half copies, made at the first such step, refreshed before each (autocast_shadow.py)."""
        eng = self.eng
        kind = eng.device.type
        if eng.dtype != torch.float32 or not torch.is_autocast_enabled(kind):
            return
        if getattr(eng, "_shadow", None) is None:  # once, for the first half dtype met (a graph captured over the
            # shadows keeps them), within the device's allowance for derived copies
            eng._shadow = autocast_shadow.install(eng._lm, torch.get_autocast_dtype(kind))
        if eng._shadow:
            autocast_shadow.refresh(eng._shadow)

    def _fail_all(self, e: BaseException) -> None:
        """A step failed (a device error, an interrupt, a bug): every queued and running request ends with
        `error` set (never a half-updated slot left running), parked KV is dropped, and the cache starts
        clean at the next admission."""
        msg = f"{type(e).__name__}: {e}"
        with self._cv:
            seqs = list(self._queue) + [s for s in (self._slot_seq if self.kv is not None else []) if s is not None]
            self._queue.clear()
            for seq in seqs:
                self._done[seq.handle] = GenerationResult.failed(seq.handle, seq.req, msg)
            self.counters["failed"] += len(seqs)
            self.kv, self._step_fn, self._fused_fn, self._prefix = None, None, None, None
            self.table = SlotTable(0, self.evict)  # type: ignore[arg-type]
            if self._dtiming is not None:
                self._dtiming.forget()
            self._cv.notify_all()

    def run_until(self, handles: list[int]) -> dict[int, GenerationResult]:
        """Step (or wait for the engine's thread) until these requests finished; their results."""
        with self._cv:
            self._claimed.update(handles)
        try:
            while True:
                with self._cv:
                    if all(h in self._done for h in handles):
                        out = {h: self._done.pop(h) for h in handles}
                        failed = next((r.error for r in out.values() if r.error), None)
                        if failed:
                            raise EngineError(f"generation failed: {failed}")
                        return out
                    if self._thread is not None:
                        self._cv.wait(0.05)
                        continue
                self.step()
        except BaseException:
            with self._cv:  # the call failed: its requests' error results are not left for `poll`
                for h in handles:
                    self._done.pop(h, None)
            raise
        finally:
            with self._cv:
                self._claimed.difference_update(handles)

    def update_weights(self, state: Any, version: int) -> None:
        """Apply at the next step boundary (now, if no step is running); raises WeightUpdateError (bad tensors;
        StaleWeightsError for a stale version) and then the engine keeps its weights and version."""
        with self._cv:
            newest = max([self.version] + [u.version for u in self._updates])
            if version <= newest:
                raise StaleWeightsError(f"stale weight update: version {version} is not newer than {newest}; "
                                        "kept the current weights")
            u = _Update(state, version)
            self._updates.append(u)
            self._cv.notify_all()
        # no stepping thread of its own (a pool's slot thread steps it, and calls this between its steps): apply
        # at once when no step runs - a first wait of 10 ms before trying stalled every update by that much
        while not u.done.is_set():
            if self._thread is None and self._step_lock.acquire(blocking=False):
                try:
                    with self._contexts():
                        self._apply_updates()
                finally:
                    self._step_lock.release()
            u.done.wait(0.01)
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
                        try:
                            self.step()
                        except Exception:  # noqa: BLE001 - the requests in flight got error results; go on
                            log.exception("engine step failed; the requests in flight end with an error")
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
            self.kv, self._step_fn, self._fused_fn, self._prefix = None, None, None, None
            if self._fgraphs is not None:
                self._fgraphs.clear()  # their memory pool and buffers with the cache
            self._free_budget = None  # memory given back: the next cache measures the free memory again
            self.table = SlotTable(0, self.evict)  # type: ignore[arg-type]
            self._queue.clear()
            self._done.clear()

    def metrics(self) -> dict[str, float]:
        c = dict(self.counters)
        c["evictions"] = float(self.table.evictions)
        c["slots"] = float(len(self.table))
        c["slot_tokens"] = float(self.kv.tokens if self.kv else 0)
        c["kv_cache_gb"] = self.kv.nbytes / 2**30 if self.kv else 0.0
        c["weights_version"] = float(self.version)
        # sibling projections fused into one GEMM (fused_proj.py): the groups (two a layer where all apply, four with
        # LoRA on every linear: o_proj and down_proj alone), and those with the adapters' A inside the base GEMM
        groups = getattr(self.eng, "_fused_proj", None) or []
        c["fused_proj_groups"] = float(len(groups))
        c["fused_proj_folded"] = float(sum(g.fold for g in groups))
        # the decode step's slot attention: split_decode 1 for the split-KV kernels (split_decode.py), else
        # flash_decode 1 for FlashAttention over the slots in place, both 0 for the matmuls (slots.py)
        split = self.kv is not None and getattr(self, "_split", None) is not None
        c["split_decode"] = float(split)
        c["flash_decode"] = float(not split and self.kv is not None and getattr(self, "_flash", None) is not None)
        # the sampler: 1 where the one-pass kernel passed its check on this engine's device (fused_sampler.py; it
        # then samples every step whose rows sample without top-p), 0 torch's
        c["fused_sampler"] = float(fused_sampler.passed(self.eng.device))
        # the MLPs' fused silu(gate) * up (fused_mlp.py): 1 where it passed its check on this device and MLPs have it
        c["fused_mlp"] = float(bool(getattr(self.eng, "_fused_mlps", 0)) and fused_mlp.passed(self.eng.device))
        # of them, with a LoRA group's low-rank add inside the kernel (THINKCRAFT_FUSED_MLP_LORA)
        c["fused_mlp_lora"] = float(bool(c["fused_mlp"]) and fused_mlp.lora_passed(self.eng.device))
        # q's and k's rotary embedding as one kernel each in decode-sized forwards (fused_rope.py): 1 where it passed
        c["fused_rope"] = float(bool(getattr(self.eng, "_fused_ropes", 0)) and fused_rope.passed(self.eng.device))
        # the prefill's attention: 1 the keys read in place, 0 gathered per row (slots.py)
        c["flash_prefill"] = float(self.kv is not None and getattr(self, "_flash_prefill", None) is not None)
        return c

    # ---------------------------------------------------------------------------------------- contexts

    @contextlib.contextmanager
    def _contexts(self) -> Iterator[None]:
        """No grad, eval mode, the SM partition's stream, embeddings in the autocast dtype, the slot attention.
        A model the learner left training is switched to eval for as long as work remains, not per step
        (each switch walks every module: milliseconds a step on a large PEFT model), and back once idle."""
        eng = self.eng
        if eng.model.training:
            eng.model.eval()
            self._restore_train = True
        # the engine's GPU made current for the step: the caller's thread may have another one current (a slot
        # thread of the async pools, a learner on cuda:0 updating an engine on cuda:1), and what uses the
        # current device implicitly - the host copies' completion events, CUDA graph capture - must be this one
        on_device = torch.cuda.device(eng.device) if eng.device.type == "cuda" else contextlib.nullcontext()
        try:
            with on_device, torch.no_grad(), eng._on_partition(), eng._autocast_embeddings(), \
                    eng._attn_impl(self._attn):
                yield
        finally:
            if self._restore_train and not self.busy():
                eng.model.train()
                self._restore_train = False

    def _clock(self, sync: bool) -> float:
        """Now, after draining the device where `sync` and a synchronous `generate` times its phases."""
        if sync and self.sync_timing and self.eng.device.type == "cuda":
            torch.cuda.synchronize(self.eng.device)
        return time.perf_counter()
    # ---------------------------------------------------------------------------------- weight versions

    def _apply_updates(self) -> None:
        with self._cv:
            ups, self._updates = self._updates, []
        for u in ups:
            try:
                if u.version <= self.version:
                    raise StaleWeightsError(f"stale weight update: version {u.version} is not newer than "
                                            f"{self.version}; kept the current weights")
                # the update's phases timed (`engine/weight_*_s`): the engine stands still for all three (2 x
                # H200, 2026-11-29: 0.07-0.16 s an update, not the copy's device time - where is not known yet)
                t0 = time.perf_counter()
                if self.kv is not None:
                    self._collect(drain=True)  # the host knows every row's exact token count
                t1 = time.perf_counter()
                if u.state is not None:
                    apply_state(self.eng.model, u.state, u.version)
                t2 = time.perf_counter()
                self._switch_version(u.version)
                t3 = time.perf_counter()
                self.counters["weight_drain_s"] += t1 - t0
                self.counters["weight_copy_s"] += t2 - t1
                self.counters["weight_switch_s"] += t3 - t2
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
        """Weights changed: parked episodes' KV is dropped (their next turn is prefilled whole); the shared
        prefix's KV is recomputed in place, so running rows read it under the new weights from the next step
        and new requests keep sharing it."""
        with self._cv:
            self.counters["invalidated"] += self.table.drop_parked()
        self.eng.invalidate_prefix_cache()
        if self.kv is not None and self._prefix is not None:
            t0 = time.perf_counter()
            graph = self._prefix_graph()
            if graph is not None and not graph.failed:
                self._refresh_copies()  # the replay reads the derived weight copies as they are
            if graph is None or not graph.write(self.kv, self._prefix, self._weights_key()):
                self.kv.set_prefix(self.eng._prefix_kv(self._prefix.tolist()))
            self.counters["prefix_recompute_s"] += time.perf_counter() - t0
            if graph is not None:
                self.counters["prefix_graph_replays"] = graph.replays
                self.counters["prefix_graph_failed"] = float(graph.failed)

    def _prefix_graph(self) -> PrefixGraph | None:
        """The engine's prefix graph (prefix_graph.py) where it may serve: CUDA, no SM partition, the switch on."""
        eng = self.eng
        if self._pgraph is None:
            if eng.device.type != "cuda" or not prefix_graph_on():
                return None
            self._pgraph = PrefixGraph(eng._prefix_forward, eng.device)
        return None if getattr(eng, "_sm", None) is not None else self._pgraph

    def _prefill_graphs(self) -> PrefillGraphs | None:
        """The engine's prefill graphs (prefill_graphs.py) where they may serve: CUDA, no SM partition, the switch
        on (tests install a CPU stand-in in `_fgraphs`)."""
        eng = self.eng
        if self._fgraphs is None:
            if eng.device.type != "cuda" or not prefill_graphs_on():
                return None
            self._fgraphs = PrefillGraphs(self._forward_last, eng.device, eng.pad_id, int(self.logits.shape[1]))
        return None if getattr(eng, "_sm", None) is not None else self._fgraphs

    def _weights_key(self) -> tuple:
        """What a captured forward reads by address or decides by: every parameter's storage (a learner that
        reassigns a tensor moves it), the autocast dtype, adapters on or off."""
        return (tuple(p.data_ptr() for p in self._params()),) + self._graph_mode()

    def _params(self) -> list:
        """The model's parameters, listed again only when a module registers a new one (`compat.parameter_epoch`):
        walking the model's modules for them was ~5-15 ms of host work a call (0.5B shape with LoRA; H200 host,
        2026-12-03, cProfile) - at every turn's admission (`_params_now`) and every prefill a graph may serve
        (`_weights_key`), between the env step and the prefill, with the device idle. A storage swapped under the
        same Parameter (`p.data = t`) is seen by the callers, which read `data_ptr` / versions themselves."""
        lm, epoch = self.eng._lm, compat.parameter_epoch()
        if self._param_list is None or self._param_list[0] is not lm or self._param_list[1] != epoch:
            self._param_list = (lm, epoch, list(lm.parameters()))
        return self._param_list[2]

    def _params_now(self) -> int | None:
        """The shared weights' version (`compat.weights_version`), None for an engine with its own weights (the
        parameter list kept between calls: `_params`)."""
        if not self.eng._weight_update:
            return None
        return compat.weights_version(self._params())

    def _check_shared_weights(self) -> None:
        """An engine sharing the learner's parameters sees optimizer steps as in-place changes: drop KV that
        older weights computed (prefix, parked episodes) before admitting anything."""
        now = self._params_now()
        if now is not None and now != self._params_version:
            if self._params_version is not None:
                self._invalidate()
            self._params_version = now
