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

log = logging.getLogger(__name__)

PACKED_ATTN = "thinkcraft_packed"


# ------------------------------------------------------------------------------------------ attention kernels


def sdpa_per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                      scale: float) -> torch.Tensor:
    """Varlen causal attention as one sdpa call per sequence (CPU, and the reference the CUDA kernels are
    probed against): q (T, H, d), k/v (T, Hkv, d) packed, sequence i = rows cu[i]:cu[i+1]. Returns (T, H, d)."""
    bounds = cu.tolist()
    outs = [torch.nn.functional.scaled_dot_product_attention(
        q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None], is_causal=True,
        scale=scale, enable_gqa=True)[0].transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, 0)


def _flash(kernel: str) -> Callable[..., torch.Tensor]:
    def run(q, k, v, cu, max_len, scale):  # noqa: ANN001, ANN202
        from thinkcraft.llm.attention import VARLEN_KERNELS

        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return VARLEN_KERNELS[kernel](q, k, v, cu, cu, max_len, max_len, scale)
    return run


TRAIN_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "aten": _flash("aten"),  # aten::_flash_attention_forward, differentiable through derivatives.yaml
    "public": _flash("public"),  # torch.nn.attention.varlen.varlen_attn: a registered backward (torch >= 2.10)
    "sdpa": sdpa_per_sequence,
}
"""Varlen causal attention with a backward: q (T, H, d), k/v (T, Hkv, d), cu (n+1,) int32, max_len, scale."""

CUDA_CANDIDATES = ("aten", "public")
"""Tried in this order: the private op first, as the engine's cascade (`attention.VARLEN_DEFAULT`; torch 2.11's
public `varlen_attn` fails the engine's probe on the GPU image, bench/HISTORY.md)."""
_CHOSEN: dict[str, str | None] = {}
"""Per device type: the kernel `packed_attention_forward` uses (filled by `packed_kernel`)."""


def packed_kernel(device: torch.device | str) -> str | None:
    """The varlen kernel for training on this device, probed once: CPU -> "sdpa" (one call per sequence);
    CUDA -> the first of CUDA_CANDIDATES whose forward and backward agree with "sdpa" on a tiny GQA input
    in bf16; None when none does (the learner then pads, and says so)."""
    kind = torch.device(device).type
    if kind not in _CHOSEN:
        _CHOSEN[kind] = "sdpa" if kind != "cuda" else next(
            (k for k in CUDA_CANDIDATES if _agrees(k, torch.device(device))), None)
    return _CHOSEN[kind]


def _agrees(kernel: str, device: torch.device) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(7, h, 64, device=device, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 7], device=device, dtype=torch.int32)
    try:
        grads = []
        for name, dtype in ((kernel, torch.bfloat16), ("sdpa", torch.float32)):
            x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            out = TRAIN_KERNELS[name](*x, cu, 4, 0.125)
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
    cu, max_len = varlen
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    kind = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(kind):
        # fp32 master weights (full fine-tuning): RoPE with fp32 cos/sin promotes q, k to fp32 under autocast;
        # sdpa would be autocast to bf16, the flash kernels take only half precision (transformers' own FA2
        # path casts the same way: `fa_peft_integration_check`)
        dt = torch.get_autocast_dtype(kind)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    kernel = TRAIN_KERNELS[_CHOSEN.get(kind) or "sdpa"]
    out = kernel(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu, max_len, scale)
    return out[None], None


def register_packed_attention() -> str:
    return compat.register_maskless_attention(PACKED_ATTN, packed_attention_forward)


# ------------------------------------------------------------------------------------------ micro-batch plans


class MicroBatch(NamedTuple):
    """One forward/backward over rows [start, end) of a batch; the tensors are on the learner's device."""

    start: int
    end: int
    width: int  # the longest row: its loss tensors are (rows, width - 1), as `build_rows` lays them out
    tokens: int  # real tokens
    trained_tokens: int  # positions whose next token is trained
    trained_seqs: int  # sequences (turns: a merged episode row counts each of its turns) with at least one
    packed: bool
    pred: torch.Tensor  # (n,) trained positions along the layout's flat token axis (packed: T; padded: rows*width)
    scatter: torch.Tensor  # (n,) the same positions in the flattened (rows, width - 1) loss layout
    gather: torch.Tensor | None = None  # packed: (T,) indices into the batch's flattened (B, L) input ids
    positions: torch.Tensor | None = None  # packed: (1, T) position ids, from 0 in every row
    cu_seqlens: torch.Tensor | None = None  # packed: (rows + 1,) int32 row boundaries


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


def plan(lengths: np.ndarray, loss_mask: np.ndarray, token_budget: int, max_rows: int, packed: bool,
         device: torch.device, seqs: np.ndarray | None = None) -> list[MicroBatch]:
    """Micro-batches of a batch from its host-side row lengths (B,) and loss mask (B, L-1): boundaries, and
    every index tensor built with numpy (no per-row Python) and sent to the device in two transfers.
    `seqs` (B,): trained sequences in each row (`RowTurns.seqs_per_row`; None: one per row with a trained
    token)."""
    L = loss_mask.shape[1] + 1
    trained = loss_mask > 0
    spans = boundaries(lengths, token_budget, max_rows, packed)
    longs: list[np.ndarray] = []  # pred, scatter[, gather, positions] of every micro-batch, concatenated
    cus: list[np.ndarray] = []
    meta = []
    for s, e in spans:
        lens = lengths[s:e]
        w = int(lens.max())
        ri, q = np.nonzero(trained[s:e, : max(w - 1, 0)])
        off = np.concatenate([[0], np.cumsum(lens)[:-1]])
        parts = [off[ri] + q if packed else ri * w + q, ri * (w - 1) + q]
        if packed:
            t = int(lens.sum())
            parts += [np.arange(t) + np.repeat(np.arange(s, e) * L - off, lens), np.arange(t) - np.repeat(off, lens)]
            cus.append(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        longs += parts
        n_seqs = int(seqs[s:e].sum()) if seqs is not None else int(trained[s:e].any(1).sum())
        meta.append((s, e, w, int(lens.sum()), len(ri), n_seqs, [len(p) for p in parts]))
    flat = _to_device(np.concatenate(longs).astype(np.int64) if longs else np.zeros(0, np.int64), device)
    cu_flat = _to_device(np.concatenate(cus), device) if cus else None
    out, at, cu_at = [], 0, 0
    for s, e, w, tokens, n_tok, n_seqs, sizes in meta:
        views = []
        for n in sizes:
            views.append(flat[at: at + n])
            at += n
        if packed:
            cu = cu_flat[cu_at: cu_at + e - s + 1]
            cu_at += e - s + 1
            out.append(MicroBatch(s, e, w, tokens, n_tok, n_seqs, True, views[0], views[1], views[2], views[3][None], cu))
        else:
            out.append(MicroBatch(s, e, w, tokens, n_tok, n_seqs, False, views[0], views[1]))
    return out


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def host_rows(attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(lengths (B,), loss mask (B, L-1)) on the host, in one device-to-host copy."""
    both = torch.cat([attention_mask.sum(-1, keepdim=True).to(loss_mask.dtype), loss_mask], 1).cpu().numpy()
    return both[:, 0].astype(np.int64), both[:, 1:]


def layout_summary(mbs: list[MicroBatch]) -> dict[str, Any]:
    """Host-known sizes of a plan, as metrics."""
    tokens = sum(m.tokens for m in mbs)
    slots = sum(m.tokens if m.packed else (m.end - m.start) * m.width for m in mbs)
    return {"learner/tokens": float(tokens), "learner/micro_batches": float(len(mbs)),
            "learner/pad_frac": 1.0 - tokens / slots if slots else 0.0,
            "learner/packed": float(bool(mbs) and mbs[0].packed)}
