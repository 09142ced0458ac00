"""RMSNorm through torch's `F.rms_norm` (one fused kernel on CUDA) instead of Hugging Face's Python forward.

HF's Llama / Qwen2 / Qwen3 RMSNorm casts the activation to fp32, squares, averages, takes the reciprocal root,
multiplies, casts back and multiplies by the weight: five or six passes over the activation forward and more
backward, 49 norms per forward of the Qwen2.5-0.5B shape. At the llm-policy learner's micro-batch (65,536 tokens ×
896, bf16; `bench/probes/learner_ops_probe.py`, H200, torch 2.11, 2026-11-29) one norm's forward + backward took
2.35 ms that way and 0.27 ms as `F.rms_norm` - ~0.4 s of a 2.5 s update; in fp32 (full fine-tuning) 1.86 and 0.31
ms, and the 0.5B learner's full fine-tuning update 2.56 -> 2.25 s (BENCHMARKS §7b).

Values: the same formula (`x · rsqrt(mean(x²) + ε) · w`, in fp32 inside); the fused kernel rounds the product
once where HF rounds the normalised value to the half dtype before multiplying by the weight, so outputs differ by
at most about one bf16 step (0.031 at the probe's magnitudes). Applied where the activation and the weight share
a floating dtype: a bf16 LoRA base, and full fine-tuning's fp32 residual stream on its fp32 master weights (one
kernel instead of six there, the same values up to fp32 rounding); elsewhere (Qwen3's q/k norms of bf16
projections on fp32 weights under autocast) HF's forward, which returns fp32 there. CUDA autocast runs `rms_norm`
in fp32, so inside an autocast region the call runs with autocast off - a nested region only: leaving the
outermost one clears the process-wide cast cache, which `compat.autocast` explains must not happen from a
forward.

`install(model)` swaps the class of every RMSNorm of a known kind (`KINDS`: their forward is the formula above;
Gemma's `1 + w` is not) and returns how many; the swap is visible to every engine sharing the modules.
THINKCRAFT_FUSED_RMSNORM=0 keeps HF's forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from thinkcraft.llm.hf.copies import mixin_class, mixin_getattr, unmix
from thinkcraft.utils.errors import env_switch

KINDS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen3MoeRMSNorm")
"""HF norm classes whose forward is `weight * (x.float() * rsqrt(mean(x²) + variance_epsilon)).to(x.dtype)`."""


class _FusedRMSNormMixin:
    """Mixed into an HF RMSNorm subclass by `install` (the instance's class is swapped)."""

    weight: torch.Tensor
    variance_epsilon: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype != w.dtype or not x.is_floating_point():
            return super().forward(x)  # type: ignore[misc]
        dev = x.device.type
        if torch.is_autocast_enabled(dev):  # nested: leaving it does not clear the cast cache
            with torch.autocast(dev, enabled=False):
                return F.rms_norm(x, w.shape, w, self.variance_epsilon)
        return F.rms_norm(x, w.shape, w, self.variance_epsilon)


def install(model: torch.nn.Module) -> int:
    """Swap every RMSNorm of `model` of a kind in `KINDS` to the fused forward; how many (idempotent; 0 with
    THINKCRAFT_FUSED_RMSNORM=0)."""
    if not env_switch("THINKCRAFT_FUSED_RMSNORM", default=True):
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, _FusedRMSNormMixin):
            n += 1
        elif type(m).__name__ in KINDS and isinstance(getattr(m, "weight", None), torch.Tensor) \
                and hasattr(m, "variance_epsilon"):
            m.__class__ = mixin_class(_FusedRMSNormMixin, type(m), "Fused", globals())
            n += 1
    return n


def strip(model: torch.nn.Module) -> None:
    """HF's forward back on every norm `install` swapped."""
    unmix(model, _FusedRMSNormMixin, ())


def installed(model: Any) -> int:
    """How many of `model`'s norms run the fused forward."""
    return sum(isinstance(m, _FusedRMSNormMixin) for m in model.modules())


# a swapped class unpickled before this process made it
__getattr__ = mixin_getattr(_FusedRMSNormMixin, "Fused", globals())
