"""Derived copies of a model's tensors that an engine's forwards read (lora_fast's bf16 adapters, autocast_shadow's
half weights), kept fresh with one cheap check a step, and the class swap that gives a layer its copy-reading
forward."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch

from thinkcraft.llm import compat

log = logging.getLogger(__name__)

COPY_FREE_FRACTION = 0.25
"""Derived copies (autocast_shadow's half weights, lora_fast's merged ones) are made only if they take at most this
share of the device's free memory: 2 bytes a weight is 8 GB for a 4B model, beside a learner's state."""


def copies_fit(need_bytes: int, device: torch.device, max_bytes: float | None, what: str) -> bool:
    """Whether copies of `need_bytes` may be made on `device`: at most `max_bytes` (None: `COPY_FREE_FRACTION` of
    a GPU's free memory, no limit elsewhere). Says in the log what is done without them (`what`) when not."""
    if max_bytes is None and device.type == "cuda":
        max_bytes = COPY_FREE_FRACTION * torch.cuda.mem_get_info(device)[0]
    if max_bytes is not None and need_bytes > max_bytes:
        log.warning("no %s: they would take %.2f GiB, over the %.2f GiB allowed", what, need_bytes / 2**30,
                    max_bytes / 2**30)
        return False
    return True


class StampedLayers(list):
    """Layers that keep copies of source tensors, with each layer's sources resolved once (`resolve(layer)`): the
    per-step check (`refresh`) compares one flat stamp of numbers (`numbers(sources)`: storage pointers, version
    counters, scales) instead of walking modules - for lora_fast's 168 layers of the Qwen2.5-0.5B shape the walk
    took 1.3 ms of host time a decode step (cProfile, H200, 2026-11-28, bench/results/logs/s38_*host*: a host-bound
    step of ~2.9 ms at 64 rows). Resolved again when a Parameter is registered anywhere (`compat.parameter_epoch`:
    a replaced module or Parameter); a storage swapped under a Parameter moves its pointer, which the stamp reads."""

    def __init__(self, layers: list[Any], resolve: Callable[[Any], Any], numbers: Callable[[Any], Iterable[Any]],
                 refresh_layer: Callable[[Any], bool]) -> None:
        super().__init__(layers)
        self._resolve, self._numbers, self._refresh_layer = resolve, numbers, refresh_layer
        self._epoch = -1
        self._sources: list[Any] = []
        self._seen: list[Any] | None = None

    def stamp(self) -> list[Any]:
        epoch = compat.parameter_epoch()
        if epoch != self._epoch:
            self._sources = [self._resolve(m) for m in self]
            self._epoch = epoch
        out: list[Any] = []
        for src in self._sources:
            out += self._numbers(src)
        return out

    def refresh(self) -> int:
        """Copy what changed since the last refresh (every layer checks its own sources then); how many layers
        were copied. Nothing moved: one stamp compared, nothing copied."""
        stamp = self.stamp()
        if stamp == self._seen:
            return 0
        n = sum(self._refresh_layer(m) for m in self)
        self._seen = stamp
        return n


def mixin_class(mixin: type, cls: type, prefix: str, namespace: dict[str, Any]) -> type:
    """`cls` with `mixin` first, made once and named in `namespace` (a module's globals): pickle finds it by name,
    so a model pickled whole (Ray's object store, torch.save) loads where thinkcraft is importable - in another
    process too, where the module's `__getattr__` makes it from its name (`resolve_mixin_class`)."""
    name = f"{prefix}__{cls.__module__.replace('.', '__')}__{cls.__name__}"
    if name not in namespace:
        namespace[name] = type(name, (mixin, cls), {"__module__": namespace["__name__"], "__qualname__": name,
                                                    "_tc_unmixed": cls})
    return namespace[name]


def mixin_getattr(mixin: type, prefix: str, namespace: dict[str, Any]) -> Any:
    """A module's `__getattr__` (`__getattr__ = mixin_getattr(Mixin, "Prefix", globals())`) that makes the classes
    `mixin_class` names on demand (`resolve_mixin_class`)."""
    return lambda name: resolve_mixin_class(name, mixin, prefix, namespace)


def resolve_mixin_class(name: str, mixin: type, prefix: str, namespace: dict[str, Any]) -> type:
    """For a module's `__getattr__`: the class `mixin_class` named `name`, made now - a model unpickled in a
    process that has not installed anything yet (a Ray actor receiving the learner's model: 2026-11-29, "Can't get
    attribute 'Fused_…Qwen2RMSNorm'"). AttributeError for any other name, as a module must."""
    import importlib

    parts = name.split("__")
    if len(parts) >= 3 and parts[0] == prefix:
        try:
            cls = getattr(importlib.import_module(".".join(parts[1:-1])), parts[-1])
        except (ImportError, AttributeError, ValueError):
            cls = None
        if isinstance(cls, type):
            made = mixin_class(mixin, cls, prefix, namespace)
            if made.__name__ == name:
                return made
    raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")


def unmix(model: Any, mixin: type, attrs: Iterable[str]) -> None:
    """Undo `mixin_class` on every module of `model` that has it: the original class back, `attrs` (the copies
    the mixin's forward read) dropped - for a copy of a model that another engine or process installs its own in."""
    for m in model.modules():
        if isinstance(m, mixin):
            m.__class__ = next(c for c in type(m).__mro__[1:] if not issubclass(c, mixin))
            for name in attrs:
                m.__dict__.pop(name, None)
