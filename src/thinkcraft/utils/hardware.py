"""Which accelerator this process computes on - one answer for runs (`config.json` `_derived.hardware`) and the
benchmarks' `card` column."""

from __future__ import annotations

import importlib
import sys


def gpu_name(load: bool = False) -> str | None:
    """The first GPU's name, JAX's view first, then torch's; None without one. Only frameworks already imported
    are asked, unless `load` (a benchmark naming its card before it has run anything)."""
    for mod, ask in (("jax", _jax_gpu), ("torch", _torch_gpu)):
        if mod not in sys.modules and not load:
            continue
        try:
            name = ask(importlib.import_module(mod))
        except Exception:  # noqa: BLE001 - a framework that cannot start a device names none
            name = None
        if name:
            return name
    return None


def _jax_gpu(jax) -> str | None:  # noqa: ANN001
    d = jax.devices()[0]
    return d.device_kind if d.platform == "gpu" else None


def _torch_gpu(torch) -> str | None:  # noqa: ANN001
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
