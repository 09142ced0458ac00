"""The continuous batcher's packed prefill replayed from CUDA graphs, one per bucketed shape.

Why: the rollout's prefill is bound by its host. One call of a Craftax turn (the Qwen2.5-0.5B shape, 256 rows,
~23k new tokens) launched ~90 ms of eager torch calls for ~75 ms of kernels, with 3-5 ms idle gaps on the device
before each of its phases (H200, 2026-12-02, `--profile-rollout`, BENCHMARKS §7b); and while the host launches,
it cannot do the work that follows (the new rows' state, the next decode step's launch). A replay launches the
whole forward at once: the device runs the kernels back to back and the host goes on meanwhile.

How: a call's shape - packed tokens N, rows B, the longest row's new tokens - is rounded up to a bucket
(`shape_of`: at most 1/16 more tokens), so the later turns of a rollout, whose shapes differ by a few hundred tokens,
share a few graphs; a shape's graph is captured at its second call (`CAPTURE_AFTER`: a shape met once stays eager),
at most `MAX_GRAPHS` of them. The padding is inert: pad tokens (the pad id at position 0) belong to no row, write their K/V
into slot 0's scratch column (which no row reads) and get an attention output of 0 (`FlashPrefill.valid`, so every
value they carry stays finite); the extra rows are empty (no new token, no key). FlashAttention's `max_q` and
`max_k` only bound the rows' counts (each row's own are in `cu_q` and `seqused_k`), so the bucket's longest row and
the slot's width serve every call in it. A call's host work is two host arrays copied into the graph's input
buffers (one int64, one int32), a replay, and its rows' logits out of the graph's output buffer.

Trust, but check: the first replay of each graph (and a second one, until one graph of its kind passed: `VERIFY`) is
compared bit for bit with the eager forward over the same padded inputs (the kernels and shapes are the graph's
own, so they must agree exactly); a difference, like any capture or replay error, turns the graphs off for good
with one warning, and the eager prefill runs (`prefill_graph_failed`). Only on CUDA with the in-place
FlashAttention prefill (`slots.prefill_inplace_kernel`), no SM partition, an eager prefill forward (not
THINKCRAFT_PREFILL_COMPILE), and calls of at most `MAX_TOKENS` packed tokens (larger ones stay eager: bound by
their kernels - the 256-env Craftax turn's ~23k tokens measured no faster replayed - with activations the graphs'
pool would otherwise keep).
THINKCRAFT_PREFILL_GRAPHS=0 turns it off (the A/B switch).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from thinkcraft.llm.hf.slots import FlashPrefill, PrefillCtx
from thinkcraft.utils.errors import env_int, env_switch

log = logging.getLogger(__name__)

MAX_TOKENS = 16384
"""Packed tokens above which a call runs eagerly: where the eager call's launches cost less than its kernels, a
replay saves no time. Measured on one H200 (2026-12-02, Craftax, the Qwen2.5-0.5B shape, steady steps after the
graphs' captures, BENCHMARKS §7b): 64 envs (~6k tokens a call) rollouts 0.90-0.97 s replayed against 0.97-1.07 s
eager; 256 envs (~23k a call) 1.67-1.89 s against 1.64-1.76 s - the device, not the host, bounds that prefill. The
crossover lies between; the graphs' shared pool then holds at most one call's activations of this size."""

CAPTURE_AFTER = 2
"""Calls of a shape before its graph is captured (at the last of them; the ones before run eagerly): a shape met
once - the async pools' prefills take whatever requests arrived, in chunks of any size - never pays a capture and its
check. A rollout's later turns repeat their shapes from one rollout to the next."""

MAX_GRAPHS = 32
"""Graphs kept; a new shape past them runs eagerly (no eviction: a stream of ever-new shapes must not capture at every
call). A Craftax rollout's later turns need a handful (64 envs, 2026-12-02: 7)."""

PAD_FINE = 64
"""The eager padded prefill's token buckets (`padded_forward`): a call's packed tokens rounded up to at most 1/64 more
(256 at a 256-env Craftax turn's ~23k: ~0.5% more tokens on average)."""

SEEN_MAX = 4096
"""Shapes whose calls are counted for `CAPTURE_AFTER` (least recently met forgotten first)."""

VERIFY = 2
"""Replays compared bit for bit with the eager forward before a graph is trusted: every graph's first (the capture's),
and a later call's until one graph of its kind (reading the shared prefix or not: the forward's two code paths)
passed that second check (new inputs: what a decision frozen on the host at capture time would get wrong - the same
in every graph of that path)."""


def prefill_graphs_on() -> bool:
    """THINKCRAFT_PREFILL_GRAPHS: "1" (default) replays the packed prefill from CUDA graphs where it may (module
    doc), "0" runs it eagerly."""
    return env_switch("THINKCRAFT_PREFILL_GRAPHS", default=True)


def prefill_pad_on() -> bool:
    """THINKCRAFT_PREFILL_PAD: "1" runs a prefill that no graph serves over its tokens padded to a bucket
    (`padded_forward`), "0" (the default) over its own count."""
    return env_switch("THINKCRAFT_PREFILL_PAD")


def bucket(n: int, fine: int, floor: int) -> int:
    """`n` rounded up to a multiple of its largest power of two below it / `fine` (at most 1/`fine` more), at least
    `floor`."""
    if n <= floor:
        return floor
    step = max((1 << (n.bit_length() - 1)) // fine, 1)
    return -(-n // step) * step


class PrefillCall(NamedTuple):
    """One packed prefill call on the host (what `IterationMixin._prefill` computed): B rows, N new tokens."""

    ids: np.ndarray
    """(N,) the new tokens, row after row; `pos` (N,) their positions, `tok_slot` / `tok_col` (N,) where their K/V
    go."""
    pos: np.ndarray
    tok_slot: np.ndarray
    tok_col: np.ndarray
    cu_q: np.ndarray
    """(B + 1,) int32 offsets of the rows' new tokens."""
    slots: np.ndarray
    """(B,) each row's slot; `used` (B,) its columns after the write (kept + new)."""
    used: np.ndarray
    reads_prefix: np.ndarray | None
    """(B,) bool: the rows reading the shared prefix (None: none does)."""


class Shape(NamedTuple):
    tokens: int
    rows: int
    max_q: int
    prefix_len: int


def shape_of(call: PrefillCall, prefix_len: int) -> Shape:
    """The bucket `call` runs in: its tokens to 1/16, its rows to 1/8, its longest row's new tokens to a power of two
    (FlashAttention's grid: blocks of queries a row); its keys are not part of it (`max_k` is the cache's width: the
    kernel reads each row's own count, `seqused_k`), so one rollout's later turns share a few graphs."""
    n_new = int(np.diff(call.cu_q).max())
    return Shape(bucket(len(call.ids), 16, 64), bucket(len(call.slots), 8, 8), bucket(max(n_new, 2), 1, 16),
                 prefix_len if call.reads_prefix is not None else 0)


def padded(call: PrefillCall, shape: Shape, pad_id: int, scratch_col: int, slot_stride: int, view_rows: int,
           prefix_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64, int32) host arrays of `call` padded to `shape` (module doc), laid out as `Inputs.views` reads them:
    int64 [ids, pos, tok_slot, tok_col (N each), last (B)]; int32 [cu_q (B + 1), starts (B + 1), used (B),
    valid (N), reads (N), prefix meta (5)]. `slot_stride` = Hkv x columns (a slot's rows in `attention.slot_rows`),
    `view_rows` that view's row count, `prefix_cols` the prefix buffer's columns."""
    n, b = len(call.ids), len(call.slots)
    nb, bb = shape.tokens, shape.rows
    i64 = np.zeros(4 * nb + bb, dtype=np.int64)
    i64[:n] = call.ids
    i64[n:nb] = pad_id
    i64[nb : nb + n] = call.pos  # pads at position 0
    i64[2 * nb : 2 * nb + n] = call.tok_slot  # pads: slot 0 ...
    i64[3 * nb : 3 * nb + n] = call.tok_col
    i64[3 * nb + n : 4 * nb] = scratch_col  # ... its scratch column
    i64[4 * nb : 4 * nb + b] = call.cu_q[1:].astype(np.int64) - 1  # each row's last token (empty rows: token 0)
    i32 = np.zeros(3 * bb + 2 + 2 * nb + 5, dtype=np.int32)
    i32[: b + 1] = call.cu_q
    i32[b + 1 : bb + 1] = call.cu_q[-1]  # empty rows
    s = bb + 1
    i32[s : s + b] = call.slots * slot_stride
    i32[s + bb] = view_rows
    s += bb + 1
    i32[s : s + b] = call.used
    s += bb
    i32[s : s + n] = 1  # valid
    s += nb
    if call.reads_prefix is not None:
        i32[s : s + n] = np.repeat(call.reads_prefix, np.diff(call.cu_q))
    s += nb
    i32[s:] = [0, nb, 0, prefix_cols, max(shape.prefix_len, 1)]
    return i64, i32


def host_arrays(call: PrefillCall, shape: Shape, kv: Any, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """`padded` for the slot cache `kv` (its scratch column, its slots' layout as `attention.slot_rows` views it, the
    prefix buffer's width)."""
    hkv, cols = kv.keys[0].shape[1], kv.keys[0].shape[2]
    return padded(call, shape, pad_id, kv.tokens, hkv * cols, (kv.slots - 1) * hkv * cols + cols,
                  kv.prefix_keys[0].shape[2])


def padded_forward(forward: Callable[..., torch.Tensor], call: PrefillCall, kv: Any, prefix_len: int,
                   kernel: Callable[..., Any], pad_id: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """`call`'s (B, V) logits from the eager forward over its tokens padded to a bucket (`PAD_FINE`; rows and the
    longest row as `shape_of`), the padding inert as a graph's (module doc); and the pad tokens computed. Why: the
    packed token count is every GEMM's row count, and it is new at nearly every call of a rollout - cuBLAS then picks
    its kernel afresh on the host, and the device waited for that 4-5 ms before each GEMM of the call's first layer
    (the other layers reuse the pick; H100, 2026-12-07, the s64 rollout profile: ~8 ms a 23k-token call, ~60 ms a
    256-env rollout). Padded, the calls of a rollout's later turns meet the same few counts again."""
    shape = shape_of(call, prefix_len)._replace(tokens=bucket(len(call.ids), PAD_FINE, 64))
    inputs = Inputs(shape, device)
    inputs.load(*host_arrays(call, shape, kv, pad_id))
    logits = forward(inputs.ids, inputs.pos, inputs.ctx(kv, shape, kernel), inputs.last)
    return logits[: len(call.slots)], shape.tokens - len(call.ids)


class Inputs:
    """One graph's input buffers on the device and the forward's arguments over them (views)."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        nb, bb = shape.tokens, shape.rows
        self.i64 = torch.zeros(4 * nb + bb, dtype=torch.int64, device=device)
        self.i32 = torch.zeros(3 * bb + 2 + 2 * nb + 5, dtype=torch.int32, device=device)
        a, b = self.i64, self.i32
        self.ids, self.pos = a[:nb][None], a[nb : 2 * nb][None]
        self.tok_slot, self.tok_col, self.last = a[2 * nb : 3 * nb], a[3 * nb : 4 * nb], a[4 * nb :]
        s = bb + 1
        self.cu_q, self.starts = b[:s], b[s : 2 * s]
        s *= 2
        self.used = b[s : s + bb]
        s += bb
        self.valid, self.reads = b[s : s + nb], b[s + nb : s + 2 * nb]
        s += 2 * nb
        self.meta = (b[s : s + 2], b[s + 2 : s + 4], b[s + 4 : s + 5])

    def load(self, i64: np.ndarray, i32: np.ndarray) -> None:
        """The call's host arrays into the buffers, in stream order without a host sync (pinned staging: torch's
        host allocator keeps the block until its copy ran)."""
        for dst, src in ((self.i64, i64), (self.i32, i32)):
            dst.copy_(torch.from_numpy(src).pin_memory() if dst.is_cuda else torch.from_numpy(src), non_blocking=True)

    def ctx(self, kv: Any, shape: Shape, kernel: Callable[..., Any]) -> PrefillCtx:
        """The forward's `PrefillCtx` over these buffers (the bool masks made from their int32 rows, inside the
        forward: a replay reads them again); `max_k` the slot's columns, a bound on every row's keys."""
        p = shape.prefix_len
        reads = self.reads > 0 if p else None
        max_k = kv.keys[0].shape[2]
        flash = FlashPrefill(kernel, self.starts, self.used, max_k, self.meta if p else None, reads, self.valid > 0)
        return PrefillCtx(kv.keys, kv.values, kv.prefix_keys if p else None, kv.prefix_values if p else None, p,
                          self.tok_slot, self.tok_col, None, None, None, self.cu_q, None, shape.max_q, max_k,
                          kernel, flash)


class PrefillGraphs:
    """One batcher's prefill graphs. `run(call, prefix_len)` -> (B, V) float32 logits of the call's rows, or None
    where it declines (too large, a shape not met `capture_after` times yet, `max_graphs` graphs already, or off after
    a failure): the caller then runs the eager prefill."""

    def __init__(self, forward: Callable[..., torch.Tensor], device: torch.device, pad_id: int, vocab: int,
                 capture: Callable[..., tuple[Callable[[], Any], Any]] | None = None, gate: Any = None,
                 verify: int = VERIFY, max_tokens: int | None = None, capture_after: int | None = None,
                 max_graphs: int = MAX_GRAPHS) -> None:
        """`forward(ids, pos, ctx, last)` -> (rows, V) float32: the batcher's eager packed forward
        (`CacheMixin._forward_last`); `capture(run, device, pool)` -> (replay, out) (default: the decode graphs'
        `_graph_capture`), `gate` the process's `CaptureGate` (tests pass stand-ins for both on the CPU);
        `capture_after` None: `CAPTURE_AFTER` as it is when the graphs are made; `max_tokens` None:
        THINKCRAFT_PREFILL_GRAPH_TOKENS where set (an A/B of larger replayed calls), else `MAX_TOKENS`."""
        capture_after = CAPTURE_AFTER if capture_after is None else capture_after
        if max_tokens is None:
            max_tokens = env_int("THINKCRAFT_PREFILL_GRAPH_TOKENS", MAX_TOKENS, least=1)
        if capture is None or gate is None:
            from thinkcraft.llm.hf.cache import CAPTURE_GATE, _graph_capture

            capture, gate = capture or _graph_capture, gate or CAPTURE_GATE
        self.forward, self.device, self.pad_id, self.vocab = forward, device, pad_id, vocab
        self.capture, self.gate = capture, gate
        self.verify, self.max_tokens, self.capture_after, self.max_graphs = verify, max_tokens, capture_after, max_graphs
        self.seen: OrderedDict[Shape, int] = OrderedDict()  # calls of each shape without a graph (`CAPTURE_AFTER`)
        self.graphs: dict[Shape, tuple[Inputs, Callable[[], Any], list[int]]] = {}
        self.pool: Any = None
        self.out: torch.Tensor | None = None
        """(rows, V) float32: every graph's logits (allocated outside the graphs, so their pool keeps nothing)."""
        self.key: tuple | None = None
        self.kv_ref: weakref.ref | None = None
        self.failed = False
        self.captures, self.capture_s, self.replays, self.declined = 0, 0.0, 0, 0
        self._kinds: set[bool] = set()  # the kinds (reads the prefix or not) one of whose graphs passed `verify` checks

    def run(self, call: PrefillCall, kv: Any, prefix_len: int, kernel: Callable[..., Any], key: Callable[[], tuple]
            ) -> torch.Tensor | None:
        """`call`'s logits by a replay (capturing its bucket's graph first where it is new), or None. `kv` the slot
        cache (by identity: a new cache drops every graph), `kernel` the in-place prefill's, `key()` what the graphs
        read by address or decided by (the batcher's `_weights_key`: parameters' storage, autocast, adapters; called
        only for a call a graph may serve - it walks every parameter)."""
        if self.failed:
            return None
        shape = shape_of(call, prefix_len)
        if shape.tokens > self.max_tokens:
            self.declined += 1
            return None
        try:
            now = key()
            if now != self.key or self.kv_ref is None or self.kv_ref() is not kv:
                self.clear()
                self.key, self.kv_ref = now, weakref.ref(kv)
            entry = self.graphs.get(shape)
            if entry is None and not self._capturing(shape):
                self.declined += 1
                return None
            host = host_arrays(call, shape, kv, self.pad_id)
            if entry is None:
                entry = self.graphs[shape] = self._capture(shape, kv, kernel, host)
            else:
                entry[0].load(*host)
                with self.gate.shared():  # no replay while another engine captures (CaptureGate)
                    entry[1]()
                self.replays += 1
            inputs, _, checked = entry
            out = self.out[: shape.rows]  # type: ignore[index]
            kind = shape.prefix_len > 0
            if checked[0] == 0 or (checked[0] < self.verify and kind not in self._kinds):
                want = self.forward(inputs.ids, inputs.pos, inputs.ctx(kv, shape, kernel), inputs.last)
                if not torch.equal(want[: len(call.slots)], out[: len(call.slots)]):
                    raise RuntimeError("a replay differs from the eager forward over the same inputs")
                checked[0] += 1
                if checked[0] >= self.verify:
                    self._kinds.add(kind)
            return out[: len(call.slots)]
        except Exception as e:  # noqa: BLE001 - any capture, replay or check failure: the eager prefill, for good
            self.failed = True
            self.clear()
            log.warning("the prefill's CUDA graphs are off (%s: %s); the prefill runs eagerly", type(e).__name__, e)
            return None

    def _capturing(self, shape: Shape) -> bool:
        """Whether this call of a shape without a graph captures one (`CAPTURE_AFTER`, `MAX_GRAPHS`); counts it."""
        n = self.seen.pop(shape, 0) + 1
        if n < self.capture_after or len(self.graphs) >= self.max_graphs:
            self.seen[shape] = n  # the most recent last
            while len(self.seen) > SEEN_MAX:
                self.seen.popitem(last=False)
            return False
        return True

    def clear(self) -> None:
        """Every graph and buffer goes (a new cache or new weights' storage; a failure)."""
        self.graphs.clear()
        self.out = self.pool = self.key = self.kv_ref = None
        self._kinds.clear()

    def _capture(self, shape: Shape, kv: Any, kernel: Callable[..., Any], host: tuple[np.ndarray, np.ndarray]
                 ) -> tuple[Inputs, Callable[[], Any], list[int]]:
        inputs = Inputs(shape, self.device)
        inputs.load(*host)
        if self.out is None or self.out.shape[0] < shape.rows:
            # the buffer only grows (graphs captured before keep reading the old one: dropped with it)
            self.graphs.clear()
            self.out = torch.empty((shape.rows, self.vocab), dtype=torch.float32, device=self.device)
        if self.pool is None and self.device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()  # one pool for every prefill graph: never replayed at once
        out = self.out

        def run() -> torch.Tensor:
            # the context made inside: its masks are computed from the buffers by every replay. The logits go into
            # the buffer made outside the graph: the pool then keeps no graph's output alive
            ctx = inputs.ctx(kv, shape, kernel)
            return out[: shape.rows].copy_(self.forward(inputs.ids, inputs.pos, ctx, inputs.last))

        t0 = time.perf_counter()
        with self.gate.exclusive():
            # the warm-ups and the capture write the call's K/V as the replay does (the same values, idempotent)
            replay, _ = self.capture(run, self.device, self.pool)
        with self.gate.shared():
            replay()  # a capture computes nothing on a GPU: this replay is the call's
        self.captures += 1
        self.replays += 1
        self.capture_s += time.perf_counter() - t0
        log.info("prefill graph %d captured on %s (%d tokens, %d rows, <= %d new a row): %.2f s", self.captures,
                 self.device, shape.tokens, shape.rows, shape.max_q, time.perf_counter() - t0)
        return inputs, replay, [0]  # replays checked
