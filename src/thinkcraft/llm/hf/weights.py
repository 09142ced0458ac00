"""Versioned weight updates for an engine that holds its own copy of the weights (same or another device).

`apply_state` is all-or-nothing where it can be: every name and shape is checked, and every tensor staged on
the parameter's device in its dtype (a host->device copy, or a peer-to-peer copy from another GPU), before
any parameter changes; only then are the staged tensors copied in (same device, same shape and dtype: a copy
that does not fail short of a device fault). A refused update raises `WeightUpdateError` and leaves the
weights as they were. LoRA runs send the adapter tensors only (`lora_A` / `lora_B`, what the learner trains).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from thinkcraft.llm.protocol import WeightUpdateError

WRAPPER_PREFIXES = ("base_model.model.", "_orig_mod.", "module.")
"""Name prefixes a learner's model may add (PEFT, torch.compile, DDP); an update name is matched as it is,
then with one of these removed."""


def _named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, tied weights under each of their names."""
    return dict(model.state_dict(keep_vars=True))


def _lookup(named: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    if name in named:
        return named[name]
    for p in WRAPPER_PREFIXES:
        if name.startswith(p) and name[len(p):] in named:
            return named[name[len(p):]]
        if p + name in named:
            return named[p + name]
    return None


def apply_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                version: int) -> int:
    """Copy `state` (name -> tensor) into `model`'s parameters; returns how many tensors changed. Raises
    `WeightUpdateError` (nothing changed) for an unknown name, a shape mismatch, a non-tensor or a failure
    while staging the tensors on the device."""
    items = list(state.items()) if isinstance(state, Mapping) else list(state)
    if not items:
        raise WeightUpdateError(f"weight update to version {version} carries no tensors")
    named = _named(model)
    targets: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, value in items:
        target = _lookup(named, name)
        if target is None:
            raise WeightUpdateError(f"weight update to version {version}: the engine's model has no tensor {name!r}; "
                                    "kept the previous weights")
        if not isinstance(value, torch.Tensor):
            raise WeightUpdateError(f"weight update to version {version}: {name} is a {type(value).__name__}, not a "
                                    "tensor; kept the previous weights")
        if tuple(value.shape) != tuple(target.shape):
            raise WeightUpdateError(f"weight update to version {version}: {name} has shape {tuple(value.shape)}, the "
                                    f"engine's is {tuple(target.shape)}; kept the previous weights")
        targets.append((target, value))
    try:  # a tensor already on the target's device in its dtype is copied from as it is (no call per tensor)
        staged = [(t, v if v.device == t.device and v.dtype == t.dtype
                   else v.detach().to(device=t.device, dtype=t.dtype, non_blocking=True)) for t, v in targets]
    except (RuntimeError, TypeError) as e:  # out of memory, an unreachable device, an impossible cast
        raise WeightUpdateError(f"weight update to version {version} could not be staged on the engine's device "
                                f"({type(e).__name__}: {e}); kept the previous weights") from e
    # one call per (device, dtype) of the targets, not one per tensor: the engine stands still while it copies, and
    # each of ~290 per-tensor calls (the Qwen2.5-0.5B shape) gives the interpreter lock up and waits to take it
    # back behind a learner thread launching its own work (an update cost the engine 0.07-0.16 s on 2 x H200,
    # 2026-11-29); the staged tensors are on the targets' device in their dtype, so nothing here can fail short of
    # a device fault. Version counters move as with copy_ (what lora_fast's freshness checks read).
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for t, v in staged:
        dst, src = groups.setdefault((t.device, t.dtype), ([], []))
        dst.append(t)
        src.append(v)
    with torch.no_grad():
        for dst, src in groups.values():
            torch._foreach_copy_(dst, src)
    return len(staged)


def staged_like(items: Iterable[tuple[str, torch.Tensor]], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of `items` (name, tensor), each on the device and in the dtype `model` holds it in (e.g. a bf16
    engine copy on another GPU), for `apply_state` into `model`, whose staging is then nothing and whose copy one
    call per device and dtype. Why: the engine stands still while it takes an update, and staged there a cast and
    a peer-to-peer copy per tensor are ~580 calls that each give up the interpreter lock and wait to take it back
    behind the learner's thread (0.07-0.16 s an update, 2 x H200, 2026-11-29); the learner's thread makes them
    instead, in place of the clones it made anyway. A name `model` lacks, or a shape it holds otherwise, is kept as
    a plain copy (apply_state then refuses it with its message)."""
    named = _named(model)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, value in items:
            target = _lookup(named, name)
            v = value.detach()
            if target is None or tuple(target.shape) != tuple(v.shape):
                out[name] = v.clone()
            else:
                out[name] = v.to(device=target.device, dtype=target.dtype, copy=True)
    return out


def is_lora_name(name: str) -> bool:
    return "lora_A" in name or "lora_B" in name or "lora_embedding" in name


def lora_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter tensors of a PEFT model (what a LoRA learner publishes), detached."""
    return {n: p.detach() for n, p in model.named_parameters() if is_lora_name(n)}


def strip_copies(model: torch.nn.Module) -> None:
    """Take an engine's derived copies out of `model` (autocast_shadow's half weights, lora_fast's adapter copies
    and merged weights, fused_proj's fused projections): a deep copy of a model that an engine served, made for
    another engine or process, which installs its own - device tensors of the first engine's would otherwise travel
    with it (Ray's object store) or go stale."""
    from thinkcraft.llm.hf import autocast_shadow, fused_proj, lora_fast

    autocast_shadow.strip(model)
    fused_proj.strip(model)
    lora_fast.strip(model)


def autocast_weights(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` (a sampler's own copy of fp32 master weights, served under `dtype` autocast) with the weights that
    autocast casts at every call stored in `dtype` once: every `nn.Linear` and `nn.Embedding` (tied weights stay
    tied). Norms and other parameters keep their dtype, so the forward under autocast is the one the fp32 copy
    computes: autocast's cast of a fp32 weight is the rounding this stores (an update copied in later -
    `apply_state` - is rounded the same way), and the embeddings' rows are cast alike.
    Why: a copy engine served full fine-tuning's fp32 weights and cast each of them to bf16 inside every decode
    step - for the Qwen2.5-0.5B shape ~170 extra kernels and ~3 GB of memory traffic a step, on a step that the
    device bounds (3.4-3.5 ms at 30-95 rows, 4 x H200, 2026-11-28, bench/results/logs/s38_*async_2gpu*). In place;
    returns `model`."""
    strip_copies(model)  # a copy of a model an engine served: its weights are the half copies now
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            m.to(dtype)
    return model
