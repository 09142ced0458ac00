"""Which accelerator this process computes on - one answer for runs (`config.json` `_derived.hardware`) and the
benchmarks' `card` column."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys


def gpu_name(load: bool = False) -> str | None:
    """The first visible GPU's name, None without one, found without starting a framework on the GPU where
    possible: first a framework this process already started there (torch's CUDA, JAX's backends), then
    `nvidia-smi`, and only then the frameworks themselves - those already imported, or with `load` (a benchmark
    naming its card before it has run anything) any, JAX first. Why the order: after this function had started
    JAX's GPU client in a torch process, torch's "cuda" meant the last GPU, not the first - an async bench row's
    learner went to its engine's GPU (2 x H200, 2026-11-29, bench/results/logs/s45_*run1.log; on 4 x H200 on
    2026-11-27 a learner went to cuda:3 the same way) - and JAX may preallocate most of every GPU's memory."""
    started = _started_name()
    if started:
        return started
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return None  # no GPU visible to this process
    smi = _nvidia_smi_name(visible)
    if smi:
        return smi
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


def _started_name() -> str | None:
    """The name from a framework already running on a GPU in this process (asking it starts nothing)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    jax = sys.modules.get("jax")
    try:
        from jax._src import xla_bridge  # private (jax 0.4-0.7): whether any backend was made yet

        if jax is not None and getattr(xla_bridge, "_backends", None):
            return _jax_gpu(jax)
    except Exception:  # noqa: BLE001 - another jax layout: not asked here
        pass
    return None


def _nvidia_smi_name(visible: str | None) -> str | None:
    """`nvidia-smi`'s name for the first visible GPU (CUDA_VISIBLE_DEVICES' first entry: an index or a UUID), or
    None where the tool is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    first = visible.split(",")[0].strip() if visible else "0"
    try:
        out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader", "-i", first], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    name = out.strip().splitlines()[0].strip() if out.strip() else ""
    return name or None


def _jax_gpu(jax) -> str | None:  # noqa: ANN001
    d = jax.devices()[0]
    return d.device_kind if d.platform == "gpu" else None


def _torch_gpu(torch) -> str | None:  # noqa: ANN001
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
