"""Packed training: a batch's rows (a turn each, or an episode's turns as one row: `learner.build_rows`) in
micro-batches of a token budget, each one dense sequence (no padding) with attention kept within each row.

A micro-batch of rows [start, end) is laid out either

    packed   one (1, T) row of the turns' real tokens back to back, position ids restarting at 0 in each turn,
             and varlen attention over the boundaries `cu_seqlens` (FlashAttention-2 varlen on CUDA through
             torch's private op or its public `varlen_attn`; on CPU one causal sdpa per turn). The attention
             function is registered without a mask function (`compat.register_maskless_attention`), so
             transformers builds no (T, T) mask and never reads the boundaries back on the host.
    padded   (rows, longest) right-padded rows with an attention mask (transformers' sdpa), the old layout:
             the fallback where no varlen kernel runs, and the benchmarks' baseline.

Either way only the positions whose next token is trained (loss mask > 0) go through the LM head
(`MicroBatch.pred`), and their log-probs are scattered back into the (rows, longest - 1) layout of
`learner.build_rows` (`MicroBatch.scatter`), where the losses of `rl.llm_losses` read them unchanged.

Everything index-like is computed on the host with numpy from one copy of the lengths and loss mask, and sent
to the device in one transfer: the micro-batch loop itself never reads a device value.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from thinkcraft.llm import compat
from thinkcraft.utils.transfer import to_device

log = logging.getLogger(__name__)

PACKED_ATTN = "thinkcraft_packed"


# ------------------------------------------------------------------------------------------ attention kernels


def sdpa_per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                      max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Varlen causal attention as one sdpa call per sequence (CPU, and the reference the CUDA kernels are
    probed against): q (Tq, H, d), k/v (Tk, Hkv, d) packed, sequence i = q rows cu_q[i]:cu_q[i+1] against k/v
    rows cu_k[i]:cu_k[i+1]; causal aligned bottom-right (a sequence with more keys than queries - a shared
    prefix's keys in front of its own - sees all of them). Returns (Tq, H, d)."""
    qb, kb = cu_q.tolist(), cu_k.tolist()
    outs = []
    for a, b, c, d in zip(qb[:-1], qb[1:], kb[:-1], kb[1:]):
        n_q, n_k = b - a, d - c
        mask = None if n_q == n_k else torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], k[c:d].transpose(0, 1)[None], v[c:d].transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs, 0)


def _flash(kernel: str) -> Callable[..., torch.Tensor]:
    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale):  # noqa: ANN001, ANN202
        from thinkcraft.llm.attention import VARLEN_KERNELS

        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return VARLEN_KERNELS[kernel](q, k, v, cu_q, cu_k, max_q, max_k, scale)
    return run


TRAIN_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "aten": _flash("aten"),  # aten::_flash_attention_forward, differentiable through derivatives.yaml
    "public": _flash("public"),  # torch.nn.attention.varlen.varlen_attn: a registered backward (torch >= 2.10)
    "sdpa": sdpa_per_sequence,
}
"""Varlen causal attention (bottom-right aligned) with a backward: q (Tq, H, d), k/v (Tk, Hkv, d), cu_q, cu_k
(n+1,) int32, max_q, max_k, scale."""

KV_INDEX_KWARG = "thinkcraft_kv_index"
"""Forward kwarg of a micro-batch whose rows share a prefix (`plan(prefix=P)`): (Tk,) rows of the packed keys
and values that make each sequence's keys [shared prefix | own suffix] (`packed_attention_forward`)."""

CUDA_CANDIDATES = ("aten", "public")
"""Tried in this order: the private op first, as the engine's cascade (`attention.VARLEN_DEFAULT`; torch 2.11's
public `varlen_attn` fails the engine's probe on the GPU image, bench/HISTORY.md)."""
_CHOSEN: dict[str, str | None] = {}
"""Per device type: the kernel `packed_attention_forward` uses (filled by `packed_kernel`)."""
_SHARES: dict[str, bool] = {}
"""Per device type: does that kernel also compute a shared prefix's layout right (filled by `shares_prefix`)."""


def packed_kernel(device: torch.device | str) -> str | None:
    """The varlen kernel for training on this device, probed once: CPU -> "sdpa" (one call per sequence);
    CUDA -> the first of CUDA_CANDIDATES whose forward and backward agree with "sdpa" on a tiny GQA input
    in bf16; None when none does (the learner then pads, and says so)."""
    kind = torch.device(device).type
    if kind not in _CHOSEN:
        _CHOSEN[kind] = "sdpa" if kind != "cuda" else next(
            (k for k in CUDA_CANDIDATES if _agrees(k, torch.device(device))), None)
    return _CHOSEN[kind]


def shares_prefix(device: torch.device | str) -> bool:
    """Whether this device's training kernel (`packed_kernel`) also computes a shared prefix's layout right -
    queries [prefix | row | row ...], each row's keys [prefix | own] with bottom-right causality - forward and
    backward against "sdpa" (probed once; the learner then computes its rows' common prefix once per
    micro-batch, `plan(prefix=)`)."""
    kind = torch.device(device).type
    kernel = packed_kernel(device)
    if kernel is None:
        return False
    if kind not in _SHARES:
        _SHARES[kind] = kernel == "sdpa" or _agrees(kernel, torch.device(device), prefixed=True)
    return _SHARES[kind]


def _agrees(kernel: str, device: torch.device, prefixed: bool = False) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(7, h, 64, device=device, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 7], device=device, dtype=torch.int32)
    # prefixed: a shared prefix's layout, queries [prefix 2 | 2 | 3], keys [prefix | prefix + 2 | prefix + 3]
    kv = torch.tensor([0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 6], device=device)
    cu_q, cu_k = (torch.tensor(c, device=device, dtype=torch.int32) for c in ([0, 2, 4, 7], [0, 2, 6, 11]))
    try:
        grads = []
        for name, dtype in ((kernel, torch.bfloat16), ("sdpa", torch.float32)):
            x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            fn = TRAIN_KERNELS[name]
            out = (fn(x[0], x[1][kv], x[2][kv], cu_q, cu_k, 3, 5, 0.125) if prefixed
                   else fn(*x, cu, cu, 4, 4, 0.125))
            out.float().square().sum().backward()
            grads.append([out.float()] + [t.grad.float() for t in x])
        return all(torch.allclose(a, b, atol=5e-2, rtol=5e-2) for a, b in zip(*grads))
    except (RuntimeError, AttributeError, NotImplementedError, TypeError, ValueError) as e:
        log.info("varlen training kernel %s unavailable on %s: %s", kernel, device, e)
        return False


def packed_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):  # noqa: ANN001, ANN201
    """transformers attention function (`sdpa_attention_forward`'s signature) for one packed (1, T) row: the
    boundaries come from `compat.varlen_kwargs`; without them, plain sdpa."""
    varlen = compat.varlen_from_kwargs(kwargs)
    if varlen is None:
        return compat.sdpa_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                     **kwargs)
    if dropout or kwargs.get("sliding_window") or kwargs.get("softcap") or query.shape[0] != 1:
        raise ValueError("packed attention supports one packed row of full causal attention without dropout")
    cu_q, cu_k, max_q, max_k = varlen
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    kind = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(kind):
        # fp32 master weights (full fine-tuning): RoPE with fp32 cos/sin promotes q, k to fp32 under autocast;
        # sdpa would be autocast to bf16, the flash kernels take only half precision (transformers' own FA2
        # path casts the same way: `fa_peft_integration_check`)
        dt = torch.get_autocast_dtype(kind)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    kernel = TRAIN_KERNELS[_CHOSEN.get(kind) or "sdpa"]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    kv_index = kwargs.get(KV_INDEX_KWARG)
    if kv_index is not None:  # a shared prefix: its keys and values copied in front of each row's own
        k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
    out = kernel(query[0].transpose(0, 1), k, v, cu_q, cu_k, max_q, max_k, scale)
    return out[None], None


def register_packed_attention() -> str:
    return compat.register_maskless_attention(PACKED_ATTN, packed_attention_forward)


# ------------------------------------------------------------------------------------------ micro-batch plans


class MicroBatch(NamedTuple):
    """One forward/backward over rows [start, end) of a batch; the tensors are on the learner's device."""

    start: int
    end: int
    width: int  # the longest row: its loss tensors are (rows, width - 1), as `build_rows` lays them out
    tokens: int  # tokens the forward computes (real tokens; a shared prefix once)
    trained_tokens: int  # positions whose next token is trained
    trained_seqs: int  # sequences (turns: a merged episode row counts each of its turns) with at least one
    packed: bool
    pred: torch.Tensor  # (n,) trained positions along the layout's flat token axis (packed: T; padded: rows*width)
    scatter: torch.Tensor  # (n,) the same positions in the flattened (rows, width - 1) loss layout
    gather: torch.Tensor | None = None  # packed: (T,) indices into the batch's flattened (B, L) input ids
    positions: torch.Tensor | None = None  # packed: (1, T) position ids, from 0 in every row
    cu_seqlens: torch.Tensor | None = None  # packed: (sequences + 1,) int32 query boundaries
    target: torch.Tensor | None = None  # packed: (n,) each trained position's next token in the flat (B, L) ids
    max_len: int = 0  # packed: the longest sequence of queries
    shared: int = 0  # tokens not computed: a shared prefix's copies in rows after the first
    kv_index: torch.Tensor | None = None  # shared prefix: (Tk,) packed rows of each sequence's keys
    cu_k: torch.Tensor | None = None  # shared prefix: (sequences + 1,) int32 key boundaries
    max_k: int = 0  # shared prefix: the longest sequence of keys

    def varlen(self) -> dict[str, Any]:
        """The packed forward's attention kwargs (`packed_attention_forward`)."""
        kw = compat.varlen_kwargs(self.cu_seqlens, self.max_len, self.cu_k, self.max_k or None)
        return kw if self.kv_index is None else {**kw, KV_INDEX_KWARG: self.kv_index}


def boundaries(lengths: np.ndarray, token_budget: int, max_rows: int, packed: bool) -> list[tuple[int, int]]:
    """Consecutive row ranges, each as many rows as fit `token_budget` tokens (packed: their real tokens;
    padded: rows x the longest) and at most `max_rows` rows (0 = no limit). A row longer than the budget
    gets a micro-batch of its own."""
    out, start, width, tokens = [], 0, 0, 0
    for i, n in enumerate(lengths.tolist()):
        rows = i - start
        grown = tokens + n if packed else (rows + 1) * max(width, n)
        if rows and (grown > token_budget or (max_rows and rows >= max_rows)):
            out.append((start, i))
            start, width, grown = i, 0, n
        tokens, width = grown, max(width, n)
    if len(lengths):
        out.append((start, len(lengths)))
    return out


def ragged_arange(n: np.ndarray) -> np.ndarray:
    """0..n[0]-1, 0..n[1]-1, ... concatenated."""
    return np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)


def plan(lengths: np.ndarray, loss_mask: np.ndarray, token_budget: int, max_rows: int, packed: bool,
         device: torch.device, seqs: np.ndarray | None = None, prefix: int = 0) -> list[MicroBatch]:
    """Micro-batches of a batch from its host-side row lengths (B,) and loss mask (B, L-1): boundaries, and
    every index tensor built with numpy (no per-row Python) and sent to the device in two transfers.
    `seqs` (B,): trained sequences in each row (`RowTurns.seqs_per_row`; None: one per row with a trained
    token).

    `prefix` P (packed only; every row's first P tokens are the same and every row is longer): each
    micro-batch computes those tokens once - its layout is [prefix | row 1 after it | row 2 after it | ...],
    the prefix's keys and values copied in front of each row's own (`kv_index`, causal bottom-right), so each
    row attends exactly as alone. A trained position inside the prefix reads the shared hidden state (the same
    values: the tokens before it are the same). The token budget counts computed tokens."""
    L = loss_mask.shape[1] + 1
    P = int(prefix) if packed else 0
    if P and not (lengths > P).all():
        raise ValueError(f"a shared prefix of {P} tokens needs every row longer (shortest {int(lengths.min())})")
    spans = boundaries(lengths - P, max(token_budget - P, 1), max_rows, packed)  # the budget counts computed tokens
    trained = loss_mask > 0
    longs: list[np.ndarray] = []  # pred, scatter[, gather, positions, target[, kv_index]] of every micro-batch
    cus: list[np.ndarray] = []  # cu_q[, cu_k]
    meta = []
    for s, e in spans:
        lens = lengths[s:e]
        w = int(lens.max())
        ri, q = np.nonzero(trained[s:e, : max(w - 1, 0)])
        scatter = ri * (w - 1) + q
        target = (s + ri) * L + q + 1
        shared, maxes, cu_parts = 0, (0, 0), []
        if not packed:
            parts = [ri * w + q, scatter]
        else:  # [prefix (P tokens, P may be 0) | row s after it | row s+1 after it | ...]
            ls = lens - P  # each row after the prefix
            soff = P + np.concatenate([[0], np.cumsum(ls)[:-1]])  # where each row's own tokens start
            t = P + int(ls.sum())
            gather = np.concatenate([s * L + np.arange(P), np.arange(P, t) + np.repeat(np.arange(s, e) * L + P - soff, ls)])
            positions = np.concatenate([np.arange(P), np.arange(P, t) - np.repeat(soff - P, ls)])
            parts = [np.where(q < P, q, soff[ri] + q - P), scatter, gather, positions, target]
            cu_parts = [np.concatenate([[0, P] if P else [0], P + np.cumsum(ls)])]
            maxes = (max(P, int(ls.max())), 0)
            if P:  # each row's keys: the prefix's, then its own
                blk = P + ls
                within = ragged_arange(blk)
                parts.append(np.concatenate([np.arange(P), np.where(within < P, within, within + np.repeat(soff - P, blk))]))
                cu_parts.append(np.concatenate([[0, P], P + np.cumsum(blk)]))
                maxes, shared = (maxes[0], w), (e - s - 1) * P
        longs += parts
        cus += cu_parts
        n_seqs = int(seqs[s:e].sum()) if seqs is not None else int(trained[s:e].any(1).sum())
        meta.append((s, e, w, int(lens.sum()) - shared, len(ri), n_seqs, [len(p) for p in parts],
                     [len(c) for c in cu_parts], maxes, shared))
    flat = to_device(np.concatenate(longs).astype(np.int64) if longs else np.zeros(0, np.int64), device)
    cu_flat = to_device(np.concatenate(cus).astype(np.int32), device) if cus else None
    out, at, cu_at = [], 0, 0
    for s, e, w, tokens, n_tok, n_seqs, sizes, cu_sizes, (max_q, max_k), shared in meta:
        views = []
        for n in sizes:
            views.append(flat[at: at + n])
            at += n
        cuv = []
        for n in cu_sizes:
            cuv.append(cu_flat[cu_at: cu_at + n])
            cu_at += n
        if not packed:
            out.append(MicroBatch(s, e, w, tokens, n_tok, n_seqs, False, views[0], views[1]))
            continue
        extra = dict(kv_index=views[5], cu_k=cuv[1], max_k=max_k) if len(views) > 5 else {}
        out.append(MicroBatch(s, e, w, tokens, n_tok, n_seqs, True, views[0], views[1], views[2], views[3][None],
                              cuv[0], views[4], max_q, shared, **extra))
    return out




def host_rows(attention_mask: torch.Tensor, loss_mask: torch.Tensor, input_ids: torch.Tensor | None = None
              ) -> tuple[np.ndarray, np.ndarray, int]:
    """(lengths (B,), loss mask (B, L-1), tokens every row starts with (0 without `input_ids`)) on the host,
    in one device-to-host copy."""
    cols = [attention_mask.sum(-1, keepdim=True).to(loss_mask.dtype), loss_mask]
    if input_ids is not None:  # the common prefix: columns where every row holds row 0's token, up to the first not
        same = (input_ids == input_ids[:1]).all(0).to(torch.int32).cumprod(0).sum()
        cols.append(same.to(loss_mask.dtype).expand(len(loss_mask), 1))
    both = torch.cat(cols, 1).cpu().numpy()
    common = int(both[0, -1]) if input_ids is not None and len(both) else 0
    return both[:, 0].astype(np.int64), both[:, 1: loss_mask.shape[1] + 1], common


MIN_SHARED_PREFIX = 32
"""A common prefix shorter than this is not shared (`Learner.plan`): the copies of its keys cost about what
computing it again would save."""


def layout_summary(mbs: list[MicroBatch]) -> dict[str, Any]:
    """Host-known sizes of a plan, as metrics."""
    tokens = sum(m.tokens for m in mbs)
    slots = sum(m.tokens if m.packed else (m.end - m.start) * m.width for m in mbs)
    shared = sum(m.shared for m in mbs)
    # learner/tokens: the rows' real tokens (a shared prefix counted in every row, as before it was shared)
    return {"learner/tokens": float(tokens + shared), "learner/micro_batches": float(len(mbs)),
            "learner/pad_frac": 1.0 - tokens / slots if slots else 0.0,
            "learner/packed": float(bool(mbs) and mbs[0].packed),
            "learner/prefix_shared_tokens": float(shared), "learner/tokens_computed": float(tokens)}
