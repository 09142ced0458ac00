"""LoRA without PEFT's dtype casts: the engine's no-grad forwards (the sampler) and the learner's gradient path.

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
two. In any case it does not cover (adapters disabled or merged, several active adapters, a LoRA variant such
as DoRA, dropout in training mode, extra arguments) PEFT's own forward runs unchanged.

With gradients on (the learner; `install_for_learner` installs the layers where no engine has) the same
expression runs over the fp32 adapters themselves, differentiably (`_train_forward`): the activations stay in
the base's dtype, where PEFT's forward casts them to fp32 and autocast back to bf16 in every adapted linear,
forward and backward. The learner's torch.profiler view (H200, 2026-11-27, Craftax llm-policy at 256 envs,
`bench/results/llm_policy_craftax_learner_profile-*-step3.txt`: 2.84 s of device time an update) spent 0.68 s
in `aten::copy_` and 0.52 s in `aten::mul` against 0.67 s in the matrix products. The values equal PEFT's
within bf16 rounding (one rounding of the sum instead of two); THINKCRAFT_LORA_FAST_TRAIN=0 keeps PEFT's
forward for the gradient path.

Freshness: the copies follow the adapters' in-place updates (the optimizer's step, `apply_state`'s copy) through
the tensors' version counters. An eager forward checks its layer's counters first; a compiled or CUDA-graphed
forward cannot run Python, so the engine calls `refresh(model)` before each step (`Batcher.step`); the copies are
updated in place, so a captured graph keeps reading them. THINKCRAFT_LORA_FAST=0 leaves PEFT's forward alone.

Merged (THINKCRAFT_LORA_MERGE; the default for a CUDA engine, `merge_default`): each layer also keeps `W + s·B·A` in
the base dtype, merged in fp32 and rounded once, and the no-grad forward is that one linear - one GEMM where the
above is three (for the Qwen2.5-0.5B shape, 336 fewer kernels in each decode step of 168 adapted linears; the step at
64 rows was bound by its small kernels, 3.27 ms on an H200, 2026-11-28, bench/results/logs/s38_decode_probe_rows.json).
Its cost:
2 bytes per adapted weight (made only within `copies.COPY_FREE_FRACTION` of the device's free memory, else the layers
keep the three-operator forward), a re-merge of every layer when the adapters change (once a learner update),
and precision: the merged weight is rounded to bf16. Rounded to nearest, an adapter's change smaller than half a
bf16 step of the base weight is lost in the engine's policy - a bias, not noise: early in training, where every
`s·B·A` entry is below half a step, the merged weights ARE the base model's, while the change's effect on an output
(a coherent sum over the layer's inputs) can be many times the rounding's own noise. So the merge rounds
stochastically by default (THINKCRAFT_LORA_MERGE_ROUNDING, `stochastic_bf16`): each entry goes to the bf16 neighbour
above or below with the probabilities that make its expectation `W + s·B·A` exactly, the noise of each re-merge at
most one bf16 step an entry and unbiased - the size of the bf16 rounding that every output of the unmerged forward
already has. "nearest" keeps the older rounding. The learner trains the exact adapter either way; the behaviour
log-probs that the off-policy corrections use are the engine's. How close each way samples to the exact adapter's
policy (`bench/probes/merge_rounding_probe.py`, the bundled SmolLM2-135M on the CPU, rank 16, 2026-12-08): the bf16
forward's own rounding puts every bf16 path ~0.002 nats of KL from the fp32 policy, above any adapter whose update is
<= 1e-3 of the weights, and at 1e-2 (the adapter's own effect 0.0089 nats) unmerged, merged-stochastic and
merged-nearest sat at 0.00202, 0.00215 and 0.00226: no sampling fidelity lost to the merge that the forward does not
already lose. Measured (H200, 2026-11-29 and 2026-12-04, BENCHMARKS §7b): the decode step at 64 rows 3.24 -> 1.69 ms,
at 256 rows 2.41 -> 2.10 ms, the Craftax rollout 1,323 decisions/s against 1,169-1,276. The default for CUDA engines
since 2026-12-08 (`merge_default`; THINKCRAFT_LORA_MERGE=0 the three-operator forward: the A/B switch; the current
code's A/B is queued, bench/queues.sh craftax37); a CPU engine keeps the three operators.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from thinkcraft.llm.hf.copies import StampedLayers, copies_fit, mixin_class, mixin_getattr, unmix
from thinkcraft.utils.errors import UserError, env_switch

_HALF = (torch.bfloat16, torch.float16)


class _FastLoraMixin:
    """Mixed into a PEFT `lora.Linear` subclass by `install` (the instance's class is swapped, so `isinstance`
    checks, `deepcopy` and PEFT's own methods keep working)."""

    _tc_a: torch.Tensor  # (r, in), the base weight's dtype
    _tc_bt: torch.Tensor  # (r, out) = (scaling · B)ᵀ
    _tc_merged: torch.Tensor | None  # (out, in) = W + scaling · B A in the base dtype (merged mode), else None
    _tc_rounding: str  # how the merged weight is rounded to the base dtype (`merge_rounding`)
    _tc_seen: tuple  # (A, B, W) storage pointers and version counters, and the scale, at the last copy
    _tc_train: bool  # the gradient path is `_train_forward` (THINKCRAFT_LORA_FAST_TRAIN, on), else PEFT's

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        if args or kwargs or not _covered(self) or (grad and not self._tc_train):
            return super().forward(x, *args, **kwargs)  # type: ignore[misc]
        if grad:
            return _train_forward(self, x)
        group = self.__dict__.get("_tc_group")
        if group is not None:  # fused with its siblings (fused_proj.py)
            out = group.member_forward(self._tc_index, x)
            if out is not None:
                return out
        if not torch.compiler.is_compiling():
            _refresh_layer(self)
        merged = self._tc_merged
        if merged is not None:
            return F.linear(x.to(merged.dtype), merged, self.base_layer.bias)  # type: ignore[attr-defined]
        h = F.linear(x.to(self._tc_a.dtype), self._tc_a)
        return _plus_low_rank(self.base_layer(x), h, self._tc_bt)  # type: ignore[attr-defined]


def _train_forward(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """The learner's forward: `base(x) + (x Aᵀ)(s B)ᵀ` in the base's dtype, differentiable in A and B (the fp32
    adapters themselves, not the copies) and in x. PEFT's forward casts x to fp32 and autocast casts it back
    for every adapted linear, forward and backward, then scales and adds as two more passes over the output; here
    only the (r, in) and (out, r) adapters are cast, and the scale and the sum ride in the GEMM's epilogue."""
    name = layer._tc_name
    out = layer.base_layer(x)
    dt = out.dtype
    h = F.linear(x.to(dt), layer.lora_A[name].weight.to(dt))
    return _plus_low_rank(out, h, (layer.lora_B[name].weight * layer.scaling[name]).t().to(dt))


def _plus_low_rank(out: torch.Tensor, h: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """`out + h @ bt` as one `addmm` over the flattened rows (the sum in the GEMM's epilogue), in `out`'s shape."""
    n = out.shape[-1]
    return torch.addmm(out.reshape(-1, n), h.reshape(-1, h.shape[-1]), bt).view(out.shape)


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
    """Copy the adapter into the bf16 copies (and re-merge a merged layer) if it or the base weight changed since
    the last copy (in place: a captured graph keeps reading the same tensors); True if it did."""
    a, b, _, _, w = src = _sources(layer)
    seen = _numbers(src)  # the scale too: PEFT's set_scale changes it without touching a tensor
    scale = seen[-1]
    if seen == layer._tc_seen:
        return False
    with torch.no_grad():
        layer._tc_a.copy_(a)
        layer._tc_bt.copy_((b * scale).t())
        merged = layer.__dict__.get("_tc_merged")
        if merged is not None:  # W + s·B·A in fp32, one rounding to the base dtype (`merge_rounding`)
            exact = torch.addmm(w.float(), b.float(), a.float(), alpha=scale)
            if layer.__dict__.get("_tc_rounding", "nearest") == "stochastic" and merged.dtype == torch.bfloat16:
                exact = stochastic_bf16(exact)
            merged.copy_(exact)
    layer._tc_seen = seen
    return True


def merge_default(device: torch.device | None) -> bool:
    """THINKCRAFT_LORA_MERGE: "1" merged weights, "0" the three-operator forward, unset: merged on a CUDA engine (the
    module docstring says why), not elsewhere (a CPU engine's decode step is bound by its compute, not by its kernel
    count, and re-merging every weight at each learner update costs a CPU seconds a step)."""
    import os

    if os.environ.get("THINKCRAFT_LORA_MERGE", "").strip():
        return env_switch("THINKCRAFT_LORA_MERGE")
    return device is not None and device.type == "cuda"


def _device_of(model: torch.nn.Module) -> torch.device | None:
    p = next(iter(model.parameters()), None)
    return None if p is None else p.device


MERGE_ROUNDINGS = ("stochastic", "nearest")


def merge_rounding() -> str:
    """THINKCRAFT_LORA_MERGE_ROUNDING: how a merged weight `W + s·B·A` (fp32) becomes the base dtype - "stochastic"
    (the default: unbiased, the module docstring says why) or "nearest" (round to nearest even, as before
    2026-12-08). A bf16 base only; an fp16 base (10 mantissa bits, the loss 8x smaller) always rounds to nearest."""
    import os

    v = os.environ.get("THINKCRAFT_LORA_MERGE_ROUNDING", "").strip() or MERGE_ROUNDINGS[0]
    if v not in MERGE_ROUNDINGS:
        raise UserError(f"THINKCRAFT_LORA_MERGE_ROUNDING must be one of {', '.join(MERGE_ROUNDINGS)}, got {v!r}")
    return v


_ROUNDING_NOISE: dict[tuple[str, int | None], torch.Generator] = {}
"""One generator per device for the stochastic rounding's noise, seeded alike in every process: the same merges in
the same order give the same weights (a rerun samples what the run sampled)."""


def stochastic_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` rounded to bf16 values stochastically (returned as fp32 that converts to bf16 exactly): up to the
    bf16 neighbour above in magnitude with probability (the part of a bf16 step below x's 16 low mantissa bits) /
    step, else down - so E[result] = x, where rounding to nearest returns the same weight for every x within half a
    step. On the bit pattern: 16 random low bits added to the magnitude (a carry moves it one bf16 step, or into the
    next binade), then truncated. Finite inputs (weights); the sign bit is never touched (the low 16 bits' carry
    stops at the exponent of a finite value below bf16's largest binade)."""
    key = (x.device.type, x.device.index)
    gen = _ROUNDING_NOISE.get(key)
    if gen is None:
        gen = _ROUNDING_NOISE[key] = torch.Generator(device=x.device)
        gen.manual_seed(0x10AA)
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device, generator=gen)
    return ((bits + noise) & -65536).view(torch.float32)  # -65536 = 0xFFFF0000: the high 16 bits, bf16's


def lora_layers(model: torch.nn.Module) -> list[Any]:
    """The model's PEFT `lora.Linear` layers (empty without PEFT or LoRA)."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def _sources(m: Any) -> tuple[torch.Tensor, torch.Tensor, dict, str, torch.Tensor]:
    return m.lora_A[m._tc_name].weight, m.lora_B[m._tc_name].weight, m.scaling, m._tc_name, m.base_layer.weight


def _numbers(src: tuple[torch.Tensor, torch.Tensor, dict, str, torch.Tensor]) -> tuple:
    a, b, scaling, name, w = src  # the base weight: a merged copy follows it (a LoRA learner leaves it alone)
    return a.data_ptr(), a._version, b.data_ptr(), b._version, w.data_ptr(), w._version, scaling[name]


def install(model: torch.nn.Module, merge: bool | None = None, max_merge_bytes: float | None = None) -> list[Any]:
    """Give `model`'s LoRA linears the fast no-grad forward where it applies (a half-precision base, one adapter
    without bias) and return those layers (empty: nothing changed). `merge` (default: `merge_default`, on for a
    model on CUDA) also keeps merged weights (the module docstring says what they cost), if they take at most
    `max_merge_bytes` (default: `copies.COPY_FREE_FRACTION` of a GPU's free memory; no limit on the CPU).
    Idempotent; a layer whose copies are on another device or dtype than its base (a deep copy moved to another
    GPU) gets new ones."""
    if not env_switch("THINKCRAFT_LORA_FAST", default=True):
        return []
    if merge is None:
        merge = merge_default(_device_of(model))
    train = env_switch("THINKCRAFT_LORA_FAST_TRAIN", default=True)
    rounding = merge_rounding() if merge else "nearest"
    fast = StampedLayers([], _sources, _numbers, _refresh_layer)
    todo = []
    for layer in lora_layers(model):
        base = getattr(layer.base_layer, "weight", None)
        names = list(layer.lora_A.keys())
        if not isinstance(base, torch.Tensor) or base.dtype not in _HALF or len(names) != 1:
            continue
        name = names[0]
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
        if layer.lora_B[name].bias is not None or name in layer.lora_variant:
            continue
        todo.append((layer, name, a, b, base))
    merge = merge and bool(todo) and copies_fit(
        sum(base.numel() * base.element_size() for *_, base in todo), todo[0][-1].device, max_merge_bytes,
        "merged LoRA weights (THINKCRAFT_LORA_MERGE): the adapters run as three operators")
    for layer, name, a, b, base in todo:
        old = getattr(layer, "_tc_a", None)
        if old is None or old.device != a.device or old.dtype != base.dtype:
            # outside any inference mode: the copies are updated in place later, which an inference tensor forbids
            with torch.inference_mode(False), torch.no_grad():
                layer._tc_a = torch.empty(a.shape, dtype=base.dtype, device=a.device)
                layer._tc_bt = torch.empty((b.shape[1], b.shape[0]), dtype=base.dtype, device=b.device)
            layer._tc_seen = ()
        merged = layer.__dict__.get("_tc_merged")
        if not merge:
            merged = None
        elif merged is None or merged.device != base.device or merged.dtype != base.dtype:
            with torch.inference_mode(False), torch.no_grad():
                merged = torch.empty(base.shape, dtype=base.dtype, device=base.device)
        if merged is not layer.__dict__.get("_tc_merged"):
            layer._tc_seen = ()  # a new (or no) merged copy: refreshed below
        layer._tc_merged = merged
        if merged is not None and layer.__dict__.get("_tc_rounding") != rounding:
            layer._tc_seen = ()  # merged the other way before: re-merged below
        layer._tc_rounding = rounding
        layer._tc_name = name
        layer._tc_train = train
        cls = type(layer)
        if not isinstance(layer, _FastLoraMixin):
            layer.__class__ = _fast_class(cls)
        _refresh_layer(layer)
        fast.append(layer)
    return fast


def install_for_learner(model: torch.nn.Module) -> list[Any]:
    """The learner's model: its fast layers as they are when an engine sharing it installed them (with that
    engine's merge choice), else `install` without merged copies (a learner alone on its GPU samples nothing)."""
    fast = [m for m in lora_layers(model) if isinstance(m, _FastLoraMixin)]
    return fast if fast else install(model, merge=False)


def counts(layers: list[Any]) -> dict[str, int]:
    """How many of `install`'s layers run each path: {"fast": all of them, "merged": with a merged weight,
    "train": with the cast-free gradient path} (what a benchmark row records)."""
    return {"fast": len(layers), "merged": sum(m.__dict__.get("_tc_merged") is not None for m in layers),
            "train": sum(bool(m.__dict__.get("_tc_train")) for m in layers)}


def strip(model: torch.nn.Module) -> None:
    """Take the copies and the fast forward out of `model` (a copy that another engine or process will install
    its own into: the copies are derived, and a merged one is as large as the adapted weights)."""
    unmix(model, _FastLoraMixin, ("_tc_a", "_tc_bt", "_tc_merged", "_tc_seen", "_tc_name", "_tc_train", "_tc_rounding"))


def _fast_class(cls: type) -> type:
    return mixin_class(_FastLoraMixin, cls, "Fast", globals())


def refresh(layers: list[Any]) -> int:
    """Bring every fast layer's copies up to date (before a compiled or graphed step); how many were copied.
    `install`'s list (`copies.StampedLayers`) answers "nothing changed" from one stamp of flat numbers."""
    if isinstance(layers, StampedLayers):
        return layers.refresh()
    return sum(_refresh_layer(layer) for layer in layers)


# a swapped class unpickled before this process made it
__getattr__ = mixin_getattr(_FastLoraMixin, "Fast", globals())
