"""A decode step's sampling in one pass over each row's logits: the next token and the row's logsumexp.

Why: the sampler ran as separate torch kernels over every slot's float32 logits - divide by the temperature,
softmax, an exponential fill, divide, argmax, plus the greedy argmax and (for the behaviour log-probs) a
logsumexp - each reading (and most writing) the whole (slots x vocabulary) tensor: 78 MB a pass at 128 slots
of Qwen's 151,936-token vocabulary, ~10 passes a step. The arith loops' decode step is device-bound (the host
waits 1.0-1.4 ms of its ~1.8 ms, 2 x / 4 x H200, 2026-11-29) and grows with its rows; one read instead of ~10 is
~0.2 ms a step by the bytes (not measured on a GPU yet).

What: one Triton program per row walks its logits in blocks, keeping per lane a running maximum and sum of
exponentials (the logsumexp at temperature 1, for the log-probs), the greedy argmax, and the argmax of
`logit / T + Gumbel noise` - a sample of softmax(logits / T) (the Gumbel-max trick; what `rows.sample_rows`
computes as argmax(p / E) with E ~ Exp(1), the same distribution from another noise stream). Greedy where the
temperature is 0 (first index of the maximum, as torch.argmax). The noise is Philox keyed by a seed read from a
device tensor and the element's counter (four numbers a call, `tl.randint4x`; else one, `tl.rand`); the seed
tensor advances after each call, so a captured CUDA graph draws new noise at every replay. Top-p (a sort) and
per-call seeded generators keep the torch path.

Safety: the first call on a device checks the kernel against torch (greedy tokens, logsumexp, sampled tokens never
masked, the draws of a repeated row against softmax(logits / T) - a broken noise source would pass the rest),
the four-a-call noise first, then one a call; both failing - no Triton, a compile error, a mismatch - turns it off
for good with one warning and the torch path runs. On the CPU it serves only under Triton's interpreter (TRITON_INTERPRET=1, the
tests). `THINKCRAFT_FUSED_SAMPLER=0` turns it off (the A/B switch; on by default).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from thinkcraft.utils.errors import env_switch
from thinkcraft.llm.hf.triton_device import FirstUseChecks, interpreted, runs_on

log = logging.getLogger(__name__)

BLOCK = 2048
"""Vocabulary entries a program reads at a time (per lane state: BLOCK floats of each running value); with
`NUM_WARPS` warps a program has 8 KB of float32 loads in flight per step of its loop (one program per row: the
rows, not the vocabulary, spread over the SMs)."""
NUM_WARPS = 8

_kernel: Any = None
launches = 0
"""Calls of the kernel in this process (host launches; a graph's replays are not counted): what a test reads."""


def fused_sampler_on() -> bool:
    """THINKCRAFT_FUSED_SAMPLER: "1" (default) samples with the one-pass kernel where it serves, "0" never."""
    return env_switch("THINKCRAFT_FUSED_SAMPLER", default=True)



def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def sample_kernel(logits_ptr, stride, temp_ptr, seed_ptr, tok_ptr, lse_ptr, V, BLOCK: tl.constexpr,
                      FOUR: tl.constexpr):
        row = tl.program_id(0)
        t = tl.load(temp_ptr + row)
        inv_t = 1.0 / tl.maximum(t, 1e-6)
        seed = tl.load(seed_ptr)
        lanes = tl.arange(0, BLOCK)
        neg = float("-inf")
        m = tl.full([BLOCK], neg, tl.float32)  # running max of the logits (per lane)
        s = tl.zeros([BLOCK], tl.float32)  # running sum of exp(logit - m)
        g_val = tl.full([BLOCK], neg, tl.float32)  # greedy: best logit and its index
        g_idx = tl.zeros([BLOCK], tl.int32)
        r_val = tl.full([BLOCK], neg, tl.float32)  # sample: best logit / T + Gumbel noise and its index
        r_idx = tl.zeros([BLOCK], tl.int32)
        base = row.to(tl.int64) * stride
        quads = tl.cdiv(V, BLOCK) * (BLOCK // 4)  # Philox counters a row owns (FOUR: four numbers a counter)
        for start in range(0, V, BLOCK):
            offs = start + lanes
            valid = offs < V
            x = tl.load(logits_ptr + base + offs, mask=valid, other=neg).to(tl.float32)
            m_new = tl.maximum(m, x)
            # lanes still at -inf (nothing finite seen) keep a zero sum (exp(-inf - -inf) would be nan)
            safe = tl.where(m_new == neg, 0.0, m_new)
            s = s * tl.exp(tl.where(m == neg, neg, m - safe)) + tl.where(x == neg, 0.0, tl.exp(x - safe))
            m = m_new
            better = x > g_val
            g_val = tl.where(better, x, g_val)
            g_idx = tl.where(better, offs, g_idx)
            if FOUR:  # one Philox call gives four numbers: a quarter of the block's counters
                r0, r1, r2, r3 = tl.randint4x(seed, row * quads + start // 4 + tl.arange(0, BLOCK // 4))
                u = tl.uint_to_uniform_float(tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK]))
            else:
                u = tl.rand(seed, row * V + offs)
            gumbel = -tl.log(-tl.log(tl.minimum(tl.maximum(u, 1e-20), 1.0 - 1e-7)))
            score = tl.where(valid & (x != neg), x * inv_t + gumbel, neg)
            better = score > r_val
            r_val = tl.where(better, score, r_val)
            r_idx = tl.where(better, offs, r_idx)
        big = 2147483647
        mx = tl.max(m, 0)
        lse = mx + tl.log(tl.sum(tl.where(m == neg, 0.0, s * tl.exp(m - mx)), 0))
        gbest = tl.max(g_val, 0)
        greedy = tl.min(tl.where(g_val == gbest, g_idx, big), 0)  # the first index of the maximum
        rbest = tl.max(r_val, 0)
        sampled = tl.min(tl.where(r_val == rbest, r_idx, big), 0)
        tok = tl.where(t > 0, sampled, greedy)
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lse_ptr + row, lse)

    return sample_kernel


VARIANTS = ("four", "one")
"""Noise variants, tried in order at a device's check: Philox's four numbers a call (`tl.randint4x`, a quarter of
the generator's work), else one a call (`tl.rand`)."""


def sample_and_lse(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, variant: str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (S,) int64, logsumexp (S,) float32) of `logits` (S, V): a sample of softmax(logits / T) per row,
    greedy where T <= 0; `seed` (1,) int64 on the device, advanced by one here (a graph replays the advance).
    `variant`: the noise (`VARIANTS`; default: the one the device's check chose)."""
    global _kernel, launches
    launches += 1
    if _kernel is None:
        _kernel = _build()
    if variant is None:
        variant = _CHECKS.known(logits.device) or VARIANTS[0]
    s, v = logits.shape
    tok = torch.empty(s, dtype=torch.long, device=logits.device)
    lse = torch.empty(s, dtype=torch.float32, device=logits.device)
    _kernel[(s,)](logits, logits.stride(0), temperature, seed, tok, lse, v, BLOCK=BLOCK, FOUR=variant == "four",
                  num_warps=NUM_WARPS)
    seed.add_(1)
    return tok, lse


def fused_sampler_serves(logits: torch.Tensor) -> bool:
    """Whether `sample_and_lse` may serve these logits: the switch on, a CUDA device (or Triton's interpreter on
    the CPU), logits contiguous in the vocabulary, and the device's one-time check passed."""
    dev = logits.device
    if not fused_sampler_on() or logits.dim() != 2 or logits.stride(1) != 1:
        return False
    if not runs_on(dev):
        return False
    return _CHECKS.ok(dev)


def passed(dev: torch.device) -> bool:
    """Whether the kernel passed its check on `dev` in this process (False before its first use there)."""
    return _CHECKS.passed(dev)


def _check(dev: torch.device) -> str:
    """The first variant (`VARIANTS`) whose kernel agrees with torch on `dev` (`_CHECKS` keeps it), else a raise
    naming every variant's failure. Agreeing: greedy rows' tokens and every row's logsumexp equal, sampled tokens never
    a masked (-inf) one, the seed advanced, and the draws of one 6-token row repeated (4,096 times; 256 under the
    interpreter) within 5 standard errors of softmax(logits / T) - a broken noise source would pass the rest (its
    draws collapse on the greedy token)."""
    errors = []
    for variant in VARIANTS:
        try:
            g = torch.Generator(device="cpu").manual_seed(0)
            logits = (torch.randn(6, 3000, generator=g) * 4).to(dev)
            logits[:, ::7] = float("-inf")
            temp = torch.tensor([0.0, 1.0, 0.5, 0.0, 2.0, 1.0], device=dev)
            seed = torch.zeros(1, dtype=torch.long, device=dev)
            tok, lse = sample_and_lse(logits, temp, seed, variant)
            greedy = temp <= 0
            if not bool((tok[greedy] == logits.argmax(-1)[greedy]).all()):
                raise RuntimeError("greedy tokens differ from torch's argmax")
            if not torch.allclose(lse, torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-5):
                raise RuntimeError("the logsumexp differs from torch's")
            if not (bool(((tok >= 0) & (tok < 3000)).all()) and bool((tok % 7 != 0).all()) and int(seed.item()) == 1):
                raise RuntimeError("a token out of range or masked, or the seed not advanced")
            n = 256 if interpreted() else 4096
            row = torch.tensor([1.0, 0.2, -0.5, 0.8, -2.0, 0.0])
            t = 1.3
            draws = sample_and_lse(row.repeat(n, 1).to(dev), torch.full((n,), t, device=dev), seed, variant)[0]
            freq = torch.bincount(draws.cpu(), minlength=6).double() / n
            want = torch.softmax(row.double() / t, -1)
            if float((freq - want).abs().max()) > 5 * 0.5 / n ** 0.5:
                raise RuntimeError(f"its draws do not follow softmax(logits / T): {freq.tolist()} vs {want.tolist()}")
            return variant
        except Exception as e:  # noqa: BLE001 - no Triton, a compile error, a mismatch: the next variant
            errors.append(f"{variant}: {type(e).__name__}: {e}")
    raise RuntimeError("; ".join(errors))


_CHECKS = FirstUseChecks(_check, log, "the one-pass sampler", "sampling with torch")
