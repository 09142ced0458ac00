"""The decode step's attention as split-KV ("flash decoding"): each row's keys cut into chunks read in parallel,
the shared prefix's chunks beside them (read once for a block of rows, on a side stream: `prefix_stream_on`), then
one small combine.

Why: FlashAttention's varlen forward (`attention.slot_decode_attention`) gives each (slot, KV head) sequence ONE
thread block that walks all of that row's keys in turn, and the shared prefix is a second call whose result is
merged by a third and fourth kernel (`attention.merge_attention`). A decode step has one query token a row, so
the blocks are few and long: at 80 rows of a 2-KV-head model, 160 blocks on an H200's 132 SMs - two waves of
~600 keys each - where the whole layer's keys are ~23 MB, ~7 us of the card's bandwidth. The 2-GPU async arith
run (2 x H200, 2026-11-30) steps at ~80 rows and 1.8-1.95 ms, against ~1.5 ms at ~60 rows; and a decode step is a
near-fixed cost in that loop, so the attention's wave count is one of the few costs that grows with the async
loop's rows and not the synchronous loop's.

What: program (row s, KV head j, chunk i) reads `CHUNK` keys of row s - chunk i of its own slot columns (< key_len)
or, for the first `NSP` chunks, of the shared prefix (< the row's prefix length, 0 for rows without it) - for the
G query heads of KV head j at once (the GQA group as the rows of one `tl.dot`, padded to 16), and writes its
normalised partial output (the group's G heads and D dims of the padded tile: `partial_rows_only`) and log-sum-exp;
a chunk past the row's keys writes only an empty log-sum-exp. The combine (one program per (row, KV head)) weights
the chunks by their log-sum-exps. Both kernels' grids depend on the cache's shape only (slots, width, prefix
capacity): one CUDA graph serves every step. Called through a torch custom op (`thinkcraft::split_decode`), so the
compiled decode forward treats it as one opaque call.

Measured (H200, 2026-11-30, BENCHMARKS §10): a step's attention over 24 layers 1.9-4.1x faster than FlashAttention's
calls (43-256 rows; `bench/probes/decode_attention_probe.py`); the 2-GPU arith loops +13% (async) and +18% (sync)
samples/s, a group's 1,024 tokens 2.37 -> 1.78 s; issue 19's Craftax row 741 -> 752 rollout decisions/s.

Safety: the first use on a device (per dtype, head dim and group) compares the kernel with a float64 reference
(rows of 1 to full width, with and without the prefix); a mismatch, no Triton or a compile error turns it off for
good with one warning and FlashAttention (or the matmul path) runs. On the CPU it serves only under Triton's
interpreter (TRITON_INTERPRET=1, the tests). `THINKCRAFT_SPLIT_DECODE=0` turns it off (the A/B switch).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, NamedTuple

import torch

from thinkcraft.utils.errors import env_int, env_switch
from thinkcraft.llm.hf.triton_device import FirstUseChecks, interpreted, pow2_at_least, runs_on

log = logging.getLogger(__name__)

CHUNK = 256
"""Keys a program reads (one split). Smaller: more programs (parallelism at few rows) and more partial results
to write and combine. Measured on an H200 (2026-11-30, `bench/probes/decode_attention_probe.py --chunks`, 24 layers
of Qwen2.5-0.5B's attention, ~560 keys a row + a 128-key prefix): 256 keys the fastest of 32 / 64 / 128 / 256 at
43, 80, 128 and 256 rows (0.28 / 0.36 / 0.44 / 0.78 ms a step; 128 keys: 0.30 / 0.39 / 0.51 / 0.93)."""
BLOCK_N = 64
"""Keys per `tl.dot` inside a program."""
PREFIX_ROWS = 8
"""Rows whose queries one program of the shared prefix reads its keys for (`prefix_kernel`): every row reads the
same prefix, so a program takes a block of rows' query heads as the rows of one `tl.dot` (8 rows x 7 heads of
Qwen2.5's group, padded to 8: 64) and the prefix's keys are read once a block, not once a row. Why: issue 19's
Craftax rollout shares a 680-token system prompt among 248 rows; read per row, that is 248 x 2 KV heads x 680
keys x 256 bytes = ~86 MB a layer of L2 traffic beside the rows' own ~69 MB. Measured on an H200 (2026-12-01,
`bench/probes/decode_attention_probe.py --rows 248 --width 1200 --mean-keys 540 --prefix 680 --prefix-rows 0 8 16
32`, 24 layers, 256-key chunks): a step's attention 1.12 ms one row a program, 0.92 ms at 8 rows, 0.99 at 16,
1.45 at 32 (too few programs); the decode step alone 2.94 -> 2.48 ms with this at 16 rows and `fused_proj`'s
in-place LoRA add. 0 (or THINKCRAFT_SPLIT_PREFIX_ROWS=0, the A/B switch): the prefix chunks per row, as before."""
NUM_WARPS = 4
NUM_STAGES: int | None = None
"""Software-pipelining stages of the key loops (None: Triton's default). With `BLOCK_N` and `NUM_WARPS` the tiling
`bench/probes/decode_attention_probe.py --tiles` sweeps (module attributes, read at each launch)."""

_kernels: Any = None
launches = 0
"""Calls in this process (host launches; a graph's replays are not counted): what a test reads."""


class SplitDecode(NamedTuple):
    """The split decode's per-cache constants (`meta`) and per-forward counts (`per_forward`)."""

    chunk: int
    """Keys per program."""
    key_len: torch.Tensor | None = None
    """(S,) int32: the columns each row reads of its own slot (per forward)."""
    prefix_n: torch.Tensor | None = None
    """(S,) int32: the shared-prefix columns each row reads, 0 for rows without it (per forward)."""


def split_decode_on() -> bool:
    """THINKCRAFT_SPLIT_DECODE: "1" (default) runs the decode attention as split-KV where it serves, "0" never."""
    return env_switch("THINKCRAFT_SPLIT_DECODE", default=True)


def prefix_rows() -> int:
    """THINKCRAFT_SPLIT_PREFIX_ROWS: rows a shared-prefix program serves (`PREFIX_ROWS`, the default), 0: one row a
    program (the code before, the A/B switch)."""
    return env_int("THINKCRAFT_SPLIT_PREFIX_ROWS", PREFIX_ROWS, least=0, most=128, check=lambda n: n & (n - 1) == 0,
                   wanted="0 or a power of two up to 128")


def prefix_stream_on() -> bool:
    """THINKCRAFT_SPLIT_PREFIX_STREAM: "1" (the default) launches the shared prefix's programs (`prefix_kernel`) on a
    side stream, beside the rows' own chunks (`partial_kernel`) on the caller's, joined before the combine - in a CUDA
    graph, two branches that may run at once; "0" one after the other on the caller's stream (the A/B switch). Why:
    at 256 rows of Qwen2.5-0.5B's shape the prefix kernel (~7 us a layer, 192 programs, H100 s64-1) ran alone between
    the layer's GEMM and the ~32 us of own chunks, which leave bandwidth to spare. Measured (1 x H100, 2026-12-08,
    s67-1, BENCHMARKS §7b): `decode_attention_probe` at 248 rows 1.04 -> 0.886 ms a step's attention, the Craftax
    row's decode iteration 2.236 -> 2.161 ms (the rollout 1,423 / 1,427 decisions/s, within its spread)."""
    return env_switch("THINKCRAFT_SPLIT_PREFIX_STREAM", default=True)


_SIDE_STREAMS: dict[int, Any] = {}
"""The side stream of each CUDA device for `prefix_stream_on`, made outside any graph capture (`_side_stream`)."""


def _side_stream(device: torch.device) -> Any:
    """The device's side stream, made on first use outside a capture; None while capturing before it exists (the
    prefix then runs on the caller's stream, as with the switch off)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    st = _SIDE_STREAMS.get(idx)
    if st is None and not torch.cuda.is_current_stream_capturing():
        st = _SIDE_STREAMS[idx] = torch.cuda.Stream(device=torch.device("cuda", idx))
    return st


def partial_rows_only() -> bool:
    """THINKCRAFT_SPLIT_PARTIAL_ROWS: "1" (default) the chunks' partial outputs are written and read for the GQA group's
    G heads and D dims only; "0" the whole padded tile (GP x DP rows of fp32: Qwen2.5's group of 7 heads padded to
    16, the code before 2026-12-08, the A/B switch). Why: at 256 rows of Qwen2.5-0.5B's shape a layer's partials were
    ~16 MB written and ~16 MB read again by the combine, beside ~70 MB of keys - 9/16 of it padding never read."""
    return env_switch("THINKCRAFT_SPLIT_PARTIAL_ROWS", default=True)


def _build() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def partial_kernel(q_ptr, sq_s, sq_h, k_ptr, v_ptr, pk_ptr, pv_ptr, klen_ptr, pn_ptr, o_ptr, lse_ptr, scale,
                       C, PCAP, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                       DP: tl.constexpr, NSP: tl.constexpr, NST: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, FIRST: tl.constexpr, FULL: tl.constexpr):
        sj = tl.program_id(0)
        i = tl.program_id(1) + FIRST  # FIRST = NSP: the prefix's chunks are `prefix_kernel`'s
        s = sj // HKV
        j = sj % HKV
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        gm = g < G
        dm = d < D
        q = tl.load(q_ptr + s.to(tl.int64) * sq_s + (j * G + g[:, None]) * sq_h + d[None, :],
                    mask=gm[:, None] & dm[None, :], other=0.0)
        if UPCAST:  # Triton's CPU interpreter multiplies half-precision tiles wrongly: float32 there
            q = q.to(tl.float32)
        if i < NSP:  # a chunk of the shared prefix (1, Hkv, PCAP, D)
            n = tl.load(pn_ptr + s)
            lo = i * CHUNK
            kb = pk_ptr + j.to(tl.int64) * PCAP * D
            vb = pv_ptr + j.to(tl.int64) * PCAP * D
        else:  # a chunk of the row's own slot (S, Hkv, C, D)
            n = tl.load(klen_ptr + s)
            lo = (i - NSP) * CHUNK
            kb = k_ptr + sj.to(tl.int64) * C * D
            vb = v_ptr + sj.to(tl.int64) * C * D
        hi = tl.minimum(lo + CHUNK, n)
        m_i = tl.full([GP], -1e30, tl.float32)  # finite: a fully masked block gives exp(-inf) = 0, never nan
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            cm = cols < hi
            kv_mask = cm[:, None] & dm[None, :]
            k = tl.load(kb + cols[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            qk = tl.dot(q, tl.trans(k)) * scale
            qk = tl.where(cm[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vb + cols[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        has = l_i > 0
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        part = (sj.to(tl.int64) * NST + i) * GP
        tl.store(lse_ptr + part + g, lse)
        if hi > lo:  # an empty chunk writes its log-sum-exp only (the combine never reads its output)
            out = acc / tl.where(has, l_i, 1.0)[:, None]
            # the group's G heads and D dims only (`partial_rows_only`): the tile's padding rows are never read
            if FULL:
                tl.store(o_ptr + (part + g[:, None]) * DP + d[None, :], out)
            else:
                tl.store(o_ptr + (part + g[:, None]) * DP + d[None, :], out, mask=gm[:, None] & dm[None, :])

    @triton.jit
    def prefix_kernel(q_ptr, sq_s, sq_h, pk_ptr, pv_ptr, pn_ptr, o_ptr, lse_ptr, scale, S, PCAP,
                      HKV: tl.constexpr, G: tl.constexpr, GQ: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                      DP: tl.constexpr, NST: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                      R: tl.constexpr, UPCAST: tl.constexpr, FULL: tl.constexpr):
        # program (block of R rows, KV head j, prefix chunk i): the R rows' G query heads as the rows of one tile
        # (m = row-in-block * GQ + head), each masked to its own row's prefix length; the same partial output and
        # log-sum-exp per (row, head, chunk) as `partial_kernel` writes, so the combine is the same. Its key loop is
        # `partial_kernel`'s with a per-row mask: written out twice, not shared through a jitted helper, because
        # a helper captured from `_build`'s scope compiles only where Triton resolves closures, untried on the GPU
        # image (2026-12-01: no device time left to check it; a failed compile turns the split decode off for good)
        bj = tl.program_id(0)
        i = tl.program_id(1)
        j = bj % HKV
        m = tl.arange(0, R * GQ)
        r = (bj // HKV) * R + m // GQ
        g = m % GQ
        d = tl.arange(0, DP)
        live_r = r < S
        qm = live_r & (g < G)
        dm = d < D
        q = tl.load(q_ptr + r.to(tl.int64)[:, None] * sq_s + (j * G + g[:, None]) * sq_h + d[None, :],
                    mask=qm[:, None] & dm[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        n = tl.load(pn_ptr + r, mask=live_r, other=0)
        lo = i * CHUNK
        hi = tl.minimum(lo + CHUNK, tl.max(n, 0))
        kb = pk_ptr + j.to(tl.int64) * PCAP * D
        vb = pv_ptr + j.to(tl.int64) * PCAP * D
        m_i = tl.full([R * GQ], -1e30, tl.float32)
        l_i = tl.zeros([R * GQ], tl.float32)
        acc = tl.zeros([R * GQ, DP], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            cm = cols < hi
            kv_mask = cm[:, None] & dm[None, :]
            k = tl.load(kb + cols[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            qk = tl.dot(q, tl.trans(k)) * scale
            qk = tl.where(cm[None, :] & (cols[None, :] < n[:, None]), qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vb + cols[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        has = l_i > 0
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        part = ((r.to(tl.int64) * HKV + j) * NST + i) * GP + g
        tl.store(lse_ptr + part, lse, mask=live_r)
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        if FULL:
            tl.store(o_ptr + part[:, None] * DP + d[None, :], out, mask=(live_r & has)[:, None])
        else:  # the group's heads and dims only (`partial_rows_only`)
            tl.store(o_ptr + part[:, None] * DP + d[None, :], out, mask=(qm & has)[:, None] & dm[None, :])

    @triton.jit
    def combine_kernel(o_ptr, lse_ptr, out_ptr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                       D: tl.constexpr, DP: tl.constexpr, NST: tl.constexpr, FULL: tl.constexpr):
        sj = tl.program_id(0)
        s = sj // HKV
        j = sj % HKV
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        base = sj.to(tl.int64) * NST * GP
        mx = tl.full([GP], float("-inf"), tl.float32)
        for i in range(NST):
            mx = tl.maximum(mx, tl.load(lse_ptr + base + i * GP + g))
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        den = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        for i in range(NST):
            lse = tl.load(lse_ptr + base + i * GP + g)
            live = lse > float("-inf")
            w = tl.where(live, tl.exp(lse - mx), 0.0)
            if FULL:
                o = tl.load(o_ptr + (base + i * GP + g[:, None]) * DP + d[None, :], mask=live[:, None], other=0.0)
            else:  # what the partial kernels wrote (`partial_rows_only`)
                o = tl.load(o_ptr + (base + i * GP + g[:, None]) * DP + d[None, :],
                            mask=live[:, None] & (g < G)[:, None] & (d < D)[None, :], other=0.0)
            den += w
            acc += w[:, None] * o
        out = acc / tl.where(den > 0, den, 1.0)[:, None]
        h = j * G + g
        tl.store(out_ptr + (s.to(tl.int64) * HKV * G + h[:, None]) * D + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None] & (d < D)[None, :])

    return partial_kernel, prefix_kernel, combine_kernel


def _run(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, key_len: torch.Tensor, pk: torch.Tensor,
         pv: torch.Tensor, prefix_n: torch.Tensor, scale: float, chunk: int, use_prefix: bool) -> torch.Tensor:
    global _kernels, launches
    launches += 1
    if _kernels is None:
        _kernels = _build()
    partial, prefix, combine = _kernels
    s, h, _, d = q.shape
    hkv, cols = kc.shape[1], kc.shape[2]
    g = h // hkv
    gp, dp = pow2_at_least(g, 16), pow2_at_least(d, 16)
    pcap = pk.shape[2] if use_prefix else 0
    nsp = -(-pcap // chunk) if use_prefix else 0
    nst = nsp + -(-cols // chunk)
    q3 = q.reshape(s, h, d)
    if q3.stride(2) != 1:
        q3 = q3.contiguous()
    o_part = torch.empty((s * hkv, nst, gp, dp), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((s * hkv, nst, gp), dtype=torch.float32, device=q.device)
    out = torch.empty((s, h, 1, d), dtype=q.dtype, device=q.device)
    rows = prefix_rows() if nsp else 0
    full = not partial_rows_only()
    stages = {} if NUM_STAGES is None else {"num_stages": NUM_STAGES}
    side = main = None
    if rows:  # the prefix's chunks for blocks of rows, then the own columns' from chunk nsp on
        gq = pow2_at_least(g)
        # a tile of 16 (tl.dot's least) to 128 query rows: a large GQA group takes fewer rows a program
        rows = max(min(rows, max(128 // gq, 1)), -(-16 // gq))
        if q.is_cuda and prefix_stream_on():  # the prefix beside the own chunks (`prefix_stream_on`)
            side = _side_stream(q.device)
        if side is not None:
            main = torch.cuda.current_stream(q.device)
            side.wait_stream(main)  # q, the caches and the partials' buffers are ready on the caller's stream
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            prefix[(-(-s // rows) * hkv, nsp)](q3, q3.stride(0), q3.stride(1), pk, pv, prefix_n, o_part, lse_part,
                                              scale, s, pcap, HKV=hkv, G=g, GQ=gq, GP=gp, D=d, DP=dp, NST=nst,
                                              CHUNK=chunk, BLOCK_N=BLOCK_N, R=rows, UPCAST=interpreted(), FULL=full,
                                              num_warps=NUM_WARPS, **stages)
    first = nsp if rows else 0
    partial[(s * hkv, nst - first)](q3, q3.stride(0), q3.stride(1), kc, vc, pk, pv, key_len, prefix_n, o_part,
                                    lse_part, scale, cols, max(pcap, 1), HKV=hkv, G=g, GP=gp, D=d, DP=dp, NSP=nsp,
                                    NST=nst, CHUNK=chunk, BLOCK_N=BLOCK_N, UPCAST=interpreted(), FIRST=first,
                                    FULL=full, num_warps=NUM_WARPS, **stages)
    if side is not None:  # the two write disjoint chunks of the partials; the combine reads both
        main.wait_stream(side)
    combine[(s * hkv,)](o_part, lse_part, out, HKV=hkv, G=g, GP=gp, D=d, DP=dp, NST=nst, FULL=full,
                        num_warps=NUM_WARPS)
    return out


@torch.library.custom_op("thinkcraft::split_decode", mutates_args=())
def _split_decode_op(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, key_len: torch.Tensor, pk: torch.Tensor,
                     pv: torch.Tensor, prefix_n: torch.Tensor, scale: float, chunk: int, use_prefix: bool
                     ) -> torch.Tensor:
    return _run(q, kc, vc, key_len, pk, pv, prefix_n, scale, chunk, use_prefix)


@_split_decode_op.register_fake
def _(q, kc, vc, key_len, pk, pv, prefix_n, scale, chunk, use_prefix):  # noqa: ANN001, ANN202
    return q.new_empty(q.shape)


def split_decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, key_len: torch.Tensor,
                           pk: torch.Tensor | None, pv: torch.Tensor | None, prefix_n: torch.Tensor | None,
                           scale: float, chunk: int = CHUNK) -> torch.Tensor:
    """Attention of one query token a row over [its shared prefix | its slot's columns]: q (S, H, 1, d); kc / vc
    (S, Hkv, C, d) contiguous, row s reads columns < key_len[s] (int32, >= 1); pk / pv (1, Hkv, Pcap, d) the one
    prefix copy, row s reads its columns < prefix_n[s] (int32, 0: none), or None. Returns (S, H, 1, d) in q's
    dtype (`gqa_decode_attention` over the same keys)."""
    use_prefix = pk is not None
    if not use_prefix:
        pk, pv, prefix_n = kc, vc, key_len  # unread (no prefix chunks): the op's signature takes tensors
    dtype = q.dtype  # the keys' dtype inside (one tl.dot type), the query's out
    out = _split_decode_op(q.to(kc.dtype), kc, vc, key_len, pk, pv, prefix_n, float(scale), int(chunk), use_prefix)
    return out.to(dtype)


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, key_len: torch.Tensor, pk: torch.Tensor | None,
              pv: torch.Tensor | None, prefix_n: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`split_decode_attention` row by row in float64 (the check's and the tests' reference)."""
    s, h, _, d = q.shape
    hkv = kc.shape[1]
    g = h // hkv
    out = torch.empty(s, h, 1, d, dtype=torch.float64)
    for r in range(s):
        n = int(key_len[r])
        k, v = kc[r, :, :n].double(), vc[r, :, :n].double()
        if pk is not None and int(prefix_n[r]) > 0:
            p = int(prefix_n[r])
            k = torch.cat([pk[0, :, :p].double().cpu(), k.cpu()], 1)
            v = torch.cat([pv[0, :, :p].double().cpu(), v.cpu()], 1)
        k, v = k.cpu().repeat_interleave(g, 0), v.cpu().repeat_interleave(g, 0)  # (H, n, d)
        w = torch.softmax((q[r, :, 0].double().cpu()[:, None, :] * k).sum(-1) * scale, -1)  # (H, n)
        out[r, :, 0] = (w[:, :, None] * v).sum(1)
    return out


def serves(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether the split decode may serve this cache: the switch on, CUDA (or Triton's interpreter on the CPU),
    and its one-time check passed for (device, dtype, head dim, group)."""
    if not split_decode_on():
        return False
    if not runs_on(device):
        return False
    return _CHECKS.ok(device, dtype, head_dim, group)


def passed(device: torch.device) -> bool:
    """Whether the kernel passed a check on `device` in this process."""
    return _CHECKS.passed(device)


def _check(device: torch.device, dtype: torch.dtype, head_dim: int, group: int) -> None:
    """The kernel against `reference` on a small cache: rows reading 1 key to the full width, with and without
    the shared prefix (and a launch without a prefix at all); raises where it differs (`_CHECKS`)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    hkv, cols, pcap = 2, 2 * CHUNK + 9, CHUNK + 3
    s = 2 * max(prefix_rows(), 1) + 5  # the prefix's row blocks: two full ones and a part

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, kc, vc = rnd(s, hkv * group, 1, head_dim), rnd(s, hkv, cols, head_dim), rnd(s, hkv, cols, head_dim)
    pk, pv = rnd(1, hkv, pcap, head_dim), rnd(1, hkv, pcap, head_dim)
    key_len = torch.tensor(([1, cols, CHUNK, CHUNK + 1, 37] * s)[:s], dtype=torch.int32, device=device)
    prefix_n = torch.tensor(([pcap, 0, 5, pcap, 0, pcap, pcap] * s)[:s], dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for args in ((pk, pv, prefix_n), (None, None, None)):
        got = split_decode_attention(q, kc, vc, key_len, *args, scale).double().cpu()
        want = reference(q, kc, vc, key_len, *args, scale)
        err = float((got - want).abs().max())
        if not err <= tol:
            raise RuntimeError(f"differs from the reference by {err:.3g} (tolerance {tol:g})")


_CHECKS = FirstUseChecks(_check, log, "the split decode attention", "decoding with the other attention path",
                         lambda dtype, head_dim, group: f"{dtype}, head dim {head_dim}, group {group}")


def meta(device: torch.device, dtype: torch.dtype, head_dim: int, query_heads: int, kv_heads: int
         ) -> SplitDecode | None:
    """The per-cache constants where the split decode serves this cache's device, dtype and shape; else None."""
    if query_heads % kv_heads or not serves(device, dtype, head_dim, query_heads // kv_heads):
        return None
    return SplitDecode(CHUNK)
