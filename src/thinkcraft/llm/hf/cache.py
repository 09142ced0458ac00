"""The batcher's KV cache: allocation and growth within the KV budget, and the forward passes over it.

The cache (`slots.SlotKV`) is allocated at the first admission, sized for the queue and the caller's
`reserve` (with headroom), and grown only while nothing runs (parked episodes are carried over). The decode
forward runs the decoder layers with the slot attention, eagerly or through torch.compile with CUDA graphs.

A new cache means new shapes and buffers for the compiled step: torch.compile recompiles (the slot width is a
graph shape, the scratch column a specialised int) and CUDA graphs are recorded again - about 100 s for the
Qwen2.5-0.5B shape on an H100. So a cache is not rebuilt for what a rollout merely estimates a little higher
than the last one (`_HEADROOM`), and its KV budget is measured once (`_kv_budget`), not from what a learner
sharing the GPU holds at the time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from thinkcraft.llm import compat
from thinkcraft.llm.hf import split_decode
from thinkcraft.llm.hf.guides import SlotGuides
from thinkcraft.llm.hf.rows import (
    RowState, Step, ThinkTokens, advance_and_place_flat, sample_rows_lse, token_logprobs, unflatten_step,
)
from thinkcraft.llm.hf.slot_table import PARKED, SlotTable
from thinkcraft.llm.hf.slots import (DecodeCtx, SlotKV, decode_kernel, flash_decode_meta, per_forward,
                                     prefill_inplace_kernel)
from thinkcraft.llm.protocol import GenerationRequest
from thinkcraft.utils.errors import UserError, env_switch
from thinkcraft.utils.fallback import OrEager, compiled_or_eager

log = logging.getLogger(__name__)


def log_cache_events() -> None:
    """This module's INFO lines - each KV-cache allocation and decode-graph capture, a few a run - to the process's
    stderr (with time and thread). Why: a capture in the middle of a run costs ~25-40 s with every other engine and
    the learner waiting, and a process that configures no logging (a Ray engine actor: Ray forwards its stderr to the
    driver's output; a benchmark) otherwise says nothing about it (4 x H200, 2026-11-29: two actors captured again
    at steps 3 and 7, no line said why). Idempotent."""
    import sys

    if any(getattr(h, "_tc_cache_events", False) for h in log.handlers):
        return
    h = logging.StreamHandler(sys.stderr)
    h._tc_cache_events = True  # type: ignore[attr-defined]
    h.setFormatter(logging.Formatter("%(asctime)s [%(threadName)s] %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)


_ROUND_TOKENS = 64
"""Slot lengths and prefix capacities are multiples of this (growing episodes rarely reallocate)."""
_WIDTH_BUCKET = 128
"""Attention widths of the "dynamic" step are multiples of this (few distinct shapes: few CUDA graphs)."""


DEFAULT_KV_FRACTION = 0.5
"""Share of the free GPU memory the slot KV cache may take when `kv_cache_gb` is not given."""
_HEADROOM = 0.125
"""Extra slot columns a cache is allocated with (as the budget allows). A rollout reserves from its own first
prompts, so the reservation varies from rollout to rollout and an exact fit is outgrown by the next one:
Craftax, 256 envs, the Qwen2.5-0.5B BPE, steps 0-29 reserve 1,304 to 1,496 columns (step 0: 1,328, step 1:
1,416); 1/8 over step 0's is 1,536. Not more: the "static" width reads every column at every decode step."""


def _device_free_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device (None elsewhere: no default budget)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass
class Seq:
    """A submitted request as the batcher tracks it."""

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


class CacheMixin:
    """`Batcher`'s cache half (reads `eng`, `max_slots`, `kv_cache_gb`, `compile_step`, `counters`, `_queue`,
    `_reserve`, `_collect`)."""

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
        want_tokens = _round_up(max([want_tokens] + [self._need(s) for s in q]), _ROUND_TOKENS)
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
        kv = None  # no reference to the old buffers while the new ones are allocated (unless carried over)
        try:
            self._allocate(want_slots, want_tokens, want_prefix, dtype)
        except torch.OutOfMemoryError:
            if old is None and (self.kv_cache_gb is not None or self._free_budget is None):
                raise
            # the old cache and the new one do not fit together (drop the parked episodes' KV instead), or the
            # memory the default budget was measured in has gone to a learner since (measure it again)
            if old is not None:
                self.counters["evictions"] += old[1].drop_parked()
                old = None
            self._free_budget = None
            self._allocate(want_slots, want_tokens, want_prefix, dtype)
        if old is not None:
            self._carry_over(*old)

    def _need(self, seq: Seq) -> int:
        """Slot columns `seq` needs: after its shared prefix if that is (or may become) the installed one."""
        p = seq.req.prefix_len
        shared = p > 0 and self.eng.prefix_reuse and (self._prefix is None or (
            len(self._prefix) == p and np.array_equal(self._prefix, seq.prompt[:p])))
        return seq.need if shared else len(seq.prompt) + seq.req.sampling.max_new_tokens

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
        slots, tokens = self._fit_slots(slots, tokens, prefix_cap,
                                        SlotKV.bytes_per_token(eng.num_layers, hkv, head_dim, dtype))
        self._budget_limited = slots < wanted
        self.kv = SlotKV(eng.num_layers, slots, tokens, hkv, head_dim, prefix_cap, dtype, dev,
                         static_addresses=self.compile_step)
        # FlashAttention over the slots on CUDA (slots.py `decode_kernel`): its fixed arguments, once per cache
        self._flash = flash_decode_meta(self.kv, int(cfg.num_attention_heads), decode_kernel(dev, dtype, head_dim))
        # and the split-KV decode (split_decode.py), which serves in its place where its check passed
        self._split = split_decode.meta(dev, dtype, head_dim, int(cfg.num_attention_heads), hkv)
        # and the prefill's (slots.py `prefill_inplace_kernel`): the keys read in place, no gather
        self._flash_prefill = prefill_inplace_kernel(dev, dtype, head_dim)
        # each allocation means new shapes and buffers: with a compiled step, a recompile and new CUDA graphs
        self.counters["cache_allocations"] += 1
        log.info("KV cache allocated: %d slots x %d tokens (+ %d prefix), %.2f GiB (allocation %d); decode attention: "
                 "%s; prefill attention: %s", slots, tokens, prefix_cap, self.kv.nbytes / 2**30,
                 int(self.counters["cache_allocations"]),
                 "split-KV over the slots and the prefix" if self._split is not None else
                 "FlashAttention over the slots" if self._flash is not None else "matmuls over the slot width",
                 "in place" if self._flash_prefill is not None else "gathered")
        self.table = SlotTable(slots, self.evict)  # type: ignore[arg-type]
        self.state = RowState.empty(slots, dev)
        self.prefix_mask = torch.zeros((slots, max(prefix_cap, 1)), dtype=torch.bool, device=dev)
        vocab = int(compat.lm_head(eng._lm).weight.shape[0])
        self.logits = torch.zeros((slots, vocab), dtype=torch.float32, device=dev)
        self._no_lp = torch.zeros(slots, dtype=torch.float32, device=dev)
        # the one-pass sampler's noise seed (fused_sampler.py), read and advanced on the device at every step (a
        # graph replays both); from the process's torch seed without drawing from its generator
        first = torch.initial_seed() % (1 << 31) + int(self.counters["cache_allocations"])
        self._sample_seed = torch.tensor([first], dtype=torch.long, device=dev)
        self._prefix = None
        self._slot_seq: list[Seq | None] = [None] * slots
        self.h_run = np.zeros(slots, dtype=bool)
        self.h_admit = np.zeros(slots, dtype=np.int64)
        self.h_n = np.zeros(slots, dtype=np.int64)
        self.h_len = np.zeros(slots, dtype=np.int64)
        self.h_temp = np.zeros(slots, dtype=np.float32)
        self.h_topp = np.ones(slots, dtype=np.float32)
        self.h_wantlp = np.zeros(slots, dtype=bool)
        self.h_stop = np.zeros(slots, dtype=bool)  # the row has stop strings (the host checks only those)
        self.h_think = np.zeros(slots, dtype=np.int64)
        self.h_trunc = np.zeros(slots, dtype=bool)
        self.h_max = np.zeros(slots, dtype=np.int64)
        self.h_tok = None  # the host token rows are per slot: a new slot count needs new ones (_grow_host)
        self.guides = SlotGuides(eng, slots, dev)
        self._grow_host(1)
        pin = dev.type == "cuda"
        ring = max(2, self._ahead + 1)  # records not read yet: the one in flight + a block ahead (`_launch_ahead`)
        self._rec_host = [torch.zeros((slots, 5), dtype=torch.long, pin_memory=pin) for _ in range(ring)]
        self._lp_host = [torch.zeros(slots, dtype=torch.float32, pin_memory=pin) for _ in range(ring)]
        self._events: list[Any] = [None] * ring
        self._iter = self._collected = 0
        self._think_key: Any = None
        self._fused_fn = None
        if not self.compile_step:
            self._step_fn = self._forward_last
        elif decode_graphs() == "manual" and dev.type == "cuda":
            self._step_fn = self._manual_graph_step()
        else:
            self._step_fn = self._compiled_step()
        flat = compiled_or_eager(advance_and_place_flat, "decode bookkeeping", log) if self.compile_step else advance_and_place_flat

        def advance(st: RowState, tok: torch.Tensor, think: ThinkTokens, scratch_col: int) -> Step:
            return unflatten_step(flat(tuple(st), tok, tuple(think), scratch_col))

        self._advance = advance

    def _kv_budget(self) -> float | None:
        """The KV budget in bytes: `kv_cache_gb`, or on CUDA half the free memory at the first allocation - the
        cache lives as long as the engine, and a learner sharing the GPU allocates its optimizer state and
        activations after the first rollout. Kept for later allocations: measured again then, the learner's
        memory (and the old cache's, held by torch's allocator) would shrink the cache at every regrowth.
        None: unbounded (CPU)."""
        if self.kv_cache_gb is not None:
            return self.kv_cache_gb * 2**30
        if self._free_budget is None:
            free = _device_free_bytes(self.eng.device)
            self._free_budget = None if free is None else DEFAULT_KV_FRACTION * free
        return self._free_budget

    def _fit_slots(self, slots: int, tokens: int, prefix_cap: int, per_token: int) -> tuple[int, int]:
        """(slots, columns each): as many of the wanted slots as the KV budget (`_kv_budget`) holds - fewer
        slots than episodes means parked episodes get evicted (memory stays bounded) - with `tokens` columns
        and up to `_HEADROOM` more where the budget holds every wanted slot with them (never fewer slots for
        headroom; capped at `max_seq_len`). One sequence that alone exceeds the budget is a clear error."""
        room = _round_up(int(tokens * (1 + _HEADROOM)), _ROUND_TOKENS)
        if self.max_seq_len is not None:
            room = min(room, _round_up(self.max_seq_len, _ROUND_TOKENS))
        budget = self._kv_budget()
        if budget is None:
            return slots, max(tokens, room)
        most = int((budget - prefix_cap * per_token) // (slots * per_token)) - 1  # columns + scratch, every slot
        tokens = max(tokens, min(room, most // _ROUND_TOKENS * _ROUND_TOKENS))
        per_slot = (tokens + 1) * per_token
        fit = int((budget - prefix_cap * per_token) // per_slot)
        if fit < 1:
            raise UserError(f"one sequence of {tokens} KV tokens needs {per_slot / 2**30:.2f} GiB, more than the KV "
                            f"cache budget of {budget / 2**30:.2f} GiB: shorten the episode, or raise kv_cache_gb / "
                            "free device memory")
        if fit < slots:
            log.warning("KV cache: %d of the %d wanted slots fit in %.1f GiB (%d tokens each); parked episodes will "
                        "be evicted", fit, slots, budget / 2**30, tokens)
        return min(slots, fit), tokens

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
        ctx = per_forward(ctx)
        h = dec.embed_tokens(ids)
        pe = compat.rotary(dec, h, pos)
        for layer in dec.layers:
            h = compat.call_layer(layer, h, pos, pe, ctx)
        h = h[:, -1] if last is None else h[0, last]
        return compat.lm_head(self.eng._lm)(dec.norm(h)).float()

    def _fused_iteration(self, forward: Callable[..., torch.Tensor], width: int, use_prefix: bool,
                         any_sampled: bool, any_top_p: bool, want_lp: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode iteration's device work with no host decision inside, what `_launch_unfused` launches
        piece by piece: sample from the logits buffer (the default generator), advance the rows' state (written
        back into its own buffers), the sampled tokens' log-probs, the one-token `forward` into the logits
        buffer. Returns (record, log-probs) for the host. `_manual_graph_step` captures it whole in one CUDA
        graph: one replay a step instead of ~40 launches and a compiled call's guards."""
        kv, st = self.kv, self.state
        tok, lse = sample_rows_lse(self.logits, st.temperature, st.top_p, any_sampled, any_top_p, None,
                                   self._sample_seed)
        step = self._advance(st, tok, self._think_tokens(), kv.tokens)
        if want_lp:
            lp = token_logprobs(self.logits, step.tokens, lse)
        else:
            lp = self._no_lp
        ctx = DecodeCtx(kv.keys, kv.values, kv.prefix_keys if use_prefix else None,
                        kv.prefix_values if use_prefix else None, kv.rows, step.write_col, step.key_len,
                        kv.cols[:width], self.prefix_mask, self._flash, self._split)
        out = forward(step.tokens[:, None], step.pos[:, None], ctx)
        for dst, src in zip(st, step.state):
            if src is not dst:
                dst.copy_(src)
        self.logits.copy_(out)
        return step.record, lp

    def _prefill_forward(self) -> Callable[..., torch.Tensor]:
        """The packed prefill's forward (`_forward_last` over a `PrefillCtx`): eager by default; through
        torch.compile with dynamic shapes (no CUDA graphs: every prefill has its own token and key counts) when
        THINKCRAFT_PREFILL_COMPILE=1 (`prefill_compiled`), eager for good after a compiler failure (one
        warning). Why: the eager prefill is bound by the host - a py-spy of the Craftax llm-policy rollout
        (H200, 2026-11-27, bench/results/llm_policy_craftax_profile.json) spent 33% of the rollout thread in
        it, 24% in PEFT's LoRA `Linear.forward` alone, for ~186k new tokens of a 0.5B model per step that the
        GPU computes in well under a second. One compiled graph per layer stack replaces ~50 Python-level
        module calls per layer."""
        fn = getattr(self, "_prefill_fn", None)
        if fn is None:
            if prefill_compiled():
                compiled = torch.compile(self._forward_last, dynamic=True)

                def traced(*args: Any) -> torch.Tensor:
                    # no "duck sizing": a first turn's key count equals its token count (nothing kept yet), and
                    # a symbol shared on that coincidence compiled the whole stack again at the second turn
                    with compat.no_duck_shapes():
                        return compiled(*args)

                fn = OrEager(traced, self._forward_last, "compiled prefill", log)
            else:
                fn = self._forward_last
            self._prefill_fn = fn
        return fn

    def _prefill_traced(self) -> bool:
        """Whether the packed prefill runs traced (its attention kernel must then be loop-free on the CPU)."""
        return isinstance(self._prefill_forward(), OrEager)

    def _graph_mode(self) -> tuple:
        """What a captured forward decided on the host and every replay keeps: the autocast dtype (False: none) and
        whether the LoRA adapters are off (a graph per combination; the prefix graph's key too)."""
        kind = self.eng.device.type
        lora = getattr(self.eng, "_lora_layers", None)
        return (torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind),
                bool(lora and lora[0].disable_adapters))

    def _compiled_step(self) -> Callable[..., torch.Tensor]:
        """The decode forward through torch.compile (CUDA graphs: "reduce-overhead"); eager, with one warning,
        if compiling fails. Its output is copied into the batcher's own logits buffer (graph outputs are
        overwritten by the next replay)."""
        compiled = torch.compile(self._forward_last, mode="reduce-overhead", fullgraph=False)

        def step(ids: torch.Tensor, pos: torch.Tensor, ctx: Any) -> torch.Tensor:
            compat.ensure_cudagraph_thread_state()  # the async pools step engines from their own threads
            return self.logits.copy_(compiled(ids, pos, ctx))

        return OrEager(step, self._forward_last, "compiled decode step", log)

    def _manual_graph_step(self) -> Callable[..., torch.Tensor]:
        """The default on CUDA (`THINKCRAFT_DECODE_GRAPHS=manual`): the decode forward through torch.compile
        (inductor kernels, no CUDA graph trees) captured by hand in one `torch.cuda.CUDAGraph` per (shared
        prefix or not, width, autocast dtype) and replayed with `graph.replay()` - what vLLM and SGLang do.
        Why: the synchronous decode loop is host-bound (H100, 2026-11-27: 3.22 ms per step, 0.75 ms of it
        waiting for the device), and a graph-tree call checks its ~500 inputs (parameters, 4 x layers KV
        tensors) on every step; a replay checks nothing. So this step checks what the graph read by address:
        the step's four per-step inputs are copied into the graph's own buffers, and a graph is captured again
        when a parameter's or the cache's storage moved (a learner that reassigns tensors; a new cache gets a
        new step function anyway). Any failure: one warning, then eager. Measured against the graph trees on an
        H100 (2026-11-27, bench/results/logs/s28_h100_*): Craftax llm-policy at 256 envs 8.1 vs 10.4 ms per
        decode step (214 rows), the async arith loop 3.64 vs 3.92 ms, the sync arith loop 3.06 vs 3.11 ms.
        A capture holds `CAPTURE_GATE` alone: one capture at a time in the process (torch allows one; two engines'
        slot threads, one engine per GPU, would otherwise capture at once) and no other engine's decode step
        meanwhile (see `CaptureGate`); each capture runs on a stream of its engine's device."""
        compiled = torch.compile(self._forward_last, dynamic=decode_dynamic(self.width), options=decode_autotune())
        # where each parameter lives (module, name), read again at every step: a learner that assigns a new
        # tensor to `module.weight` leaves the old Parameter object behind, so a list of them would not see it
        owners = [(m, n) for m in self.eng._lm.modules() for n, p in m._parameters.items() if p is not None]
        graphs: dict[Any, Any] = {}
        # the Parameter objects, resolved again only when a Parameter is registered somewhere (a reassignment):
        # walking `m._parameters[n]` for ~500 parameters cost 0.8 ms of host time a step (cProfile, H200,
        # 2026-11-28, a host-bound 2.9 ms step at 64 rows); a storage swapped under a Parameter moves its data_ptr
        params: list[Any] = []
        epoch = [-1]

        def addresses(ctx: Any) -> tuple[int, ...]:
            if epoch[0] != compat.parameter_epoch():
                params[:] = [m._parameters[n] for m, n in owners]
                epoch[0] = compat.parameter_epoch()
            fixed = [ctx.keys[0], ctx.values[-1], ctx.rows, ctx.cols, ctx.prefix_mask]
            if ctx.prefix_keys is not None:
                fixed.append(ctx.prefix_keys[0])
            return tuple(t.data_ptr() for t in fixed) + tuple(p.data_ptr() for p in params)

        def capture(ids: torch.Tensor, pos: torch.Tensor, ctx: Any) -> Any:
            ids_s, pos_s = ids.clone(), pos.clone()
            ctx_s = ctx._replace(write_col=ctx.write_col.clone(), key_len=ctx.key_len.clone())
            t_wait = time.perf_counter()
            with CAPTURE_GATE.exclusive():
                t0 = time.perf_counter()
                replay, out = _graph_capture(lambda: compiled(ids_s, pos_s, ctx_s), ids.device)
            t1 = time.perf_counter()
            # a new width (or prefix / dtype) compiles and captures again: counted and timed, so that a slow first
            # step says whether compiles were the time (the 2-GPU async runs' first steps, 2026-11-27)
            self.counters["graph_captures"] += 1
            self.counters["graph_capture_s"] += t1 - t_wait
            log.info("decode graph %d captured on %s (width %d, prefix %s): %.1f s, %.1f s of it waiting for another "
                     "capture or other engines' steps", int(self.counters["graph_captures"]), ids.device,
                     ctx.cols.shape[0], ctx.prefix_keys is not None, t1 - t_wait, t0 - t_wait)
            return replay, ids_s, pos_s, ctx_s, out, addresses(ctx)

        def step(ids: torch.Tensor, pos: torch.Tensor, ctx: Any) -> torch.Tensor:
            key = (ctx.prefix_keys is not None, ctx.cols.shape[0]) + self._graph_mode()
            entry = graphs.get(key)
            if entry is None or entry[5] != addresses(ctx):
                entry = graphs[key] = capture(ids, pos, ctx)
            replay, ids_s, pos_s, ctx_s, out, _ = entry
            with CAPTURE_GATE.shared():  # no step of any engine while one captures (CaptureGate says why)
                ids_s.copy_(ids)
                pos_s.copy_(pos)
                ctx_s.write_col.copy_(ctx.write_col)
                ctx_s.key_len.copy_(ctx.key_len)
                replay()
            return self.logits.copy_(out)

        def fused(width: int, use_prefix: bool, any_sampled: bool, any_top_p: bool, want_lp: bool) -> Any:
            """`_fused_iteration` through one hand-captured graph per (shape, flags); (record, log-probs)."""
            kv, think = self.kv, self._think_tokens()
            key = ("fused", use_prefix, width) + self._graph_mode() + (any_sampled, any_top_p, want_lp)
            probe = DecodeCtx(kv.keys, kv.values, kv.prefix_keys if use_prefix else None, None, kv.rows, kv.rows,
                              kv.rows, kv.cols[:width], self.prefix_mask)
            addr = addresses(probe) + tuple(t.data_ptr() for t in self.state) + (self.logits.data_ptr(), id(think))
            entry = graphs.get(key)
            if entry is None or entry[2] != addr:
                entry = graphs[key] = capture_fused(width, use_prefix, any_sampled, any_top_p, want_lp) + (addr, think)
            replay, out = entry[0], entry[1]
            with CAPTURE_GATE.shared():
                replay()
            return out

        def capture_fused(width: int, use_prefix: bool, *flags: bool) -> tuple[Any, Any]:
            # the capture's warm-up runs the iteration for real (twice: it advances the rows and samples): the
            # rows' state and the logits are put back afterwards, and the replay that follows is the real step
            # (the warm-ups' KV writes land in columns the rows write again before they read them)
            saved = [t.clone() for t in self.state] + [self.logits.clone()]
            t_wait = time.perf_counter()
            try:
                with CAPTURE_GATE.exclusive():
                    t0 = time.perf_counter()
                    replay, out = _graph_capture(
                        lambda: self._fused_iteration(compiled, width, use_prefix, *flags), self.eng.device)
            finally:
                for dst, src in zip(list(self.state) + [self.logits], saved):
                    dst.copy_(src)
            t1 = time.perf_counter()
            self.counters["graph_captures"] += 1
            self.counters["graph_capture_s"] += t1 - t_wait
            log.info("fused decode graph %d captured on %s (width %d, prefix %s, flags %s): %.1f s, %.1f s of it "
                     "waiting for another capture or other engines' steps", int(self.counters["graph_captures"]),
                     self.eng.device, width, use_prefix, flags, t1 - t_wait, t0 - t_wait)
            return replay, out

        if fused_decode():
            self._fused_fn = OrEager(fused, lambda *a: None, "fused decode graph", log,
                                     on_failure=lambda: [graphs.pop(k) for k in list(graphs) if k[0] == "fused"])
        return OrEager(step, self._forward_last, "manually captured decode step", log, on_failure=graphs.clear)


def _graph_capture(run: Callable[[], torch.Tensor], device: torch.device, pool: Any = None
                   ) -> tuple[Callable[[], Any], torch.Tensor]:
    """(replay, out): `run` warmed up on a side stream (it compiles there; a decode step's KV writes are the
    step's own, written again by the replay), then captured in one CUDA graph whose replay refreshes `out`.
    `pool` (`torch.cuda.graph_pool_handle()`): a memory pool shared with other graphs never replayed at once."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA calls (a learner on another GPU) must not break the capture.
    # stream=side, on the engine's device: torch.cuda.graph's default capture stream is one per process,
    # created on whichever device was current at the first capture - an engine on cuda:1 would capture on a
    # cuda:0 stream after an engine on cuda:0 captured first
    with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
        out = run()
    return graph.replay, out


class CaptureGate:
    """Decode steps share the gate; a decode graph's compile and capture hold it alone (`_manual_graph_step`).

    Why exclusive, and not only one capture at a time: torch allows only one CUDA graph capture underway in a
    process, and the 2-GPU async runs of 2026-11-27 (bench/results/logs/s31_h200x4_async_2gpu_*.log) showed the
    second engine's compile never ending (over 7 minutes, against ~45 s alone) while the first engine stepped
    from its own thread - and no Python thread able to run for 20 s. A capture now waits for the steps under way
    (each is a few ms) and holds new ones back until it ends: the other engines pause once per new graph shape
    (at the start, or a new width) instead of racing it. Writers first: a capture waiting blocks new steps, so a
    stream of steps cannot starve it. Not reentrant: a thread never captures inside its own shared hold.
    Measured with it (2 x H200, 2026-11-27, `.../s31_h200x2_async_2gpu_gate.log`): both engines captured (59 s,
    then 49 s after 57.5 s waiting) and the 2-GPU async run went on at 22.79 samples/s (sync: 16.85)."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._steps = 0
        self._capturing = False
        self.waited_s = 0.0
        """Seconds steps spent waiting for captures (all engines): the price of the gate."""

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cv:
            if self._capturing:
                t0 = time.perf_counter()
                while self._capturing:
                    self._cv.wait()
                waited = time.perf_counter() - t0
                self.waited_s += waited
                if waited > 1.0:
                    log.info("a decode step waited %.1f s for another engine's graph capture", waited)
            self._steps += 1
        try:
            yield
        finally:
            with self._cv:
                self._steps -= 1
                if self._steps == 0:
                    self._cv.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cv:
            while self._capturing:
                self._cv.wait()
            self._capturing = True  # from here on no new step starts
            while self._steps:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._capturing = False
                self._cv.notify_all()


CAPTURE_GATE = CaptureGate()
"""The process's one gate: every engine's manually captured decode step goes through it."""


def decode_graphs() -> str:
    """How a compiled decode step is graphed on CUDA, from THINKCRAFT_DECODE_GRAPHS: "manual" (the default:
    `CacheMixin._manual_graph_step`, one hand-captured CUDA graph per shape, replayed without checking its
    inputs) or "trees" (torch.compile's "reduce-overhead" CUDA graph trees, the default until 2026-11-27; their
    captures take no process-wide lock, so engines on several GPUs stepped from several threads may capture at
    once, which torch does not allow - the suspected cause of the 2-GPU async run's eager fallbacks)."""
    import os

    mode = os.environ.get("THINKCRAFT_DECODE_GRAPHS", "manual").strip().lower() or "manual"
    if mode not in ("trees", "manual"):
        raise UserError(f"THINKCRAFT_DECODE_GRAPHS must be 'trees' or 'manual', got {mode!r}")
    return mode


def fused_decode() -> bool:
    """THINKCRAFT_DECODE_FUSED ("1", the default; "0" off): with hand-captured decode graphs, an iteration with
    no grammar mask and no seeded generator is one graph replay - sampling, the rows' bookkeeping, the
    log-probs and the forward (`CacheMixin._fused_iteration`). Why: the decode loop is bound by the host, not the
    GPU - at 64 rows of the Qwen2.5-0.5B shape a 2.95 ms step left the device idle but 0.44 ms of it, and the
    sampling and the compiled bookkeeping's call were ~0.8 ms of its host time under cProfile (H200,
    2026-11-28, bench/probes/decode_step_probe.py --host-profile)."""
    return env_switch("THINKCRAFT_DECODE_FUSED", default=True)


def decode_dynamic(width: str = "static") -> bool | None:
    """The manually captured step's torch.compile `dynamic`, from THINKCRAFT_DECODE_DYNAMIC: "0" = False (every
    decode width - a multiple of 128 columns - compiles its own specialised graph); "1" = None (torch's
    automatic dynamic: the second width compiles one graph with a symbolic width that every later width reuses;
    the CUDA graphs are still captured per width); unset = None for the "dynamic" width (`kv_cache`), False for
    the "static" one (one width: nothing to share).
    Why the "dynamic" width's default: specialised, every width a rollout meets compiles anew - Craftax
    llm-policy at 256 envs (Qwen2.5-0.5B shape, H200, 2026-11-28, `bench/results/logs/s36_h200_craftax_dyn256.log`)
    had not finished its first step after 480 s, in the compile of yet another width (the static width's first
    step: 73 s). Why the switch exists at all: two engines (one per GPU) each compile every width they meet, one
    at a time, from threads that share the GIL with the rollout workers - suspected (2026-11-27) of the 2-GPU
    async runs' first steps of many minutes; that day's last runs (`bench/results/logs/s31_h200x4_async_2gpu_*.log`)
    met one width only and stalled alike with and without it: not the cause (`CaptureGate` ended the stall).
    `engine/graph_captures`, `engine/graph_capture_s` and the decode step's ms compare the two."""
    import os

    if os.environ.get("THINKCRAFT_DECODE_DYNAMIC", "").strip() == "":
        return None if width == "dynamic" else False
    return None if env_switch("THINKCRAFT_DECODE_DYNAMIC") else False


def decode_autotune() -> dict[str, Any] | None:
    """THINKCRAFT_DECODE_AUTOTUNE ("0", the default; "1" on): the hand-captured decode step compiled with inductor's
    GEMM autotuning (Triton templates timed against cuBLAS for each of the step's shapes, the fastest kept). Why
    it exists: at 248 rows of the Qwen2.5-0.5B shape the step's GEMMs are ~1.05 of its ~2.2 ms of kernels, cuBLAS's
    picks for the skinny q/k/v one moving 2 MB of weights in ~10 us (H200, 2026-12-01,
    bench/results/logs/s50_decode_profile_new_*). Why opt-in: measured there, no gain (the decode probe's step 2.60
    ms against 2.48 untuned, Triton templates picked for some GEMMs; s50_decode_profile_autotune_*), and the tuning
    adds seconds to minutes to the first compile. Other shapes may differ."""
    if not env_switch("THINKCRAFT_DECODE_AUTOTUNE"):
        return None
    return {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}


def prefill_compiled() -> bool:
    """THINKCRAFT_PREFILL_COMPILE: "1" runs the batcher's packed prefill through torch.compile
    (`CacheMixin._prefill_forward`), "0" or unset eagerly (the default until a GPU run shows the compiled one
    faster: bench/llm_policy_craftax.py --prefill-compile measures both)."""
    return env_switch("THINKCRAFT_PREFILL_COMPILE")
