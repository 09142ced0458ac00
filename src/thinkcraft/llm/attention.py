"""Shared-prefix ("cascade") attention: the suffix queries of a whole batch read one copy of the prefix KV.

When every item of a batch starts with the same prefix (instructions, few-shot), item i's suffix
queries attend to [prefix keys | own suffix keys]. Softmax over a concatenation splits exactly into two
softmaxes merged by their log-sum-exp (the FlashAttention / FlashInfer "cascade" identity):

    o = σ(lse_p - lse_s) · o_p + σ(lse_s - lse_p) · o_s

with (o_p, lse_p) the attention over the prefix only and (o_s, lse_s) the causal attention over the
item's own suffix. The prefix part is one non-causal attention of ALL suffix queries of the batch
(B·S rows, and the G query heads of a GQA group folded into rows as well) against the single prefix KV
of shape (1, Hkv, P, d): the prefix is read once per layer instead of B times, and never copied B
times (what `DynamicCache.batch_repeat_interleave` does, the memory wall at large batches).

On CUDA (when `probe_varlen` finds it works) the same attention runs as ONE FlashAttention varlen call
instead (`VARLEN_KERNELS`: torch's private op, or its public `varlen_attn` as a candidate): keys [prefix | own suffix] per item, causal aligned bottom-right - no LSE merge, fewer passes over
memory (0.57 vs 0.67 ms a layer at ppo-hidden's shapes on an H100, bench/cascade_probe.py).

Pure functions over tensors in the (batch, heads, seq, head_dim) layout, tested equal to plain attention
over the concatenated sequence.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from thinkcraft.llm import compat
from thinkcraft.llm.compat import PREFIX_KV_KWARG

log = logging.getLogger(__name__)
_warned: set[str] = set()


_GQA_NATIVE: dict[str, bool] = {}
"""Per device type: do the fused kernels take fewer key/value heads than query heads (GQA) directly?
Filled by `probe_gqa_native` (eagerly: never from inside a torch.compile trace)."""


def probe_gqa_native(device: torch.device | str) -> bool:
    """Whether `attention_lse` can hand GQA-shaped k/v (fewer heads) to the fused kernel on this device
    without expanding them (FlashAttention-2 maps query head h to key head h // (H/Hkv) itself). Tried
    once per device type on a tiny input and remembered; call it outside compiled code."""
    kind = torch.device(device).type
    if kind not in _GQA_NATIVE:
        dt = torch.bfloat16 if kind == "cuda" else torch.float32
        q = torch.randn(1, 4, 3, 16, device=device, dtype=dt, generator=torch.Generator(device).manual_seed(0))
        k = torch.randn(1, 2, 5, 16, device=device, dtype=dt, generator=torch.Generator(device).manual_seed(1))
        kernel = _kernel(q)
        ok = False
        if kernel in ("cuda:flash", "cpu:flash"):
            try:
                o, lse = _fused_lse(kernel, q, k, k, False, 0.25)
                o2, lse2 = attention_lse_reference(q, k, k, False, 0.25)
                ok = bool(torch.allclose(o.float(), o2.float(), atol=2e-2) and torch.allclose(lse, lse2, atol=2e-2))
            except (RuntimeError, AttributeError, NotImplementedError, TypeError):
                pass
        _GQA_NATIVE[kind] = ok
    return _GQA_NATIVE[kind]


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = q.shape[1] // k.shape[1]
    return (k, v) if g == 1 else (k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))


def attention_lse_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention returning (out (B,H,Sq,d) in q.dtype, lse (B,H,Sq) float32); k, v may have fewer
    heads (GQA: query head h reads key head h // (H/Hkv)). Computed in float32, in query chunks so that
    the score matrix stays small."""
    k, v = _expand_kv(q, k, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    sq, sk = q.shape[-2], k.shape[-2]
    kf, vf = k.float(), v.float()
    # ~64M score elements per chunk
    rows = max(1, (1 << 26) // max(1, q.shape[0] * q.shape[1] * sk))
    for a in range(0, sq, rows):
        b = min(sq, a + rows)
        s = torch.matmul(q[..., a:b, :].float(), kf.transpose(-1, -2)) * scale
        if causal:
            # queries aligned to the end of the keys (sq == sk in our use: top-left == bottom-right)
            qi = torch.arange(a, b, device=q.device)[:, None] + (sk - sq)
            ki = torch.arange(sk, device=q.device)[None, :]
            s = s.masked_fill(ki > qi, float("-inf"))
        l_ = torch.logsumexp(s, dim=-1)
        out[..., a:b, :] = torch.matmul(torch.exp(s - l_[..., None]), vf).to(q.dtype)
        lse[..., a:b] = l_
    return out, lse


def _kernel(q: torch.Tensor) -> str | None:
    """The fused kernel to use for q's device/dtype (flash, else memory-efficient on CUDA; flash on CPU),
    skipping any that failed before; None: the reference."""
    if q.is_cuda:
        if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and "cuda:flash" not in _warned:
            return "cuda:flash"
        return "cuda:efficient" if "cuda:efficient" not in _warned else None
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and "cpu:flash" not in _warned:
        return "cpu:flash"
    return None


_FUSED_LSE = {
    "cuda:flash": compat.flash_attention_lse,
    "cuda:efficient": compat.efficient_attention_lse,  # no GQA: k/v expanded first
    "cpu:flash": compat.cpu_flash_attention_lse,
}
"""The fused kernels with an LSE output (torch's private ops, see `thinkcraft.llm.compat`)."""


def _fused_lse(
    kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if kernel == "cuda:efficient":
        k, v = _expand_kv(q, k, v)
    return _FUSED_LSE[kernel](q, k, v, causal, scale)


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp, through torch's fused kernels where available (the flash kernel
    on CUDA for bf16/fp16, the CPU flash kernel on CPU), else `attention_lse_reference`. k, v may have
    fewer heads than q (GQA): passed as they are where the kernel maps the heads itself
    (`probe_gqa_native`), else expanded first."""
    if k.shape[1] != q.shape[1] and not _GQA_NATIVE.get(q.device.type, False):
        k, v = _expand_kv(q, k, v)
    while (kernel := _kernel(q)) is not None:
        try:
            return _fused_lse(kernel, q, k, v, causal, scale)
        except (RuntimeError, AttributeError, NotImplementedError) as e:
            _warn_once(kernel, e)  # not tried again; the next kernel (or the reference) takes over
    return attention_lse_reference(q, k, v, causal, scale)


def _warn_once(key: str, e: BaseException) -> None:
    """Remember a kernel that failed (not tried again) and say so once: the fallback is slower."""
    if key not in _warned:
        _warned.add(key)
        log.warning("fused attention with LSE (%s) unavailable: %s; falling back", key, e)


def merge_attention(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Combine attention over two disjoint key sets by their log-sum-exps."""
    # weight of part a = exp(lse_a) / (exp(lse_a) + exp(lse_b)); one fused lerp over the big tensors
    w_a = torch.sigmoid(lse_a.float() - lse_b.float())[..., None].to(o_a.dtype)
    return torch.lerp(o_b, o_a, w_a)


def shared_prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    scale: float | None = None,
    lse_fn=attention_lse,  # noqa: ANN001 - swapped for the reference in tests
) -> torch.Tensor:
    """Attention of suffix queries over [shared prefix | causal own suffix].

    q: (B, H, S, d); k, v: (B, Hkv, S, d) suffix keys/values (RoPE already applied at positions P..P+S-1);
    prefix_k, prefix_v: (1, Hkv, P, d). Returns (B, H, S, d). Right-padded suffixes are exact for every
    real token (causality keeps pads after them out of view).
    """
    b, h, s, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    prefix_copy_bytes = 2 * b * prefix_k.shape[2] * hkv * d * q.element_size()  # what varlen materialises
    varlen = _VARLEN.get("cuda") if q.is_cuda else None
    if (varlen is not None and lse_fn is attention_lse and q.dtype in (torch.float16, torch.bfloat16)
            and prefix_copy_bytes <= VARLEN_MAX_PREFIX_COPY_BYTES):
        return varlen_prefix_attention(q, k, v, prefix_k, prefix_v, scale, VARLEN_KERNELS[varlen])
    # Prefix part: all B*S suffix positions become one long query axis, so one kernel call reads the
    # prefix KV once per layer: (1, H, B*S, d) x (1, Hkv, P, d).
    if g == 1 or _GQA_NATIVE.get(q.device.type, False):
        # the kernel maps query heads to KV heads itself; q arrives as a (B, S, H, d) buffer seen as
        # (B, H, S, d) (transformers' transpose), so this fold and the unfold below are views, not copies
        qs = q.transpose(0, 1).reshape(1, h, b * s, d)
        o_p, lse_p = lse_fn(qs, prefix_k, prefix_v, False, scale)
        o_p = o_p.reshape(h, b, s, d).transpose(0, 1)
        lse_p = lse_p.reshape(h, b, s).transpose(0, 1)
    else:
        # fold the G query heads of a GQA group into the rows too: (1, Hkv, G*B*S, d) (a copy)
        qs = q.reshape(b, hkv, g, s, d).permute(1, 2, 0, 3, 4).reshape(1, hkv, g * b * s, d)
        o_p, lse_p = lse_fn(qs, prefix_k, prefix_v, False, scale)
        o_p = o_p.reshape(hkv, g, b, s, d).permute(2, 0, 1, 3, 4).reshape(b, h, s, d)
        lse_p = lse_p.reshape(hkv, g, b, s).permute(2, 0, 1, 3).reshape(b, h, s)
    # Suffix part: causal over the item's own tokens (short; lse_fn handles the GQA heads).
    o_s, lse_s = lse_fn(q, k, v, True, scale)
    return merge_attention(o_p, lse_p, o_s, lse_s)


VARLEN_MAX_PREFIX_COPY_BYTES = 1 << 30
"""The varlen path copies the prefix KV once per item (transient, per layer); above this many bytes (long
prefixes x many rows) the two-part path, which reads the single prefix copy, is used instead. ppo-hidden's
238-token prefix with Qwen3-4B: ~125 MB at 128 envs, ~0.6 GB for a full 65k-token chunk at 1024 envs."""

def varlen_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
    scale: float,
) -> torch.Tensor:
    """Plain varlen attention (the kernels' contract, for tests): packed q (Tq, H, d), k/v (Tk, Hkv, d),
    sequence i = rows cu[i]:cu[i+1]; causal aligned bottom-right; GQA. Returns (Tq, H, d)."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        o, _ = attention_lse_reference(q[qa:qb].transpose(0, 1)[None], k[ka:kb].transpose(0, 1)[None],
                                       v[ka:kb].transpose(0, 1)[None], True, scale)
        out[qa:qb] = o[0].transpose(0, 1)
    return out


def varlen_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
    scale: float,
) -> torch.Tensor:
    """`varlen_reference`'s result without a Python loop over the sequences, so torch.compile traces it whole
    (no `.item()`: the compiled prefill on the CPU): one masked attention of every packed query against every
    packed key - same sequence, causal aligned bottom-right - at O(Tq x Tk) memory: small inputs only."""
    qi = torch.arange(q.shape[0], device=q.device)
    ki = torch.arange(k.shape[0], device=q.device)
    ends_q, ends_k = cu_q[1:].long(), cu_k[1:].long()
    sq = torch.searchsorted(ends_q, qi, right=True)  # each packed token's sequence
    sk = torch.searchsorted(ends_k, ki, right=True)
    # bottom-right: a query sees the keys at least as far from its sequence's end as itself
    mask = (sq[:, None] == sk[None, :]) & ((ends_k[sk] - ki)[None, :] >= (ends_q[sq] - qi)[:, None])
    g = q.shape[1] // k.shape[1]  # GQA: heads expanded here (sdpa's enable_gqa wants a plain bool, not a traced one)
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask[None, None],
        scale=scale)
    return out[0].transpose(0, 1)


def _public_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
    scale: float,
) -> torch.Tensor:
    """torch's public varlen attention, `torch.nn.attention.varlen.varlen_attn` (checked on torch 2.13.0;
    `window_size=(-1, 0)` = causal, bottom-right aligned; `enable_gqa` maps the KV heads). It wraps the same
    FlashAttention kernel as `compat.flash_varlen`, as a custom op (opaque to torch.compile)."""
    if _varlen_attn is None:
        raise NotImplementedError("this torch has no torch.nn.attention.varlen.varlen_attn")
    return _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), enable_gqa=True)


try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - torch without the public varlen API
    _varlen_attn = None

VARLEN_KERNELS = {"aten": compat.flash_varlen, "public": _public_varlen}
"""The one-call varlen kernels the cascade can use on CUDA: "aten" the private FlashAttention op (the
default, measured in BENCHMARKS), "public" torch's public `varlen_attn` over the same kernel (a candidate:
to become the default once bench/cascade_probe.py measures it at least as fast on an H100)."""

VARLEN_DEFAULT = "aten"

_VARLEN: dict[str, str | None] = {}
"""Per device type: the varlen kernel the cascade uses (one of VARLEN_KERNELS), None = the two-part merge.
Filled by `probe_varlen` (eagerly, outside compiled code)."""


def varlen_prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, scale: float,
    kernel=compat.flash_varlen,  # noqa: ANN001 - one of VARLEN_KERNELS, or varlen_reference in tests
) -> torch.Tensor:
    """The same attention in ONE varlen call: item i's keys are [prefix | own suffix] (the prefix KV copied
    per item, P*Hkv*d values each) and causality is aligned bottom-right, so suffix token j sees the prefix
    and suffix tokens <= j. No LSE, no merge, GQA heads mapped by the kernel. On an H100 at ppo-hidden's
    shapes (128 x 104 suffix tokens, 238 prefix tokens, Qwen3-4B heads) one layer's attention takes 0.57 ms
    against 0.67 ms for the two-part merge (bench/cascade_probe.py, the "aten" kernel)."""
    b, h, s, d = q.shape
    hkv, p = k.shape[1], prefix_k.shape[2]
    qq = q.transpose(1, 2).reshape(b * s, h, d)
    kk = torch.cat([prefix_k.transpose(1, 2).expand(b, p, hkv, d), k.transpose(1, 2)], 1).reshape(b * (p + s), hkv, d)
    vv = torch.cat([prefix_v.transpose(1, 2).expand(b, p, hkv, d), v.transpose(1, 2)], 1).reshape(b * (p + s), hkv, d)
    steps = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    out = kernel(qq, kk, vv, steps * s, steps * (p + s), s, p + s, scale)
    return out.reshape(b, s, h, d).transpose(1, 2)


def probe_varlen(device: torch.device | str, kernel: str | None = None) -> bool:
    """Whether `shared_prefix_attention` may take the one-call varlen path on this device (CUDA only), and
    with which kernel: `kernel` (one of VARLEN_KERNELS) is tried on a tiny GQA input against the two-part
    merge and, if it agrees, chosen; None keeps this device's earlier choice, or tries VARLEN_DEFAULT once."""
    kind = torch.device(device).type
    if kind != "cuda":
        return False
    if kernel is None:
        if kind in _VARLEN:
            return _VARLEN[kind] is not None
        kernel = VARLEN_DEFAULT
    ok = False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        def r(*shape):  # noqa: ANN002, ANN202
            return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g)
        q, k, v, pk, pv = r(2, 3, 4, 16).transpose(1, 2), r(2, 2, 3, 16), r(2, 2, 3, 16), r(1, 2, 5, 16), r(1, 2, 5, 16)
        want = shared_prefix_attention(q, k, v, pk, pv, lse_fn=attention_lse_reference)
        got = varlen_prefix_attention(q, k, v, pk, pv, 0.25, VARLEN_KERNELS[kernel])
        ok = bool(torch.allclose(got.float(), want.float(), atol=2e-2))
    except (RuntimeError, AttributeError, NotImplementedError, TypeError, ValueError) as e:
        log.info("varlen attention (%s) unavailable (%s): cascade attention merges two calls", kernel, e)
    _VARLEN[kind] = kernel if ok else None
    return ok


# --- hook into transformers' attention interface ------------------------------------------------------

CASCADE_ATTN = "thinkcraft_cascade"


def cascade_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):  # noqa: ANN001, ANN201
    """transformers attention function (same signature as `sdpa_attention_forward`): uses this layer's
    prefix `(k, v)` passed through the layer's forward kwargs as `thinkcraft_prefix_kv=` (the engine calls
    the layers one by one; nothing layer-specific is read here, so one compiled layer serves them all).
    Without it: plain sdpa (causal when there is no mask)."""
    prefix_kv = kwargs.pop(PREFIX_KV_KWARG, None)
    if prefix_kv is None:
        return compat.sdpa_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    pk, pv = prefix_kv
    out = shared_prefix_attention(query, key, value, pk, pv, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_cascade_attention() -> str:
    """Register the cascade attention with transformers (idempotent); returns its name."""
    return compat.register_attention(CASCADE_ATTN, cascade_attention_forward)


# --- decode (one query token) without copying the KV cache ------------------------------------------------

NO_KEYS_LSE = -1e30
"""Log-sum-exp reported for a query that reads no key (a finite stand-in for -inf: merging such a part with
`merge_attention` gives it weight exactly 0 instead of a NaN)."""


def folded_attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of M query rows per KV head: q (B, Hkv, M, d) (the G query heads of a GQA group, and for a
    shared prefix the rows of the whole batch, folded into M), k/v (B, Hkv, T, d), mask None or bool
    broadcasting to (B, Hkv, M, T) with True = attend. Returns (out (B, Hkv, M, d) in v's dtype, lse
    (B, Hkv, M) float32); a query reading no key gets out 0 and lse `NO_KEYS_LSE`. Each key/value byte is
    read once (no `repeat_kv` copy)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1).clamp(min=NO_KEYS_LSE)
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    return torch.matmul(probs, v), lse


def gqa_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ONE query position per row over the cache, GQA heads folded (no `repeat_kv`).

    query (B, H, 1, d); key, value (B, Hkv, T, d); mask None or bool (B or 1, 1, 1, T) with True = attend.
    Returns (B, H, 1, d) (and the (B, H) float32 log-sum-exp with `return_lse`). Each key/value byte is read
    once: at large decode batches the step is bound by reading the cache, and the 4x expanded copy
    `repeat_kv` makes before sdpa (whenever there is a padding mask) is what made a batch-512 decode slow."""
    b, h, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, h // hkv, d)
    m = mask[..., -1:, :] if mask is not None else None  # (B|1, 1, 1, T) broadcasts over (Hkv, G)
    out, lse = folded_attention_lse(q, key, value, m, scale)
    out = out.reshape(b, h, 1, d)
    return (out, lse.reshape(b, h)) if return_lse else out


def flash_decode_offsets(
    slots: int, kv_heads: int, group: int, cols: int, prefix_cols: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The varlen offsets of the decode's two FlashAttention calls (int32): `slot_decode_attention`'s cu_q (G query
    tokens per (slot, KV head) sequence) and cu_k (each sequence's row of the cache viewed flat, `cols` apart), then
    `prefix_decode_attention`'s (every row's G heads per KV head; `prefix_cols` apart)."""
    steps = torch.arange(slots * kv_heads + 1, device=device, dtype=torch.int32)
    psteps = torch.arange(kv_heads + 1, device=device, dtype=torch.int32)
    return steps * group, steps * cols, psteps * (slots * group), psteps * prefix_cols


def keys_per_sequence(key_len: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(S*Hkv,) int32: each (slot, KV head) sequence's key count - its row's `key_len` (`seqused_k`)."""
    return key_len[:, None].expand(key_len.shape[0], kv_heads).reshape(-1).to(torch.int32)


def slot_decode_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, key_len: torch.Tensor, width: int,
    scale: float, kernel=compat.flash_decode,  # noqa: ANN001 - or varlen_decode_reference in tests
    meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gqa_decode_attention` over a slot cache in ONE FlashAttention call that reads only each row's own
    columns. query (S, H, 1, d); key/value cache (S, Hkv, C, d), contiguous (the slot buffers, read in place);
    row s reads its columns < key_len[s] (<= width). Sequence (s, j) of the varlen call is slot s's KV head j: its
    keys start at row (s, j) of the cache viewed as (S*Hkv*C, 1, d) and run for key_len[s] columns (`seqused_k`),
    its G = H/Hkv query heads are its G query tokens (the GQA group folded into the query axis: each key byte is
    read once, by one block). `meta`: (cu_q, cu_k, used) precomputed (`slots.FlashDecode`), else made here.
    Returns (out (S, H, 1, d), lse (S, H) float32).
    Why: the matmul path reads the whole width for every row, writes the (S, H, width) scores in fp32 and reads
    them back in three kernels; in a rollout whose episodes grow turn by turn most of the width is unused."""
    s, h, _, d = query.shape
    hkv, cols = key_cache.shape[1], key_cache.shape[2]
    g = h // hkv
    if meta is None:
        cu_q, cu_k, _, _ = flash_decode_offsets(s, hkv, g, cols, 1, query.device)
        meta = (cu_q, cu_k, keys_per_sequence(key_len, hkv))
    cu_q, cu_k, used = meta
    out, lse = kernel(query.reshape(s * h, 1, d), key_cache.view(s * hkv * cols, 1, d),
                      value_cache.view(s * hkv * cols, 1, d), cu_q, cu_k, g, width, scale, used)
    return out.reshape(s, h, 1, d), lse.reshape(s, h)


def prefix_decode_attention(
    query: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, scale: float,
    kernel=compat.flash_decode,  # noqa: ANN001 - or varlen_decode_reference in tests
    meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, prefix_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's query against the ONE shared-prefix copy, in one FlashAttention call: sequence j is KV head j,
    its queries the G heads of every row (S*G query tokens), its keys the prefix buffer's columns < used[j].
    query (S, H, 1, d); prefix_k/v (1, Hkv, Pcap, d) contiguous. `meta`: (cu_q, cu_k, used) precomputed
    (`slots.FlashDecode`), else made here for `prefix_len` columns. Returns (out (S, H, 1, d), lse (S, H)
    float32) for every row: rows that do not read the prefix are the caller's to mask (their lse)."""
    s, h, _, d = query.shape
    hkv, pcap = prefix_k.shape[1], prefix_k.shape[2]
    g = h // hkv
    if meta is None:
        _, _, cu_q, cu_k = flash_decode_offsets(s, hkv, g, 1, pcap, query.device)
        meta = (cu_q, cu_k, torch.full((hkv,), max(int(prefix_len or pcap), 1), device=query.device, dtype=torch.int32))
    cu_q, cu_k, used = meta
    qp = query.reshape(s, hkv, g, d).transpose(0, 1).reshape(hkv * s * g, 1, d)
    out, lse = kernel(qp, prefix_k.view(hkv * pcap, 1, d), prefix_v.view(hkv * pcap, 1, d), cu_q, cu_k, s * g,
                      pcap, scale, used)
    out = out.reshape(hkv, s, g, d).transpose(0, 1).reshape(s, h, 1, d)
    return out, lse.reshape(hkv, s, g).transpose(0, 1).reshape(s, h)


def slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """A slot cache (S, Hkv, C, d), contiguous, as varlen keys (rows, Hkv, d) without a copy: row
    `s*Hkv*C + c` is slot s's column c, its head j `C*d` further on (the heads are not adjacent in the slot
    layout, so the rows overlap: a strided view, in bounds - the last slot's rows stop at its last column)."""
    s, hkv, c, d = cache.shape
    return cache.as_strided(((s - 1) * hkv * c + c, hkv, d), (d, c * d, 1))


def slot_prefill_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, cu_q: torch.Tensor, starts: torch.Tensor,
    used: torch.Tensor, max_q: int, max_k: int, scale: float,
    kernel=compat.flash_decode,  # noqa: ANN001 - or varlen_decode_reference in tests
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill's packed new tokens against their slots' columns, read in place by one FlashAttention call
    (the GQA heads mapped by the kernel): row i's queries q[cu_q[i]:cu_q[i+1]] (N, H, d) read its slot's
    columns < used[i] (its kept turns and the new tokens, already written), causal aligned bottom-right;
    `starts[i]` = slot_i * Hkv * C, its first row in `slot_rows`. Returns (out (N, H, d), lse (H, N) float32).
    Why: the gather it replaces copied every kept column of every row into a packed buffer, per layer, and the
    shared prefix once per row (2026-11-29, H200, Craftax rollout at 256 envs: ~0.25 s of a step's device time
    in `index`, `gather` and `cat`, bench/results/logs/s43_prof_rollout_profile-*.txt)."""
    # max_q >= 2: a call whose every row has one new token would otherwise take the kernel's "one query, swap
    # the GQA group into the query axis" path, whose LSE comes back in another layout (an upper bound is allowed)
    return kernel(q, slot_rows(key_cache), slot_rows(value_cache), cu_q, starts, max(int(max_q), 2), int(max_k),
                  scale, used, causal=True)


def prefix_prefill_attention(
    q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    prefix_len: int, scale: float, kernel=compat.flash_decode,  # noqa: ANN001 - or varlen_decode_reference in tests
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every packed query token against the ONE shared-prefix copy (1, Hkv, Pcap, d), read in place: one
    sequence of N queries and the prefix's first `prefix_len` columns, not causal (the prefix precedes every
    row's own columns). `meta` = (cu_q [0, N], cu_k [0, rows], used [prefix_len]) int32. Returns (out (N, H, d),
    lse (H, N)): the rows that do not read the prefix are the caller's to mask (their lse)."""
    cu_q, cu_k, used = meta
    return kernel(q, slot_rows(prefix_k), slot_rows(prefix_v), cu_q, cu_k, max(q.shape[0], 2), int(prefix_len),
                  scale, used)


def prefill_in_place(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, cu_q: torch.Tensor, starts: torch.Tensor,
    used: torch.Tensor, max_q: int, max_k: int, scale: float, kernel,  # noqa: ANN001
    prefix: tuple[torch.Tensor, torch.Tensor, tuple, int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The prefill's attention over [shared prefix | own slot columns] without copying a key: the own part
    (`slot_prefill_attention`) and, where some rows read the prefix, the prefix part
    (`prefix_prefill_attention`) merged by their LSEs (`merge_attention`). `prefix` = (prefix_k, prefix_v,
    meta, prefix_len, reads (N,) bool: the query tokens whose row reads the prefix). Returns (N, H, d)."""
    out, lse = slot_prefill_attention(q, key_cache, value_cache, cu_q, starts, used, max_q, max_k, scale, kernel)
    if prefix is None:
        return out
    pk, pv, meta, p, reads = prefix
    o_p, lse_p = prefix_prefill_attention(q, pk, pv, meta, p, scale, kernel)
    lse_p = lse_p.masked_fill(~reads[None, :], float("-inf"))
    return merge_attention(o_p, lse_p.t(), out, lse.t())


def varlen_decode_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
    scale: float, used_k: torch.Tensor, causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`compat.flash_decode`'s contract, plainly (for tests): sequence i's queries q[cu_q[i]:cu_q[i+1]] read
    the keys k[cu_k[i] : cu_k[i] + used_k[i]]: all of them, or (`causal`) aligned bottom-right. Returns
    (out (Tq, H, d), lse (H, Tq) float32)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for i in range(len(cu_q) - 1):
        qa, qb, ka = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i])
        kb = ka + int(used_k[i])
        if not ka <= kb <= ka + max_k:
            raise ValueError(f"sequence {i} reads {kb - ka} keys, more than max_k {max_k}")
        if qb - qa > max_q or (causal and qb - qa > kb - ka):
            raise ValueError(f"sequence {i} has {qb - qa} queries: more than max_q {max_q} or (causal) its keys")
        o, l_ = attention_lse_reference(q[qa:qb].transpose(0, 1)[None], k[ka:kb].transpose(0, 1)[None],
                                        v[ka:kb].transpose(0, 1)[None], causal, scale)
        out[qa:qb] = o[0].transpose(0, 1)
        lse[:, qa:qb] = l_[0]
    return out, lse


def prefill_gather_reference(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, cu_q: torch.Tensor, slots: list[int],
    used: list[int], scale: float, prefix: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    prefix_rows: list[bool] | None = None,
) -> torch.Tensor:
    """`prefill_in_place`'s result the plain way (tests, probe): row i's keys gathered - the prefix's first p
    columns where `prefix_rows[i]`, then its slot's columns < used[i] - and `varlen_reference` over them."""
    ks, vs, cu_k = [], [], [0]
    for i, (s, n) in enumerate(zip(slots, used)):
        k, v = key_cache[s, :, :n], value_cache[s, :, :n]  # (Hkv, n, d)
        if prefix is not None and prefix_rows is not None and prefix_rows[i]:
            pk, pv, p = prefix
            k, v = torch.cat([pk[0, :, :p], k], 1), torch.cat([pv[0, :, :p], v], 1)
        ks.append(k.transpose(0, 1))
        vs.append(v.transpose(0, 1))
        cu_k.append(cu_k[-1] + k.shape[1])
    cu = torch.tensor(cu_k, dtype=torch.int32, device=q.device)
    return varlen_reference(q, torch.cat(ks), torch.cat(vs), cu_q, cu, 0, 0, scale)


_FLASH_PREFILL: dict[tuple[str, int, torch.dtype], bool] = {}
"""Per (device type, head dim, dtype): does `prefill_in_place` with FlashAttention agree with the gather there
(`probe_flash_prefill`)."""


def prefill_case(device: torch.device | str, head_dim: int, dtype: torch.dtype, prefix: bool = True) -> dict:
    """A small prefill over a slot cache with GQA, kept and new columns, rows with and without the shared prefix,
    one row of one new token and garbage past every row's columns: the arguments of `prefill_in_place` (its
    kernel left out) and of `prefill_gather_reference` (`probe_flash_prefill` and the tests share it)."""
    g = torch.Generator(device=device).manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=g).to(dtype)

    d, hkv, h, cols, pcap, p = int(head_dim), 2, 6, 12, 6, 4
    kc, vc, pk, pv = r(4, hkv, cols, d), r(4, hkv, cols, d), r(1, hkv, pcap, d), r(1, hkv, pcap, d)
    slots, new, used, rows = [3, 0, 2], [3, 1, 5], [7, 1, 11], [True, False, True]  # kept 4, 0 and 6 columns
    q = r(sum(new), h, d)
    dev = torch.device(device)
    i32 = dict(dtype=torch.int32, device=dev)
    cu_q = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], **i32)
    starts = torch.tensor([s * hkv * cols for s in slots] + [(3 * hkv + 1) * cols], **i32)
    reads = torch.tensor(sum(([x] * n for x, n in zip(rows, new)), []), device=dev)
    meta = (torch.tensor([0, sum(new)], **i32), torch.tensor([0, pcap], **i32), torch.tensor([p], **i32))
    return dict(
        inplace=(q, kc, vc, cu_q, starts, torch.tensor(used, **i32), max(new), max(used), d ** -0.5),
        prefix=(pk, pv, meta, p, reads) if prefix else None,
        reference=(q, kc, vc, cu_q, slots, used, d ** -0.5),
        reference_prefix=dict(prefix=(pk, pv, p), prefix_rows=rows) if prefix else {},
    )


def probe_flash_prefill(device: torch.device | str, head_dim: int = 64, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the batcher's prefill may read the slots in place (`prefill_in_place` through FlashAttention;
    CUDA only): tried once per (device type, head dim, dtype) on `prefill_case` against the gather, eagerly."""
    def agrees() -> bool:
        case = prefill_case(device, head_dim, dtype)
        got = prefill_in_place(*case["inplace"], compat.flash_decode, prefix=case["prefix"])
        want = prefill_gather_reference(*case["reference"], **case["reference_prefix"])
        return bool(torch.allclose(got.float(), want.float(), atol=2e-2))

    return _probe_once(_FLASH_PREFILL, device, head_dim, dtype, agrees, "the prefill over the slots in place",
                       "it gathers")


def _probe_once(results: dict, device: torch.device | str, head_dim: int, dtype: torch.dtype,
                agrees: Callable[[], bool], what: str, instead: str) -> bool:
    """A kernel's probe, run once per (device type, head dim, dtype) and remembered in `results`: CUDA only;
    `agrees()` compares the kernel with its reference on a small case, and a kernel that raises (a head dim or
    dtype it does not take) is refused here, said in the log with what runs `instead`."""
    kind = torch.device(device).type
    if kind != "cuda":
        return False
    key = (kind, int(head_dim), dtype)
    if key not in results:
        ok = False
        try:
            ok = agrees()
        except (RuntimeError, AttributeError, NotImplementedError, TypeError, ValueError) as e:
            log.info("%s is unavailable for head dim %d, %s (%s): %s", what, head_dim, dtype, e, instead)
        results[key] = ok
    return results[key]


_FLASH_DECODE: dict[tuple[str, int, torch.dtype], bool] = {}
"""Per (device type, head dim, dtype): does `slot_decode_attention` agree with `gqa_decode_attention` there
(`probe_flash_decode`)."""


def probe_flash_decode(device: torch.device | str, head_dim: int = 64, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the batcher's decode may read the slots through `slot_decode_attention` (CUDA only): tried once
    per (device type, head dim, dtype) on a tiny GQA slot cache against the matmul path (eagerly: never inside a
    capture). A head dim or dtype the kernel does not take is refused here, not in the middle of a step."""
    def agrees() -> bool:
        g = torch.Generator(device=device).manual_seed(0)

        def r(*shape):  # noqa: ANN002, ANN202
            return torch.randn(*shape, device=device, generator=g).to(dtype)

        d = int(head_dim)
        q, kc, vc = r(3, 4, 1, d), r(3, 2, 9, d), r(3, 2, 9, d)
        key_len = torch.tensor([1, 5, 8], device=device)
        mask = (torch.arange(8, device=device)[None, :] < key_len[:, None])[:, None, None, :]
        scale = d ** -0.5
        want, want_lse = gqa_decode_attention(q, kc[:, :, :8], vc[:, :, :8], mask, scale, True)
        got, got_lse = slot_decode_attention(q, kc, vc, key_len, 8, scale)
        return bool(torch.allclose(got.float(), want.float(), atol=2e-2)
                    and torch.allclose(got_lse, want_lse, atol=2e-2))

    return _probe_once(_FLASH_DECODE, device, head_dim, dtype, agrees, "flash decode over the slots",
                       "the decode step's attention is the matmul path")
