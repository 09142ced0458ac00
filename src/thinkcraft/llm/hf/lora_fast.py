"""The sampler's LoRA: PEFT's `lora.Linear` forward without its dtype casts, for the engine's no-grad forwards.

A learner training LoRA in bf16 keeps fp32 adapters (PEFT's `autocast_adapter_dtype`) on a bf16 base, and the
engine samples from the same modules. PEFT's forward then casts the activations to fp32, autocast casts them and
both adapter matrices back to bf16 (its weight cache is off: `compat.autocast`), scales, adds and casts the sum:
~9 operators per linear where 3 do the work. On an H200 (2026-11-28, Craftax llm-policy at 256 envs, Qwen2.5-0.5B
shape, `bench/results/logs/s36_h200_craftax_auto_rollout_profile-*.txt`) the eager prefill spent 2.5 s of host
time a step in `aten::linear`, 1.4 s of it in `_to_copy`, and each decode graph held the adapters' casts as
hundreds of 1.4 µs kernels.

`install(model)` gives every vanilla LoRA linear of a half-precision base (bf16 / fp16) bf16 copies of its
adapter (`A`, and `(scaling · B)ᵀ`) and a forward that, with gradients off, computes
`base(x) + (x Aᵀ)(s B)ᵀ` as one linear and one `addmm` - the product autocast would compute anyway, with the
scale folded into B (exact for PEFT's default power-of-two `alpha / r`) and one rounding of the sum instead of
two. With gradients on (the learner), or any case it does not cover (adapters disabled or merged, several
active adapters, a LoRA variant such as DoRA, dropout in training mode, extra arguments), PEFT's own forward
runs unchanged.

Freshness: the copies follow the adapters' in-place updates (the optimizer's step, `apply_state`'s copy) through
the tensors' version counters. An eager forward checks its layer's counters first; a compiled or CUDA-graphed
forward cannot run Python, so the engine calls `refresh(model)` before each step (`Batcher.step`); the copies are
updated in place, so a captured graph keeps reading them. THINKCRAFT_LORA_FAST=0 leaves PEFT's forward alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from thinkcraft.llm.hf.copies import StampedLayers, mixin_class
from thinkcraft.utils.errors import env_switch

_HALF = (torch.bfloat16, torch.float16)


class _FastLoraMixin:
    """Mixed into a PEFT `lora.Linear` subclass by `install` (the instance's class is swapped, so `isinstance`
    checks, `deepcopy` and PEFT's own methods keep working)."""

    _tc_a: torch.Tensor  # (r, in), the base weight's dtype
    _tc_bt: torch.Tensor  # (r, out) = (scaling · B)ᵀ
    _tc_seen: tuple  # (A, B) storage pointers and version counters, and the scale, at the last copy

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.is_grad_enabled() or args or kwargs or not _covered(self):
            return super().forward(x, *args, **kwargs)  # type: ignore[misc]
        if not torch.compiler.is_compiling():
            _refresh_layer(self)
        out = self.base_layer(x)  # type: ignore[attr-defined]
        h = F.linear(x.to(self._tc_a.dtype), self._tc_a)
        n = out.shape[-1]
        return torch.addmm(out.reshape(-1, n), h.reshape(-1, h.shape[-1]), self._tc_bt).view(out.shape)


def _covered(layer: Any) -> bool:
    """The one case the fast forward computes: one active vanilla adapter, enabled, unmerged, no dropout at work."""
    if layer.disable_adapters or layer.merged:
        return False
    active = layer.active_adapters
    if len(active) != 1 or active[0] != layer._tc_name or active[0] in layer.lora_variant:
        return False
    drop = layer.lora_dropout[active[0]]
    return not (layer.training and isinstance(drop, torch.nn.Dropout) and drop.p > 0)


def _refresh_layer(layer: Any) -> bool:
    """Copy the adapter into the bf16 copies if it changed since the last copy (in place); True if it did."""
    a, b, _, _ = src = _sources(layer)
    seen = _numbers(src)  # the scale too: PEFT's set_scale changes it without touching a tensor
    scale = seen[-1]
    if seen == layer._tc_seen:
        return False
    with torch.no_grad():
        layer._tc_a.copy_(a)
        layer._tc_bt.copy_((b * scale).t())
    layer._tc_seen = seen
    return True


def lora_layers(model: torch.nn.Module) -> list[Any]:
    """The model's PEFT `lora.Linear` layers (empty without PEFT or LoRA)."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def _sources(m: Any) -> tuple[torch.Tensor, torch.Tensor, dict, str]:
    return m.lora_A[m._tc_name].weight, m.lora_B[m._tc_name].weight, m.scaling, m._tc_name


def _numbers(src: tuple[torch.Tensor, torch.Tensor, dict, str]) -> tuple:
    a, b, scaling, name = src
    return a.data_ptr(), a._version, b.data_ptr(), b._version, scaling[name]


def install(model: torch.nn.Module) -> list[Any]:
    """Give `model`'s LoRA linears the fast no-grad forward where it applies (a half-precision base, one adapter
    without bias) and return those layers (empty: nothing changed). Idempotent; a layer whose copies are on
    another device or dtype than its base (a deep copy moved to another GPU) gets new ones."""
    if not env_switch("THINKCRAFT_LORA_FAST", default=True):
        return []
    fast = StampedLayers([], _sources, _numbers, _refresh_layer)
    for layer in lora_layers(model):
        base = getattr(layer.base_layer, "weight", None)
        names = list(layer.lora_A.keys())
        if not isinstance(base, torch.Tensor) or base.dtype not in _HALF or len(names) != 1:
            continue
        name = names[0]
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
        if layer.lora_B[name].bias is not None or name in layer.lora_variant:
            continue
        old = getattr(layer, "_tc_a", None)
        if old is None or old.device != a.device or old.dtype != base.dtype:
            # outside any inference mode: the copies are updated in place later, which an inference tensor forbids
            with torch.inference_mode(False), torch.no_grad():
                layer._tc_a = torch.empty(a.shape, dtype=base.dtype, device=a.device)
                layer._tc_bt = torch.empty((b.shape[1], b.shape[0]), dtype=base.dtype, device=b.device)
            layer._tc_seen = ()
        layer._tc_name = name
        cls = type(layer)
        if not isinstance(layer, _FastLoraMixin):
            layer.__class__ = _fast_class(cls)
        _refresh_layer(layer)
        fast.append(layer)
    return fast


def _fast_class(cls: type) -> type:
    return mixin_class(_FastLoraMixin, cls, "Fast", globals())


def refresh(layers: list[Any]) -> int:
    """Bring every fast layer's copies up to date (before a compiled or graphed step); how many were copied.
    `install`'s list (`copies.StampedLayers`) answers "nothing changed" from one stamp of flat numbers."""
    if isinstance(layers, StampedLayers):
        return layers.refresh()
    return sum(_refresh_layer(layer) for layer in layers)
