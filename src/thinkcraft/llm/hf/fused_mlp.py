"""The MLP's `silu(gate) * up` as one kernel over the fused gate/up GEMM's output, in the engine's eager forwards.

With `fused_proj`, a Llama / Qwen MLP's gate and up projections are one GEMM whose output `[gate | up]` (with LoRA's
A folded, `[gate | up | x Aᵀ]`) the two members return as column slices: strided views. Eager PyTorch runs
`silu(gate)` and `silu(gate) * up` over strided bf16 tensors with its generic (non-vectorised) elementwise kernel:
in the Craftax rollout's prefills (~23k tokens a call, Qwen2.5-0.5B shape, H200, 2026-12-02,
`bench/llm_policy_craftax.py --profile-rollout`: `s51_craftax_rollout_profile_*`) the SiLU took 58.5 ms and the
strided multiplies ~67 ms of a rollout's ~600 ms of prefill kernels - more than the MLP's GEMMs. One Triton program
per (row, block of columns) reads the two halves where they lie and writes the product contiguous: one pass.
(A decode step compiled by inductor - the default - keeps inductor's own fusion of the plain product; a LoRA group's
kernel below enters it as an opaque op, `_compiled_hidden`. It serves forwards of every size, the packed prefills'
too: `triton_device.FUSED_TOKENS_MAX`.)

A LoRA gate/up group with its A folded (`fused_proj`: the GEMM gives `[gate | up | x Aᵀ]`) used to add its low-rank
part `h (sB)ᵀ` with cuBLAS's `addmm_` (`beta = 1`) - a pass of its own that reads and writes the whole `[gate | up]`:
in the Craftax rollout's packed prefills (~23k tokens a call, rank 16, H200, 2026-12-03's profile,
`bench/probes/rollout_kernels.py`) ~9 ms of a ~76 ms call. `lora_silu_mul` adds it inside the SiLU kernel (two
`tl.dot`s of a (rows, 2r) tile of h with the (2r, columns) tiles of `(sB)ᵀ`, in fp32, then addmm_'s rounding to the
half dtype): one pass. THINKCRAFT_FUSED_MLP_LORA=0 keeps the `addmm_` (the A/B switch);
THINKCRAFT_FUSED_MLP_LORA_COMPILED=0 keeps it in compiled forwards only.

Values: the eager ops' roundings, in their order - `silu(gate)` computed in fp32 and rounded to the half dtype, then
the product with `up` in fp32 rounded again; the exponential is Triton's, so a result may differ from torch's by one
step of the half dtype where the fp32 SiLU lies on a rounding boundary (the first-use check allows that, and
requires almost every element to be equal).

Where: no-grad forwards (the learner's gradient path is untouched), outside compilation, on CUDA (or Triton's
interpreter on the CPU: the tests), for MLPs of a known kind (`KINDS`, whose forward is
`down_proj(act_fn(gate_proj(x)) * up_proj(x))`) with a SiLU and a fused gate/up group. The first call on a device
checks the kernel against torch; a failure (a Triton that cannot compile it) logs a warning and keeps torch's ops.

On by default since 2026-12-04 (THINKCRAFT_FUSED_MLP=0: torch's ops, the A/B switch). On the Craftax row (Qwen2.5-0.5B
shape, 256 envs, 1 x H200, queue set craftax28, the device's phases timed, runs in turns on one machine) with the
rotary kernel also at every size, the packed prefill (~23k tokens a call) took 65-69 ms of device time a call against
81-84 ms with torch's ops, and the rollout 1,276 and 1,251 decisions/s against 1,169 (BENCHMARKS §7b). Before - 2026-12-02
and -03, with the prefill bound by its host's launches (~60 ms of launches a call for ~75 ms of kernels) - the kernel
time it saved did not become rollout time (1,115 / 1,075 against 1,076 / 1,094; over every size 1,152 against 1,136 /
1,217; decode-sized only 1,048 / 1,061 against 1,074 / 1,061), and it was opt-in. Not bit-exact (above: one bf16 step
apart where the fp32 SiLU lies on a rounding boundary, in the sampler's forwards only); the engine's forwards already
differ from the learner's in their kernels (graphs, FlashAttention), and the behaviour log-probs are the engine's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from thinkcraft.llm.hf.copies import mixin_class, mixin_getattr, unmix
from thinkcraft.utils.errors import env_switch
from thinkcraft.llm.hf.triton_device import FirstUseChecks, fused_size, interpreted, pow2_at_least, runs_on

log = logging.getLogger(__name__)

KINDS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
"""HF MLP classes whose forward is `down_proj(act_fn(gate_proj(x)) * up_proj(x))`."""

BLOCK = 1024
"""Columns a program writes (a multiple of every GPU's vector width; the Qwen2.5-0.5B MLP's 4,864 in 5 blocks)."""

_HALF = (torch.bfloat16, torch.float16)
_kernel: Any = None
_lora_kernel: Any = None


def fused_mlp_on() -> bool:
    """THINKCRAFT_FUSED_MLP (on by default: the module docstring says why)."""
    return env_switch("THINKCRAFT_FUSED_MLP", default=True)


def compiled_lora_on() -> bool:
    """THINKCRAFT_FUSED_MLP_LORA_COMPILED (on by default, under THINKCRAFT_FUSED_MLP_LORA): the LoRA kernel also in
    compiled forwards (`_compiled_hidden`); "0": inductor's ops there (the A/B switch)."""
    return env_switch("THINKCRAFT_FUSED_MLP_LORA_COMPILED", default=True)


def fused_lora_on() -> bool:
    """THINKCRAFT_FUSED_MLP_LORA (on by default, under THINKCRAFT_FUSED_MLP): a LoRA gate/up group's low-rank add
    inside the SiLU kernel (`lora_silu_mul`); "0": `addmm_`'s pass, then `silu_mul` (the A/B switch)."""
    return env_switch("THINKCRAFT_FUSED_MLP_LORA", default=True)



def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_kernel(y_ptr, out_ptr, stride_y, up_col, n_cols, BLOCK: tl.constexpr, BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < n_cols
        src = y_ptr + row * stride_y + col
        g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(src + up_col, mask=mask, other=0.0)
        act = g / (1.0 + tl.exp(-g))  # silu(gate) in fp32, rounded to the half dtype as torch's SiLU rounds it
        if BF16:
            # rounded to the nearest bf16 (ties to even) by hand, kept in fp32: Triton's CPU interpreter casts by
            # truncating (on a GPU these are its own cast's values). Written out twice: a jitted helper defined in
            # this scope is not found by the interpreter (a closure)
            b = act.to(tl.uint32, bitcast=True)
            act = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            prod = act * u.to(tl.float32)
            b = prod.to(tl.uint32, bitcast=True)
            out = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            out = act.to(u.dtype).to(tl.float32) * u.to(tl.float32)
        tl.store(out_ptr + row * n_cols + col, out.to(u.dtype), mask=mask)

    return silu_mul_kernel


def _build_lora() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def lora_silu_mul_kernel(y_ptr, bt_ptr, out_ptr, n_rows, stride_y, up_col, h_col, n_cols, stride_bt,
                             R: tl.constexpr, RP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             BF16: tl.constexpr, UPCAST: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        k = tl.arange(0, RP)
        rm, cm, km = rows < n_rows, cols < n_cols, k < R
        base = y_ptr + rows.to(tl.int64)[:, None] * stride_y
        h = tl.load(base + h_col + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)  # x Aᵀ, (BM, RP)
        bsrc = bt_ptr + k[:, None] * stride_bt + cols[None, :]
        bmask = km[:, None] & cm[None, :]
        bg = tl.load(bsrc, mask=bmask, other=0.0)  # (sB)ᵀ's gate and up columns, (RP, BN) each
        bu = tl.load(bsrc + up_col, mask=bmask, other=0.0)
        if UPCAST:  # Triton's CPU interpreter multiplies half-precision tiles wrongly: float32 there
            h, bg, bu = h.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
        ag = tl.dot(h, bg)  # the low-rank parts, exact products summed in fp32 (as cuBLAS's addmm_)
        au = tl.dot(h, bu)
        mask = rm[:, None] & cm[None, :]
        src = base + cols[None, :]
        g = tl.load(src, mask=mask, other=0.0)
        u = tl.load(src + up_col, mask=mask, other=0.0)
        g = g.to(tl.float32) + ag  # addmm_'s beta = 1 epilogue in fp32, then its rounding to the half dtype
        u = u.to(tl.float32) + au
        if BF16:  # round-to-nearest-even by hand, kept in fp32 (the interpreter truncates; silu_mul_kernel says)
            b = g.to(tl.uint32, bitcast=True)
            g = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            b = u.to(tl.uint32, bitcast=True)
            u = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            act = g / (1.0 + tl.exp(-g))
            b = act.to(tl.uint32, bitcast=True)
            act = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            prod = act * u
            b = prod.to(tl.uint32, bitcast=True)
            out = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            g = g.to(tl.float16).to(tl.float32)
            u = u.to(tl.float16).to(tl.float32)
            act = g / (1.0 + tl.exp(-g))
            out = act.to(tl.float16).to(tl.float32) * u
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)

    return lora_silu_mul_kernel


def silu_mul(y: torch.Tensor, n: int) -> torch.Tensor:
    """`silu(y[:, :n]) * y[:, n:2n]` of a 2-D `y` whose columns are contiguous (any row stride), as a contiguous
    (rows, n) tensor, by the kernel (CUDA or the interpreter; no check here: `serves` checks once)."""
    global _kernel
    if y.dim() != 2 or y.stride(1) != 1 or y.shape[1] < 2 * n:
        raise ValueError(f"silu_mul needs a 2-D tensor with contiguous columns and at least {2 * n} of them, "
                         f"got shape {tuple(y.shape)} strides {y.stride()}")
    if _kernel is None:
        _kernel = _build()
    out = torch.empty(y.shape[0], n, dtype=y.dtype, device=y.device)
    if y.shape[0]:
        _kernel[(y.shape[0], -(-n // BLOCK))](y, out, y.stride(0), n, n, BLOCK=BLOCK, BF16=y.dtype == torch.bfloat16)
    return out


def reference(y: torch.Tensor, n: int) -> torch.Tensor:
    """What the eager MLP computes from the same slices."""
    return F.silu(y[:, :n]) * y[:, n:2 * n]


def lora_tiles(rows: int) -> tuple[int, int, int | None]:
    """(rows, columns, warps; None: Triton's default) of `lora_silu_mul`'s tile: 32 x 128 with 8 warps at decode
    sizes, 64 x 128 above (each program reads its (sB)ᵀ tile once for 64 rows). Measured at 248 rows (the Qwen2.5-0.5B
    MLP, rank 2 x 16, one H100, 2026-12-07, `bench/probes/mlp_lora_probe.py --tiles`): 32 x 128 w8 0.0121 ms, 16 x 256
    w4 0.0130, the earlier 16 x 128 w4 0.0182 (slower there than cuBLAS's addmm_ + the plain kernel, 0.0170)."""
    return (32, 128, 8) if rows <= 1024 else (64, 128, None)


def lora_silu_mul(y: torch.Tensor, n: int, bt: torch.Tensor, tiles: tuple[int, int] | None = None,
                  num_warps: int | None = None) -> torch.Tensor:
    """`silu(g) * u` with `[g | u] = y[:, :2n] + y[:, 2n:] @ bt` - a LoRA gate/up group's GEMM output with its A
    folded (`fused_proj.Group.folded_output`: `[gate | up | x Aᵀ]`) and the group's block-diagonal `(sB)ᵀ` (r, 2n) -
    in one pass, as a contiguous (rows, n) tensor: the low-rank add that `addmm_` made a pass of its own (a read and a
    write of the whole `[gate | up]`) done on the way (no check here: `lora_serves` checks once). `tiles` (rows,
    columns; powers of two, rows >= 16) and `num_warps` override `lora_tiles` and Triton's default (the probe's
    sweep: `bench/probes/mlp_lora_probe.py --tiles`)."""
    global _lora_kernel
    r = y.shape[1] - 2 * n if y.dim() == 2 else -1
    if y.dim() != 2 or y.stride(1) != 1 or r < 1 or tuple(bt.shape) != (r, 2 * n) or not bt.is_contiguous() \
            or bt.dtype != y.dtype or bt.device != y.device:
        raise ValueError(f"lora_silu_mul needs y (rows, 2n + r) with contiguous columns and a contiguous bt (r, 2n) "
                         f"of its dtype, n={n}: got y {tuple(y.shape)} strides {y.stride()}, bt {tuple(bt.shape)} "
                         f"{bt.dtype}")
    if _lora_kernel is None:
        _lora_kernel = _build_lora()
    out = torch.empty(y.shape[0], n, dtype=y.dtype, device=y.device)
    if y.shape[0]:
        bm, bn, warps = lora_tiles(y.shape[0])
        if tiles is not None:  # an override (the probe's sweep) takes Triton's warps unless it names them
            (bm, bn), warps = tiles, None
        warps = num_warps or warps
        grid = (-(-y.shape[0] // bm), -(-n // bn))
        extra = {} if warps is None else {"num_warps": warps}
        _lora_kernel[grid](y, bt, out, y.shape[0], y.stride(0), n, 2 * n, n, bt.stride(0), R=r,
                           RP=pow2_at_least(r, 16), BM=bm, BN=bn, BF16=y.dtype == torch.bfloat16,
                           UPCAST=interpreted(), **extra)
    return out


def lora_exact(y: torch.Tensor, n: int, bt: torch.Tensor) -> torch.Tensor:
    """What `lora_silu_mul` computes, in float64 but for its three roundings to y's dtype: `[g | u] = y[:, :2n] +
    y[:, 2n:] @ bt` rounded once, `silu(g)` rounded, the product rounded. The kernel's only departures are its fp32
    sum of the rank products and Triton's exponential; the `addmm_` path (`lora_reference`) adds cuBLAS's own (its
    epilogue's) roundings - on an H100 2026-12-07, at the MLP's width, more than two bf16 steps from the kernel in
    some products (0.5 at a value below 32)."""
    dt = y.dtype
    gu = (y[:, :2 * n].double() + y[:, 2 * n:].double() @ bt.double()).to(dt).double()
    g, u = gu[:, :n], gu[:, n:]
    act = (g / (1.0 + torch.exp(-g))).to(dt).double()
    return (act * u).to(dt)


def lora_reference(y: torch.Tensor, n: int, bt: torch.Tensor) -> torch.Tensor:
    """What the MLP computes without the LoRA kernel: the low-rank add in place (`Group.compute`'s `addmm_`),
    then torch's SiLU and product (on a copy: `y` is left as it was)."""
    y = y.clone()
    g = y[:, :2 * n]
    g.addmm_(y[:, 2 * n:], bt)
    return reference(g, n)


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """The switch on, CUDA (or the interpreter on the CPU), a half dtype, and the one-time check passed."""
    if not fused_mlp_on() or dtype not in _HALF:
        return False
    if not runs_on(device):
        return False
    return _CHECKS.ok(device, dtype)


def _check(device: torch.device, dtype: torch.dtype) -> None:
    """The kernel against torch's ops on strided halves of a (rows, 2n + extra) tensor, n not a multiple of BLOCK:
    at most one step of the dtype apart, and almost every element equal."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    n = BLOCK + 37
    y = (3 * torch.randn(13, 2 * n + 24, generator=gen)).to(device=device, dtype=dtype)
    got, want = silu_mul(y, n).float(), reference(y, n).float()
    step = want.abs().clamp_min(1e-3) * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)
    if bool(((got - want).abs() > step * 1.01).any()):
        raise RuntimeError(f"differs from torch by {float((got - want).abs().max()):.3g}")
    equal = float((got == want).float().mean())
    if equal < 0.99:
        raise RuntimeError(f"only {equal:.1%} of the elements equal torch's")


_CHECKS = FirstUseChecks(_check, log, "the fused SiLU-and-multiply kernel", "the MLPs keep torch's elementwise ops")


def lora_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """`serves`, the LoRA switch on, and the LoRA kernel's one-time check passed."""
    return fused_lora_on() and serves(device, dtype) and _LORA_CHECKS.ok(device, dtype)


def _check_lora(device: torch.device, dtype: torch.dtype) -> None:
    """The LoRA kernel against `lora_exact` at both tile heights (rank 2 x 8, n not a multiple of the tile): at
    most two steps of the dtype apart (where its fp32 sum rounds `g` or `u` the other way, the product moves by
    about a step for each), and almost every element equal."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, r = 128 + 37, 16
    bt = torch.zeros(r, 2 * n)
    bt[:8, :n], bt[8:, n:] = 0.3 * torch.randn(8, n, generator=gen), 0.3 * torch.randn(8, n, generator=gen)
    bt = bt.to(device=device, dtype=dtype)
    for rows in (13, 1030):
        y = (3 * torch.randn(rows, 2 * n + r, generator=gen)).to(device=device, dtype=dtype)
        got, want = lora_silu_mul(y, n, bt).float(), lora_exact(y, n, bt).float()
        step = want.abs().clamp_min(1e-3) * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)
        if bool(((got - want).abs() > 2 * step * 1.01).any()):
            raise RuntimeError(f"differs from its float64 reference by {float((got - want).abs().max()):.3g}")
        equal = float((got == want).float().mean())
        if equal < 0.98:
            raise RuntimeError(f"only {equal:.1%} of the elements equal its float64 reference")


_LORA_CHECKS = FirstUseChecks(_check_lora, log, "the fused LoRA-add, SiLU-and-multiply kernel",
                              "the LoRA MLPs add their low-rank part with addmm_ first")


def passed(device: torch.device) -> bool:
    """Whether the kernel passed a check on `device` in this process."""
    return _CHECKS.passed(device)


def lora_passed(device: torch.device) -> bool:
    """Whether the LoRA kernel passed a check on `device` in this process (with the switch on now)."""
    return fused_lora_on() and _LORA_CHECKS.passed(device)


class _FusedMLPMixin:
    """Mixed into an MLP of `KINDS` by `install` (the instance's class is swapped)."""

    gate_proj: Any
    up_proj: Any
    down_proj: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _fused_hidden(self, x)
        if h is None:
            return super().forward(x)  # type: ignore[misc]
        return self.down_proj(h)


@torch.library.custom_op("thinkcraft::lora_silu_mul", mutates_args=())
def _lora_silu_mul_op(y: torch.Tensor, n: int, bt: torch.Tensor) -> torch.Tensor:
    return lora_silu_mul(y, n, bt)


@_lora_silu_mul_op.register_fake
def _(y, n, bt):  # noqa: ANN001, ANN202
    return y.new_empty(y.shape[0], n)


def _compiled_hidden(mlp: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The LoRA kernel inside a compiled forward (the decode step), as one opaque op (`thinkcraft::lora_silu_mul`)
    over the traced gate/up GEMM: where the group folds A and the kernel already passed its check on this device and
    dtype in an eager forward (a check is not run while tracing: the engine's eager prefill runs before the decode
    step is compiled); None: inductor's path (the group's low-rank add op, then its own SiLU-and-multiply fusion).
    Why: in the compiled step the group's `addmm_` (its own GEMM launch, ~4.7 us at 248 rows on an H200) and the
    SiLU product (~3.1 us) become one kernel."""
    group = _gate_up_group(mlp)
    if group is None or not group.fold or not fused_size(x.numel() // max(1, x.shape[-1])):
        return None
    if not (fused_mlp_on() and fused_lora_on() and _LORA_CHECKS.known(group.weight.device, group.weight.dtype)):
        return None
    y = group.folded_output(x)  # [gate | up | x Aᵀ], traced
    if y is None:
        return None
    n = group.splits[0]
    return _lora_silu_mul_op(y.reshape(-1, y.shape[-1]), n, group.bt).view(*y.shape[:-1], n)


def _gate_up_group(mlp: Any) -> Any:
    """The `fused_proj` group that computes this MLP's gate and up (in that order, equal widths), or None."""
    group = mlp.gate_proj.__dict__.get("_tc_group")
    if group is None or len(group.members) != 2 or group.members[0] is not mlp.gate_proj \
            or group.members[1] is not mlp.up_proj or group.splits[0] != group.splits[1]:
        return None
    return group


def _fused_hidden(mlp: Any, x: torch.Tensor) -> torch.Tensor | None:
    """`act_fn(gate_proj(x)) * up_proj(x)` through the gate/up group and the kernel, or None (torch's path)."""
    if torch.is_grad_enabled():
        return None
    if torch.compiler.is_compiling():
        return _compiled_hidden(mlp, x) if compiled_lora_on() else None
    if not fused_size(x.numel() // max(1, x.shape[-1])):
        return None  # a packed prefill: torch's ops (triton_device.FUSED_TOKENS_MAX says why)
    group = _gate_up_group(mlp)
    if group is None:
        return None
    if not serves(x.device, group.weight.dtype):
        return None
    n = group.splits[0]
    if group.fold and lora_serves(x.device, group.weight.dtype):
        y = group.folded_output(x)  # [gate | up | x Aᵀ], the low-rank part added by the kernel
        if y is not None:
            return lora_silu_mul(y.reshape(-1, y.shape[-1]), n, group.bt).view(*y.shape[:-1], n)
    y = group.output(x)  # [gate | up] (…, 2n), a view whose rows may be longer (A's columns after them)
    if y is None:
        return None
    y2 = y.reshape(-1, y.shape[-1])
    if y2.stride(1) != 1:
        return None
    return silu_mul(y2, n).view(*y.shape[:-1], n)


def _is_silu(act: Any) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def install(model: torch.nn.Module) -> int:
    """Swap every MLP of a kind in `KINDS` with a SiLU to the fused forward (it serves only where its gate/up are a
    `fused_proj` group); how many (idempotent; 0 where THINKCRAFT_FUSED_MLP=0)."""
    if not fused_mlp_on():
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, _FusedMLPMixin):
            n += 1
        elif type(m).__name__ in KINDS and _is_silu(getattr(m, "act_fn", None)) \
                and all(hasattr(m, k) for k in ("gate_proj", "up_proj", "down_proj")):
            m.__class__ = mixin_class(_FusedMLPMixin, type(m), "FusedMLP", globals())
            n += 1
    return n


def strip(model: torch.nn.Module) -> None:
    """HF's forward back on every MLP `install` swapped."""
    unmix(model, _FusedMLPMixin, ())


def installed(model: Any) -> int:
    return sum(isinstance(m, _FusedMLPMixin) for m in model.modules())


# a swapped class unpickled before this process made it
__getattr__ = mixin_getattr(_FusedMLPMixin, "FusedMLP", globals())
