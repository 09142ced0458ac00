"""Rotary position embedding as one kernel per tensor in the engine's no-grad forwards.

HF's `apply_rotary_pos_emb` is `q * cos + rotate_half(q) * sin` (and the same for k): two multiplies, a negation, a
concatenation and an add per tensor, each its own eager kernel over strided views of the fused q/k/v GEMM's output
(`fused_proj`). In the Craftax rollout's prefills (~23k tokens a call, Qwen2.5-0.5B shape, 256 envs, H200,
2026-12-02, `bench/llm_policy_craftax.py --profile-rollout 2`; that session's profile files were lost with it) those
ops were ~8 of a prefill call's ~75 ms of kernels (10 launches a layer, torch's generic strided kernel for the
multiplies). One Triton program per token reads the tensor where it lies, every head of it, and writes the rotated
tensor once. (A decode step compiled by inductor never gets here, `torch.compiler.is_compiling()`: inductor fuses the
same ops itself; the hand-captured decode graphs, the default, capture the kernel.)

Measured (1 x H200, 2026-12-03, 256 envs, queue sets craftax16/17, BENCHMARKS §7b): the decode phase 0.92-0.94 ->
0.82-0.83 s a rollout, but the packed prefill slower by ~0.05 s, and no change in the rollout (1,136 / 1,217
decisions/s against 1,139 / 1,137). Since then it serves decode-sized forwards only (`triton_device.FUSED_TOKENS_MAX`):
1,074 / 1,061 against 1,031 / 1,066 without it, within the machines' noise. On by default: bit-exact, and no slower.
Since 2026-12-04 it serves forwards of every size again (the bound's default, 0): with the prefill now bound by the
device, this kernel and the fused MLP's at every size took a prefill call from 81-84 to 65-69 ms of device time
(craftax28, BENCHMARKS §7b).

Values: equal to HF's, bit for bit - each eager op's rounding in its order: `q * cos` and `rotate_half(q) * sin`
computed in fp32 (exact: a product of two half-precision numbers fits fp32's mantissa) and rounded to the half dtype,
their sum in fp32 rounded again; the negation is exact. The first use on a device checks that equality against the
model module's own function over strided inputs shaped like the prefill's (any difference, a Triton that cannot
compile it: one warning, HF's ops). The output has the strides HF's ops give it (the token-major layout of the
GEMM's output), so what follows reads the same tensor either way.

Where: the module-level `apply_rotary_pos_emb` of a model module whose attention's forward calls it (`install`
wraps it once per module; `strip` puts it back), for calls that are no-grad, within `FUSED_TOKENS_MAX` (default: any size), outside compilation, on
CUDA (or Triton's interpreter on the CPU: the tests), a half dtype with cos/sin of the same, `unsqueeze_dim` 1, 4-D q/k with
contiguous last dims, a power-of-two head dim; anything else goes to HF's function unchanged. The learner (grads
on) and the compiled decode step never take it. THINKCRAFT_FUSED_ROPE=0: HF's ops (the A/B switch).
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import torch

from thinkcraft.llm.hf.triton_device import FirstUseChecks, fused_size, pow2_at_least, runs_on
from thinkcraft.utils.errors import env_switch

log = logging.getLogger(__name__)

_HALF = (torch.bfloat16, torch.float16)
_kernel: Any = None
_MARK = "_thinkcraft_fused_rope_original"
calls = 0
"""Fused calls in this process (what a test reads)."""


def fused_rope_on() -> bool:
    """THINKCRAFT_FUSED_ROPE: "1" (default) where it serves, "0" never."""
    return env_switch("THINKCRAFT_FUSED_ROPE", default=True)


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(x_ptr, cos_ptr, sin_ptr, o_ptr, T, sx_b, sx_h, sx_t, sc_b, sc_t, so_b, so_h, so_t,
                    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BF16: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        b = pid // T
        t = pid % T
        d = tl.arange(0, D)
        half: tl.constexpr = D // 2
        partner = (d + half) % D  # rotate_half: [-x2, x1]
        sign = tl.where(d < half, -1.0, 1.0)
        c = tl.load(cos_ptr + b * sc_b + t * sc_t + d).to(tl.float32)
        s = tl.load(sin_ptr + b * sc_b + t * sc_t + d).to(tl.float32)
        h = tl.arange(0, HP)[:, None]
        mask = h < H
        src = x_ptr + b * sx_b + h * sx_h + t * sx_t
        x = tl.load(src + d[None, :], mask=mask, other=0.0)
        xr = tl.load(src + partner[None, :], mask=mask, other=0.0).to(tl.float32) * sign[None, :]
        a = x.to(tl.float32) * c[None, :]
        r = xr * s[None, :]
        if BF16:
            # each product rounded to the nearest bf16 (ties to even) by hand, kept in fp32, then the sum: the eager
            # ops' roundings (Triton's CPU interpreter casts by truncating; on a GPU these are its own cast's values)
            ba = a.to(tl.uint32, bitcast=True)
            a = ((ba + 0x7FFF + ((ba >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            br = r.to(tl.uint32, bitcast=True)
            r = ((br + 0x7FFF + ((br >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            y = a + r
            by = y.to(tl.uint32, bitcast=True)
            y = ((by + 0x7FFF + ((by >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            y = a.to(x.dtype).to(tl.float32) + r.to(x.dtype).to(tl.float32)
        tl.store(o_ptr + b * so_b + h * so_h + t * so_t + d[None, :], y.to(x.dtype), mask=mask)

    return rope_kernel


def _like_eager(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped as `x` whose memory order is `x`'s (its dims by stride, largest first), as an eager
    elementwise op's output over `x` is laid out (a transposed view of the GEMM's token-major output stays one)."""
    order = sorted(range(x.dim()), key=lambda i: (x.stride(i) if x.shape[i] > 1 else float("inf")), reverse=True)
    out = torch.empty([x.shape[i] for i in order], dtype=x.dtype, device=x.device)
    inverse = [order.index(i) for i in range(x.dim())]
    return out.permute(inverse)


def rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos[:, None] + rotate_half(x) * sin[:, None]` of a (B, H, T, D) `x` with cos/sin (B or 1, T, D), by the
    kernel (CUDA or the interpreter; no check here: `serves` checks once)."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    B, H, T, D = x.shape
    cos, sin = cos.expand(B, T, D), sin.expand(B, T, D)
    out = _like_eager(x)
    if B * T and H:
        _kernel[(B * T,)](x, cos, sin, out, T, x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1),
                          out.stride(0), out.stride(1), out.stride(2), H=H, HP=pow2_at_least(H), D=D,
                          BF16=x.dtype == torch.bfloat16)
    return out


def _fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    B, _, T, D = q.shape
    if k.shape[0] != B or k.shape[2:] != (T, D) or cos.shape[1:] != (T, D) or cos.shape[0] not in (1, B):
        return False
    if D < 2 or D & (D - 1) or q.dtype not in _HALF or not (k.dtype == cos.dtype == sin.dtype == q.dtype):
        return False
    return all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (q, k, cos, sin)) and q.device == cos.device


def fused(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple | None:
    """(q_embed, k_embed) by the kernel where it serves (the module docstring says where), else None."""
    global calls
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or not _fits(q, k, cos, sin):
        return None
    if not fused_size(q.shape[0] * q.shape[2]):
        return None  # a packed prefill: HF's ops (triton_device.FUSED_TOKENS_MAX says why)
    if not _CHECKS.checked(q.device, q.dtype) and q.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # never the first-use check inside a CUDA-graph capture (it synchronises): HF's ops there
    if not serves(q.device, q.dtype):
        return None
    calls += 1
    return rope_one(q, cos, sin), rope_one(k, cos, sin)


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """The switch on, CUDA (or the interpreter on the CPU), and the one-time check passed."""
    if not fused_rope_on() or not runs_on(device):
        return False
    return _CHECKS.ok(device, dtype)


def _reference() -> Any:
    """HF's function (Qwen2's; every wrapped module's is the same expression)."""
    from transformers.models.qwen2 import modeling_qwen2

    fn = modeling_qwen2.apply_rotary_pos_emb
    return getattr(fn, _MARK, fn)


def _check(device: torch.device, dtype: torch.dtype) -> None:
    """The kernel against HF's function over q/k as strided views of one (T, (H + 2 Hk) D + extra) GEMM output, the
    prefill's layout, a head count that is not a power of two: every element equal, and the output's strides."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    T, H, Hk, D = 37, 7, 2, 64
    y = (4 * torch.randn(1, T, (H + 2 * Hk) * D + 24, generator=gen)).to(device=device, dtype=dtype)
    q = y[..., : H * D].view(1, T, H, D).transpose(1, 2)
    k = y[..., H * D: (H + Hk) * D].view(1, T, Hk, D).transpose(1, 2)
    ang = torch.randn(1, T, D // 2, generator=gen).mul(3) + torch.arange(T).view(1, T, 1)
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)
    want = _reference()(q, k, cos, sin)
    got = rope_one(q, cos, sin), rope_one(k, cos, sin)
    for g, w in zip(got, want):
        if not torch.equal(g, w):
            raise RuntimeError(f"differs from HF's by {float((g.float() - w.float()).abs().max()):.3g}")
        if g.stride() != w.stride():
            raise RuntimeError(f"strides {g.stride()} where HF's ops give {w.stride()}")


_CHECKS = FirstUseChecks(_check, log, "the fused rotary-embedding kernel", "the attention keeps HF's elementwise ops")


def passed(device: torch.device) -> bool:
    """Whether the kernel passed a check on `device` in this process."""
    return _CHECKS.passed(device)


def _wrap(original: Any) -> Any:
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # noqa: ANN001, ANN202 - HF's signature
        out = fused(q, k, cos, sin) if unsqueeze_dim == 1 else None
        return original(q, k, cos, sin, unsqueeze_dim) if out is None else out

    apply_rotary_pos_emb.__doc__ = original.__doc__
    setattr(apply_rotary_pos_emb, _MARK, original)
    return apply_rotary_pos_emb


def _attention_modules(model: torch.nn.Module) -> list[Any]:
    """The Python modules of `model`'s attention classes whose forward calls their module's `apply_rotary_pos_emb`."""
    mods = []
    for m in model.modules():
        fwd = getattr(type(m), "forward", None)
        code = getattr(inspect.unwrap(fwd), "__code__", None) if callable(fwd) else None  # under HF's decorators
        if code is None or "apply_rotary_pos_emb" not in code.co_names:
            continue
        mod = sys.modules.get(fwd.__module__)
        if mod is not None and callable(getattr(mod, "apply_rotary_pos_emb", None)) and mod not in mods:
            mods.append(mod)
    return mods


def install(model: torch.nn.Module) -> int:
    """Wrap the `apply_rotary_pos_emb` of every model module `model`'s attention calls (idempotent); how many
    modules use the wrapper (0 with THINKCRAFT_FUSED_ROPE=0)."""
    if not fused_rope_on():
        return 0
    mods = _attention_modules(model)
    for mod in mods:
        fn = mod.apply_rotary_pos_emb
        if not hasattr(fn, _MARK):
            mod.apply_rotary_pos_emb = _wrap(fn)
    return len(mods)


def strip(model: torch.nn.Module) -> None:
    """HF's function back in every module `install` wrapped for `model`'s attention."""
    for mod in _attention_modules(model):
        fn = mod.apply_rotary_pos_emb
        if hasattr(fn, _MARK):
            mod.apply_rotary_pos_emb = getattr(fn, _MARK)
