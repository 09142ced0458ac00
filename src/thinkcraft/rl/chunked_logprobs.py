"""Token log-probs through the LM head in chunks: never the whole (tokens x vocabulary) logits at once.

log π(t | h) = (h·W_t + b_t)/T − logsumexp_v((h·W_v + b_v)/T). With a real vocabulary (Qwen: 151,936 ids)
the full logits of a micro-batch of 8 x 1,000 tokens are ~5 GB in fp32, and autograd keeps them (and their
softmax) for the backward. Here the forward walks the rows in chunks, keeping only each row's picked logit and
log-sum-exp; the backward recomputes one chunk's logits at a time and turns them into the gradient in place:

    ∂ log π(t_i) / ∂ z_iv = ([v = t_i] − softmax(z_i)_v) / T,   z = hW^T + b

(the fused linear + cross-entropy of Liger-Kernel, Hsu et al. 2024, and of Apple's "Cut Your Losses",
Wijmans et al. 2024, without their custom kernels: one matmul per chunk each way, so peak memory is a chunk's
logits and the cost is one extra LM-head matmul, as activation checkpointing of the head would pay).

Dtypes are explicit (autocast is off inside): the matmuls run in `compute_dtype` (bf16 on GPU, as autocast
would run the head), logits and log-sum-exps in fp32, the weight's gradient accumulated in fp32 across chunks.
Tested equal to the full computation (`rl.llm_losses.token_logprobs`), values and gradients, in
tests/test_llm_losses.py.

Constrained decoding (`--action-format json`, llm/constrained.py) samples from the logits masked to the
tokens a grammar allows, renormalised: log π_c(t) = z_t − logsumexp_{v allowed} z_v. `allowed` (an
`AllowedTokens`) gives each row its allowed set; disallowed logits are −inf in that row's log-sum-exp and its
softmax, so their gradient is exactly 0 (tests/test_llm_action_format.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP32_BYTES = 4


def chunk_rows(vocab_size: int, chunk_mib: float) -> int:
    """Rows per chunk so that one chunk's fp32 logits take at most `chunk_mib` MiB (at least one row)."""
    return max(1, int(chunk_mib * 2**20) // (vocab_size * FP32_BYTES))


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Softmax precision: fp32, or the compute dtype where it is wider (float64 in gradient checks)."""
    return torch.promote_types(dtype, torch.float32)


class AllowedTokens(NamedTuple):
    """Per-row allowed sets for constrained log-probs: a table of distinct xgrammar bitmasks and each row's
    entry in it (`llm.constrained.replay_masks`)."""

    bitmask: torch.Tensor
    """(M, ceil(V/32)) int32: allowed sets (bit j of word w = token 32w + j)."""
    index: torch.Tensor
    """int64, one per row (for the learner's rows: (rows, width - 1), one per predicted position): the row of
    `bitmask`, or -1 for an unconstrained row (every token allowed)."""


def _mask_disallowed(z: torch.Tensor, allowed: AllowedTokens | None, a: int, b: int) -> torch.Tensor:
    """Rows a..b of the logits `z` with the tokens their grammar disallows at -inf (in place)."""
    if allowed is None:
        return z
    from thinkcraft.utils.structured import bitmask_to_bool

    idx = allowed.index[a:b]
    bits = allowed.bitmask[idx.clamp(min=0)]
    bits = torch.where((idx >= 0)[:, None], bits, torch.full_like(bits, -1))  # unconstrained: every bit set
    return z.masked_fill_(~bitmask_to_bool(bits, z.shape[-1]), float("-inf"))


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, temperature: float) -> torch.Tensor:
    z = torch.nn.functional.linear(h.to(w.dtype), w, b).to(_acc(w.dtype))
    return z.div_(temperature) if temperature != 1.0 else z


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, rows, compute_dtype, allowed):  # noqa: ANN001, ANN205
        cd = compute_dtype or hidden.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cd)
            b = bias.to(cd) if bias is not None else None
            n = hidden.shape[0]
            out = torch.empty(n, dtype=_acc(cd), device=hidden.device)
            lse = torch.empty(n, dtype=_acc(cd), device=hidden.device)
            for a in range(0, n, rows):
                z = _mask_disallowed(_chunk_logits(hidden[a: a + rows], w, b, temperature), allowed, a, a + rows)
                lse[a: a + rows] = torch.logsumexp(z, dim=-1)
                out[a: a + rows] = z.gather(-1, targets[a: a + rows, None]).squeeze(-1) - lse[a: a + rows]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.rows, ctx.cd, ctx.allowed = temperature, rows, cd, allowed
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        temperature, rows, cd = ctx.temperature, ctx.rows, ctx.cd
        g_h = torch.empty_like(hidden) if need_h else None
        acc = _acc(cd)
        g_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        g_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cd)
            b = bias.to(cd) if bias is not None else None
            grad_out = grad_out.to(acc)
            for a in range(0, hidden.shape[0], rows):
                h = hidden[a: a + rows].to(cd)
                g = grad_out[a: a + rows, None]
                # in place: logits -> (masked) softmax -> -g·softmax + g at the target -> / T
                z = _mask_disallowed(_chunk_logits(h, w, b, temperature), ctx.allowed, a, a + rows)
                p = z.sub_(lse[a: a + rows, None]).exp_().mul_(-g)
                p.scatter_add_(-1, targets[a: a + rows, None], g)
                if temperature != 1.0:
                    p.div_(temperature)
                if g_b is not None:
                    g_b += p.sum(0)
                dz = p.to(cd)
                del p
                if g_h is not None:
                    g_h[a: a + rows] = (dz @ w).to(hidden.dtype)
                if g_w is not None:
                    g_w += dz.t() @ h
        return (g_h, g_w.to(weight.dtype) if g_w is not None else None,
                g_b.to(bias.dtype) if g_b is not None else None, None, None, None, None, None)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    rows_per_chunk: int | None = None,
    compute_dtype: torch.dtype | None = None,
    allowed: AllowedTokens | None = None,
) -> torch.Tensor:
    """(N,) log softmax((hidden @ weight.T + bias) / T)[targets] (fp32; float64 for float64 inputs), differentiable in hidden, weight and
    bias, with at most `rows_per_chunk` rows of logits alive at once in the forward and in the backward
    (None: all N rows in one chunk).

    hidden (N, H); weight (V, H) (the LM head, `compat.plain_lm_head`); targets (N,) token ids. The matmuls
    run in `compute_dtype` (None: hidden's dtype). `allowed` ((N,) index): the softmax of each constrained
    row runs over its allowed tokens only (the distribution a grammar-constrained sampler drew from)."""
    n = hidden.shape[0]
    return _LinearTokenLogprobs.apply(hidden, weight, bias, targets, float(temperature),
                                      max(1, rows_per_chunk or n), compute_dtype, allowed)


def full_linear_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None,
    temperature: float = 1.0, compute_dtype: torch.dtype | None = None, allowed: AllowedTokens | None = None,
) -> torch.Tensor:
    """The same values through plain autograd: the full (N, V) logits at once (the reference, and the
    learner's `logit_chunk_mib=0` path that benchmarks measure against)."""
    cd = compute_dtype or hidden.dtype
    z = torch.nn.functional.linear(hidden.to(cd), weight.to(cd), None if bias is None else bias.to(cd)).to(_acc(cd))
    z = z / temperature if temperature != 1.0 else z
    if allowed is not None:  # out of place: autograd keeps the unmasked logits' graph
        z = _mask_disallowed(z.clone(), allowed, 0, z.shape[0])
    return z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
