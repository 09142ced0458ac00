"""Where the engine's own Triton kernels (split_decode, fused_sampler, fused_mlp) may run: CUDA, or the CPU under
Triton's interpreter (TRITON_INTERPRET=1, read when Triton loads: the tests run the kernels there in a fresh
process). One definition for the three, each of which still checks its kernel at first use."""

from __future__ import annotations

import os

import torch


def interpreted() -> bool:
    """Triton's CPU interpreter is on (it also multiplies half-precision tiles wrongly and casts to bf16 by
    truncating: the kernels upcast or round by hand there)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def runs_on(device: torch.device) -> bool:
    """CUDA, or the CPU with the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreted())
