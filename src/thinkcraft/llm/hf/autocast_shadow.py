"""Half-precision shadows of fp32 master weights, for an engine's no-grad forwards under autocast.

Full fine-tuning keeps fp32 master weights and runs the forward under bf16 autocast; an engine that shares the
learner's parameters (the synchronous loop, one-GPU async, the engine-per-GPU placement's engine on the
learner's GPU) then has autocast cast every linear's weight (and bias) to bf16 inside every decode step - the
cast cache is off (`compat.autocast` says why). For the Qwen2.5-0.5B shape that is ~170 extra kernels and ~3 GB
of memory traffic a step: a copy engine that stored its weights in bf16 once instead
(`weights.autocast_weights`) went from 3.46 to 2.51 ms a decode step (2 x H200, 2026-11-28,
bench/results/logs/s38_h200x2_async_dedicated_bf16copy.log).

`install(model, dtype)` gives every plain `nn.Linear` with fp32 weights a `dtype` copy of its weight and bias
and a forward that, with gradients off and autocast to `dtype` on the weight's device, computes
`F.linear(x, W16, b16)` - what autocast computes from the fp32 weights, the same rounding, without the casts.
With gradients on (the learner) or any other autocast state, `nn.Linear`'s own forward runs unchanged.

Freshness as `lora_fast`: the copies follow in-place updates (the optimizer's step) through the tensors' version
counters; an eager forward checks its own layer, a compiled or graphed one cannot run Python, so the engine
calls `refresh(layers)` before each step (`Batcher.step`); the copies are updated in place, so a captured graph
keeps reading them. Memory: 2 bytes per weight (1 GB for 0.5B parameters). THINKCRAFT_AUTOCAST_SHADOW=0 leaves
the model alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from thinkcraft.llm.hf.copies import StampedLayers, copies_fit, mixin_class, mixin_getattr, unmix
from thinkcraft.utils.errors import env_switch

_HALF = (torch.bfloat16, torch.float16)


class _ShadowLinearMixin:
    """Mixed into `nn.Linear` (or a subclass) by `install`: the instance's class is swapped."""

    _tc_same_forward = True
    """It computes what its base class computes (from a rounded copy only where autocast would round the same):
    code that reads a layer's weight itself in place of its forward - the learner's LM head
    (`compat.plain_lm_head`) - may treat it as its base class (2 x H200, 2026-11-29: the first update of every
    full fine-tuning run on a GPU stopped at "its head is a Shadow…Linear, not a plain Linear")."""

    _tc_w: torch.Tensor
    _tc_b: torch.Tensor | None
    _tc_seen: tuple

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._tc_w
        kind = w.device.type
        if (torch.is_grad_enabled() or self.weight.dtype != torch.float32  # type: ignore[attr-defined]
                or not torch.is_autocast_enabled(kind) or torch.get_autocast_dtype(kind) != w.dtype):
            return super().forward(x)  # type: ignore[misc]
        if not torch.compiler.is_compiling():
            _refresh_layer(self)
        return F.linear(x.to(w.dtype), w, self._tc_b)


def _refresh_layer(layer: Any) -> bool:
    """Copy the weight (and bias) into the shadows if they changed since the last copy; True if they did."""
    w, b = src = _sources(layer)
    seen = _numbers(src)
    if seen == layer._tc_seen:
        return False
    with torch.no_grad():
        layer._tc_w.copy_(w)
        if b is not None:
            layer._tc_b.copy_(b)
    layer._tc_seen = seen
    return True


def _sources(m: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    return m.weight, m.bias


def _numbers(src: tuple[torch.Tensor, torch.Tensor | None]) -> tuple:
    w, b = src
    return (w.data_ptr(), w._version) + ((b.data_ptr(), b._version) if b is not None else ())


def _layers(layers: list[Any]) -> StampedLayers:
    return StampedLayers(layers, _sources, _numbers, _refresh_layer)


def shadowable(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The plain `nn.Linear` layers of `model` with fp32 weights (a Linear with its own forward - a PEFT LoRA
    layer, a quantized one - is not ours to replace)."""
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32
            and (type(m).forward is torch.nn.Linear.forward or isinstance(m, _ShadowLinearMixin))]


def install(model: torch.nn.Module, dtype: torch.dtype, max_bytes: float | None = None) -> list[Any]:
    """Give `model`'s plain fp32 linears `dtype` shadows and the shadow forward; returns those layers (empty:
    nothing to shadow, THINKCRAFT_AUTOCAST_SHADOW=0, or shadows that would take more than `max_bytes`, by default
    `copies.COPY_FREE_FRACTION` of a GPU's free memory, no limit on the CPU).
    Idempotent; a layer whose shadow is on another device or dtype gets a new one."""
    if dtype not in _HALF or not env_switch("THINKCRAFT_AUTOCAST_SHADOW", default=True):
        return _layers([])
    todo = shadowable(model)
    need = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0) for m in todo) \
        * torch.empty((), dtype=dtype).element_size()
    if not todo or not copies_fit(need, todo[0].weight.device, max_bytes,
                                  f"{dtype} weight shadows: autocast casts the fp32 weights at every step"):
        return _layers([])
    layers = _layers([])
    for m in todo:
        old = getattr(m, "_tc_w", None)
        if old is None or old.device != m.weight.device or old.dtype != dtype:
            with torch.inference_mode(False), torch.no_grad():  # updated in place later: no inference tensors
                m._tc_w = torch.empty(m.weight.shape, dtype=dtype, device=m.weight.device)
                m._tc_b = None if m.bias is None else torch.empty(m.bias.shape, dtype=dtype, device=m.bias.device)
            m._tc_seen = ()
        if not isinstance(m, _ShadowLinearMixin):
            m.__class__ = _shadow_class(type(m))
        _refresh_layer(m)
        layers.append(m)
    return layers


def strip(model: torch.nn.Module) -> None:
    """Take the shadows out of `model` (a deep copy that will hold its own weights: `weights.autocast_weights`)."""
    unmix(model, _ShadowLinearMixin, ("_tc_w", "_tc_b", "_tc_seen"))


def _shadow_class(cls: type) -> type:
    return mixin_class(_ShadowLinearMixin, cls, "Shadow", globals())


def refresh(layers: list[Any]) -> int:
    """Bring every shadow up to date (before a compiled or graphed step); how many were copied."""
    if isinstance(layers, StampedLayers):
        return layers.refresh()
    return sum(_refresh_layer(m) for m in layers)


# a swapped class unpickled before this process made it
__getattr__ = mixin_getattr(_ShadowLinearMixin, "Shadow", globals())
