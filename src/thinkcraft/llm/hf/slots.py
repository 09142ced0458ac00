"""The slot KV cache of continuous batching, and the attention that reads and writes it.

Every running (or parked) sequence owns a *slot*: row s of per-layer buffers (S, Hkv, T + 1, d). Column c of
a slot holds the token at position `offset + c`, where `offset` is the shared prefix's length P for rows
that read the shared prefix and 0 for the others. The shared prefix (instructions) is stored once, in its
own buffers (1, Hkv, Pcap, d), and read by every row through a log-sum-exp merge (the cascade identity of
`attention.merge_attention`) - never copied per row. Column T is scratch: writes of inactive rows (and of
nothing else) land there and are never read, so one fixed-shape step serves any mix of active and idle
slots (the CUDA-graph requirement), and a parked episode's KV survives the steps of the others.

Two forward kinds, both through the decoder layers (`compat.call_layer`), with the context below passed to
the attention function as the layer's `thinkcraft_prefix_kv` keyword (see `compat.PREFIX_KV_KWARG`):

- `DecodeCtx`: one token per slot (B = S rows). The new K/V go to column `write_col[s]`; the query reads
  columns < `key_len[s]` of its own slot (GQA heads folded, each byte read once), plus the shared prefix where
  `prefix_mask` says so. On CUDA one FlashAttention call reads each row's own columns in place
  (`attention.slot_decode_attention`, `decode_kernel`); elsewhere (and with THINKCRAFT_FLASH_DECODE=0) matmuls
  read a width `cols` that is a bucket of the longest sequence ("dynamic") or the whole slot ("static"), masked
  (`attention.gqa_decode_attention`).
- `PrefillCtx`: the new tokens of several rows packed into one sequence (batch 1, no padding). Their K/V are
  written to (tok_slot, tok_col); each row then attends to [shared prefix | its slot's columns so far], causal
  aligned bottom-right. On CUDA the keys are read in place (`FlashPrefill`, `attention.prefill_in_place`): one
  FlashAttention call over the rows' slot columns and one over the prefix's single copy, merged by their LSEs;
  elsewhere (and with THINKCRAFT_FLASH_PREFILL=0) the keys are gathered into one packed sequence per row
  ([prefix | columns]) for one varlen call (`compat.flash_varlen`, the per-row reference
  `attention.varlen_reference` off CUDA).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch

from thinkcraft.llm import attention as A
from thinkcraft.llm import compat
from thinkcraft.llm.compat import PREFIX_KV_KWARG
from thinkcraft.llm.hf.split_decode import SplitDecode, split_decode_attention
from thinkcraft.utils.errors import env_switch

SLOT_ATTN = "thinkcraft_slots"


class FlashDecode(NamedTuple):
    """The decode step's FlashAttention arguments (`attention.slot_decode_attention`,
    `attention.prefix_decode_attention`): the fixed ones made once per cache (`flash_decode_meta`), the per-row
    key counts once per forward (`per_forward`, inside the captured step) - not in each of the layers, where they
    were two more graph nodes a layer."""

    kernel: Callable[..., Any]
    cu_q: torch.Tensor
    """(S*Hkv+1,) int32: sequence (s, j) - slot s's KV head j - has G query tokens (its query heads)."""
    cu_k: torch.Tensor
    """(S*Hkv+1,) int32: where sequence (s, j)'s keys start in the slot cache viewed as (S*Hkv*(T+1), 1, d)."""
    prefix_cu_q: torch.Tensor
    """(Hkv+1,) int32: the shared prefix's sequence j (KV head j) has every row's G query heads, S*G tokens."""
    prefix_cu_k: torch.Tensor
    """(Hkv+1,) int32: where KV head j's prefix columns start in the prefix buffer viewed flat."""
    used: torch.Tensor | None = None
    """(S*Hkv,) int32: key_len of sequence (s, j)'s row (per forward)."""
    prefix_used: torch.Tensor | None = None
    """(Hkv,) int32: the prefix columns read (per forward; >= 1, so the call never meets an empty sequence)."""
    prefix_rows: torch.Tensor | None = None
    """(S,) bool: the rows that read the prefix (the others' prefix part gets no weight in the merge)."""


class DecodeCtx(NamedTuple):
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    prefix_keys: tuple[torch.Tensor, ...] | None
    prefix_values: tuple[torch.Tensor, ...] | None
    rows: torch.Tensor
    """(S,) arange: the slot of each query row."""
    write_col: torch.Tensor
    """(S,) where this step's K/V go (column T, scratch, for inactive rows)."""
    key_len: torch.Tensor
    """(S,) columns a row reads after the write (>= 1: column 0 keeps an idle row's softmax finite)."""
    cols: torch.Tensor
    """(width,) arange: the columns read this step (its length is the attention width)."""
    prefix_mask: torch.Tensor
    """(S, Pcap) bool: prefix keys each row reads (none for rows without the shared prefix)."""
    flash: FlashDecode | None = None
    """FlashAttention reading each row's own columns in place (`decode_kernel`, `flash_decode_meta`), or None for
    the matmul path over the whole width."""
    split: SplitDecode | None = None
    """The split-KV decode attention (split_decode.py: own columns and shared prefix in one launch), which serves
    in place of `flash` and the matmul path where set."""


class FlashPrefill(NamedTuple):
    """The prefill's in-place attention (`attention.prefill_in_place`): each row's slot columns read where they
    are, the shared prefix read once, no gather (`prefill_inplace_kernel`)."""

    kernel: Callable[..., Any]
    starts: torch.Tensor
    """(B+1,) int32: row i's first row in the slot cache viewed as `attention.slot_rows` (the last entry: the
    view's row count; unread)."""
    used: torch.Tensor
    """(B,) int32: the columns row i reads after the write (kept + new)."""
    max_k: int
    prefix_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """`attention.prefix_prefill_attention`'s (cu_q, cu_k, used), or None when no row reads the prefix."""
    reads_prefix: torch.Tensor | None
    """(N,) bool: the packed tokens whose row reads the shared prefix."""
    valid: torch.Tensor | None = None
    """(N,) bool: the packed tokens of some row; the others (a graph's padding, prefill_graphs.py) belong to none,
    and their attention output - never written by the kernel - is set to 0. None: every token is a row's."""


class PrefillCtx(NamedTuple):
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    prefix_keys: tuple[torch.Tensor, ...] | None
    prefix_values: tuple[torch.Tensor, ...] | None
    prefix_len: int
    tok_slot: torch.Tensor
    """(N,) slot of each packed new token; `tok_col` (N,) its column."""
    tok_col: torch.Tensor
    gather_slot: torch.Tensor | None
    """(K,) the slot columns every row reads, row after row (its columns 0..len-1 after the write); None with
    `flash` (read in place)."""
    gather_col: torch.Tensor | None
    key_index: torch.Tensor | None
    """(Kp,) packed keys = cat([prefix P, gathered K])[key_index] (None: no row reads the prefix, or `flash`)."""
    cu_q: torch.Tensor
    cu_k: torch.Tensor | None
    max_q: int
    max_k: int
    kernel: Callable[..., torch.Tensor]
    flash: FlashPrefill | None = None
    """The in-place FlashAttention (CUDA, `prefill_inplace_kernel`), else None: gather, then `kernel`."""


class SlotKV:
    """The buffers: per layer (S, Hkv, T + 1, d) keys and values, and the shared prefix's (1, Hkv, Pcap, d)."""

    def __init__(self, num_layers: int, slots: int, tokens: int, kv_heads: int, head_dim: int, prefix_cap: int,
                 dtype: torch.dtype, device: torch.device, static_addresses: bool) -> None:
        self.slots, self.tokens, self.prefix_cap = slots, tokens, prefix_cap
        self.dtype, self.device = dtype, device

        def zeros(*shape: int) -> torch.Tensor:
            t = torch.zeros(shape, dtype=dtype, device=device)
            if static_addresses:
                compat.mark_static_address(t)
            return t

        self.keys = tuple(zeros(slots, kv_heads, tokens + 1, head_dim) for _ in range(num_layers))
        self.values = tuple(zeros(slots, kv_heads, tokens + 1, head_dim) for _ in range(num_layers))
        self.prefix_keys = tuple(zeros(1, kv_heads, max(prefix_cap, 1), head_dim) for _ in range(num_layers))
        self.prefix_values = tuple(zeros(1, kv_heads, max(prefix_cap, 1), head_dim) for _ in range(num_layers))
        self.prefix_len = 0
        self.rows = torch.arange(slots, device=device)
        self.cols = torch.arange(tokens, device=device)
        self.pcols = torch.arange(max(prefix_cap, 1), device=device)

    @property
    def nbytes(self) -> int:
        bufs = self.keys + self.values + self.prefix_keys + self.prefix_values
        return sum(t.numel() * t.element_size() for t in bufs)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_prefix(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy a prefix's per-layer (1, Hkv, P, d) K/V into the prefix buffers (same addresses)."""
        p = kv[0][0].shape[2]
        for (k, v), kb, vb in zip(kv, self.prefix_keys, self.prefix_values):
            kb[:, :, :p].copy_(k)
            vb[:, :, :p].copy_(v)
        self.prefix_len = p


def _decode_attention(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: DecodeCtx,
                      scale: float) -> torch.Tensor:
    i = module.layer_idx
    kc, vc = ctx.keys[i], ctx.values[i]
    kc[ctx.rows, :, ctx.write_col] = k[:, :, 0]
    vc[ctx.rows, :, ctx.write_col] = v[:, :, 0]
    sp = ctx.split
    if sp is not None:  # own columns and the shared prefix in one launch, merged inside (split_decode.py)
        pk = ctx.prefix_keys[i] if ctx.prefix_keys is not None else None
        pv = ctx.prefix_values[i] if ctx.prefix_values is not None else None
        return split_decode_attention(q, kc, vc, sp.key_len, pk, pv, sp.prefix_n, scale, sp.chunk).transpose(1, 2)
    out, lse = _own_columns(q, kc, vc, ctx, scale)
    if ctx.prefix_keys is not None:
        o_p, lse_p = _shared_prefix(q, ctx.prefix_keys[i], ctx.prefix_values[i], ctx, scale)
        out = A.merge_attention(o_p, lse_p[..., None], out, lse[..., None])
    return out.transpose(1, 2)


def _own_columns(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ctx: DecodeCtx,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row against its own slot's columns < key_len: (out (S, H, 1, d), lse (S, H))."""
    width = ctx.cols.shape[0]
    f = ctx.flash
    if f is not None:
        return A.slot_decode_attention(q, kc, vc, ctx.key_len, width, scale, f.kernel, (f.cu_q, f.cu_k, f.used))
    mask = (ctx.cols[None, :] < ctx.key_len[:, None])[:, None, None, :]
    return A.gqa_decode_attention(q, kc[:, :, :width], vc[:, :, :width], mask, scale, True)


def _shared_prefix(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, ctx: DecodeCtx,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row against the one prefix copy (rows that do not read it get no weight in the merge): (out
    (S, H, 1, d), lse (S, H))."""
    f = ctx.flash
    if f is not None:
        meta = (f.prefix_cu_q, f.prefix_cu_k, f.prefix_used)
        o_p, lse_p = A.prefix_decode_attention(q, pk, pv, scale, f.kernel, meta)
        return o_p, torch.where(f.prefix_rows[:, None], lse_p, A.NO_KEYS_LSE)
    # (1, Hkv, S*G, d) x (1, Hkv, Pcap, d), the prefix mask per row
    s, h, _, d = q.shape
    hkv = pk.shape[1]
    g = h // hkv
    qp = q.reshape(s, hkv, g, d).permute(1, 0, 2, 3).reshape(1, hkv, s * g, d)
    pmask = ctx.prefix_mask.repeat_interleave(g, dim=0)[None, None]
    o_p, lse_p = A.folded_attention_lse(qp, pk, pv, pmask, scale)
    o_p = o_p.reshape(hkv, s, g, d).permute(1, 0, 2, 3).reshape(s, h, 1, d)
    return o_p, lse_p.reshape(hkv, s, g).permute(1, 0, 2).reshape(s, h)


def _prefill_attention(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PrefillCtx,
                       scale: float) -> torch.Tensor:
    i = module.layer_idx
    kc, vc = ctx.keys[i], ctx.values[i]
    kc[ctx.tok_slot, :, ctx.tok_col] = k[0].transpose(0, 1)
    vc[ctx.tok_slot, :, ctx.tok_col] = v[0].transpose(0, 1)
    f = ctx.flash
    if f is not None:
        prefix = None
        if f.prefix_meta is not None:
            prefix = (ctx.prefix_keys[i], ctx.prefix_values[i], f.prefix_meta, ctx.prefix_len, f.reads_prefix)
        out = A.prefill_in_place(q[0].transpose(0, 1).contiguous(), kc, vc, ctx.cu_q, f.starts, f.used, ctx.max_q,
                                 f.max_k, scale, f.kernel, prefix)
        if f.valid is not None:  # a select, not a product: what the kernel left in a pad's output may be NaN
            out = torch.where(f.valid[:, None, None], out, out.new_zeros(()))
        return out[None]
    ks = kc[ctx.gather_slot, :, ctx.gather_col]  # (K, Hkv, d)
    vs = vc[ctx.gather_slot, :, ctx.gather_col]
    if ctx.key_index is not None:
        p = ctx.prefix_len
        ks = torch.cat([ctx.prefix_keys[i][0, :, :p].transpose(0, 1), ks])[ctx.key_index]
        vs = torch.cat([ctx.prefix_values[i][0, :, :p].transpose(0, 1), vs])[ctx.key_index]
    out = ctx.kernel(q[0].transpose(0, 1).contiguous(), ks, vs, ctx.cu_q, ctx.cu_k, ctx.max_q, ctx.max_k, scale)
    return out[None]


def slot_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):  # noqa: ANN001, ANN201
    """transformers attention function for the slot cache (`DecodeCtx` / `PrefillCtx` in the layer's
    `thinkcraft_prefix_kv` keyword); plain sdpa for calls without one."""
    ctx = kwargs.pop(PREFIX_KV_KWARG, None)
    if ctx is None:
        return compat.sdpa_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    # one dtype for the cache and the maths: under autocast with fp32 weights, a q/k norm (Qwen3) hands back
    # fp32 keys while the values come out of autocast's matmuls in bf16
    dt = ctx.keys[0].dtype
    query, key, value = query.to(dt), key.to(dt), value.to(dt)
    if isinstance(ctx, DecodeCtx):
        return _decode_attention(module, query, key, value, ctx, scale), None
    return _prefill_attention(module, query, key, value, ctx, scale), None


def register_slot_attention() -> str:
    """Register the slot attention with transformers (idempotent); returns its name."""
    return compat.register_attention(SLOT_ATTN, slot_attention_forward)


def prefill_kernel(device: torch.device, dtype: torch.dtype, traceable: bool = False) -> Callable[..., torch.Tensor]:
    """The packed varlen attention for the prefill: FlashAttention varlen on CUDA in half precision (where
    `attention.probe_varlen` found it working), the exact per-row reference elsewhere - or, for a prefill
    that torch.compile traces (`traceable`), its loop-free masked twin (`attention.varlen_dense`)."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and A.probe_varlen(device):
        return A.VARLEN_KERNELS[A._VARLEN["cuda"]]
    return A.varlen_dense if traceable else A.varlen_reference


def prefill_inplace_kernel(device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> Callable[..., Any] | None:
    """The prefill's attention in place (`FlashPrefill`): FlashAttention with `seqused_k` over each row's slot
    columns and the shared prefix's one copy, on CUDA in half precision where `attention.probe_flash_prefill`
    found it agreeing with the gather; None (gather, then `prefill_kernel`) elsewhere and with
    THINKCRAFT_FLASH_PREFILL=0."""
    return _flash_kernel("THINKCRAFT_FLASH_PREFILL", A.probe_flash_prefill, device, dtype, head_dim)


def _flash_kernel(switch: str, probe: Callable[..., bool], device: torch.device, dtype: torch.dtype,
                  head_dim: int) -> Callable[..., Any] | None:
    """`compat.flash_decode` where `switch` (default on) allows it, on CUDA in half precision, where `probe` found
    it agreeing with its reference at this head dim and dtype; else None."""
    if not env_switch(switch, default=True):
        return None
    half = dtype in (torch.float16, torch.bfloat16)
    if device.type == "cuda" and half and probe(device, head_dim, dtype):
        return compat.flash_decode
    return None


def decode_kernel(device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> Callable[..., Any] | None:
    """The decode step's slot attention: FlashAttention over each row's own columns, in place
    (`attention.slot_decode_attention`), on CUDA in half precision where `attention.probe_flash_decode` found it
    agreeing with the matmul path at this head dim and dtype; None (the matmul path over the whole width,
    `attention.gqa_decode_attention`) elsewhere and with THINKCRAFT_FLASH_DECODE=0. Chosen once per cache, eagerly
    (never inside a capture)."""
    return _flash_kernel("THINKCRAFT_FLASH_DECODE", A.probe_flash_decode, device, dtype, head_dim)


def flash_decode_meta(kv: SlotKV, query_heads: int, kernel: Callable[..., Any] | None) -> FlashDecode | None:
    """`FlashDecode`'s fixed tensors for this cache and `query_heads` (None without a kernel)."""
    if kernel is None:
        return None
    hkv = kv.keys[0].shape[1]
    return FlashDecode(kernel, *A.flash_decode_offsets(kv.slots, hkv, query_heads // hkv, kv.tokens + 1,
                                                       max(kv.prefix_cap, 1), kv.device))


def per_forward(ctx: Any) -> Any:
    """A decode context's per-row FlashAttention (or split decode) counts, made once per forward (inside the
    captured step, from the step's own key lengths and prefix mask); any other context as it is."""
    if isinstance(ctx, DecodeCtx) and ctx.split is not None:
        n = ctx.prefix_mask.sum(1).to(torch.int32) if ctx.prefix_keys is not None else None
        return ctx._replace(split=ctx.split._replace(key_len=ctx.key_len.to(torch.int32), prefix_n=n))
    if not isinstance(ctx, DecodeCtx) or ctx.flash is None:
        return ctx
    hkv = ctx.keys[0].shape[1]
    used = A.keys_per_sequence(ctx.key_len, hkv)
    # the prefix's length, read off the mask (every prefix-reading row has the same columns), at least 1
    p = ctx.prefix_mask.sum(1).amax().clamp(min=1).to(torch.int32).reshape(1).repeat(hkv)
    return ctx._replace(flash=ctx.flash._replace(used=used, prefix_used=p, prefix_rows=ctx.prefix_mask[:, 0]))
