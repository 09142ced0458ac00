"""Where the engine's own Triton kernels (split_decode, fused_sampler, fused_mlp, fused_rope) may run: CUDA, or the
CPU under Triton's interpreter (TRITON_INTERPRET=1, read when Triton loads: the tests run the kernels there in a fresh
process). One definition for them all, each of which still checks its kernel at first use."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch

from thinkcraft.utils.errors import env_int


def interpreted() -> bool:
    """Triton's CPU interpreter is on (it also multiplies half-precision tiles wrongly and casts to bf16 by
    truncating: the kernels upcast or round by hand there)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def runs_on(device: torch.device) -> bool:
    """CUDA, or the CPU with the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


def pow2_at_least(n: int, least: int = 1) -> int:
    """The smallest power of two times `least` that is >= `n` (a Triton block dimension: tl.arange needs one)."""
    p = least
    while p < n:
        p *= 2
    return p


DECODE_TOKENS_MAX = env_int("THINKCRAFT_FUSED_TOKENS_MAX", 2048, least=1)
"""The most tokens a forward may hold for the elementwise kernels (fused_mlp, fused_rope) to take it: decode-sized
calls, captured in the decode graphs. On the Craftax row (Qwen2.5-0.5B shape, 256 envs, 1 x H200, 2026-12-03, queue
set craftax16) both kernels cut the decode phase (0.93 -> 0.83 s a rollout with the rotary embedding, -> 0.66 s
with the MLP as well) while the packed prefills (~23k tokens a call, eager, bound by launches) got slower by about as
much (0.35 -> 0.40 and 0.52 s), so the rollout did not move: the prefill keeps torch's ops. With this bound (queue
set craftax17, another machine, six runs in turns) the rollout still did not move beyond the machines' noise: 1,074
and 1,061 decisions/s with the rotary kernel, 1,048 / 1,061 with both kernels, 1,031 / 1,066 with neither - at 256
envs this rollout is bound by its host between the device's phases, not by these kernels. THINKCRAFT_FUSED_TOKENS_MAX
(read at import) sets another bound: the A/B of the kernels on prefills replayed from CUDA graphs, whose launches no
longer bound them (THINKCRAFT_PREFILL_GRAPH_TOKENS)."""


def decode_sized(tokens: int) -> bool:
    """Whether a forward over `tokens` tokens is small enough for the elementwise kernels (`DECODE_TOKENS_MAX`)."""
    return tokens <= DECODE_TOKENS_MAX


class FirstUseChecks:
    """A kernel's first-use check, run once per (device, what else it depends on: a dtype, a shape) in a process and
    remembered. `check(device, *parts)` raises where the kernel's values differ from the reference (or it cannot
    compile) and may return what it chose (the sampler's noise variant; None counts as True); `run` turns a raise into
    False and one warning naming what the model keeps instead. `ok` runs it where it has not run, `value` gives what
    it returned, `known` that without running it (None: not checked yet), `checked` whether it has run (a caller
    inside a CUDA-graph capture must not start one: a check synchronises), `passed` whether it passed on a device for
    any parts (what the decode metrics report). `describe(*parts)` words the parts in the warning."""

    def __init__(self, check: Callable[..., Any], log: logging.Logger, kernel: str, fallback: str,
                 describe: Callable[..., str] | None = None) -> None:
        self._check, self._log, self._kernel, self._fallback = check, log, kernel, fallback
        self._describe = describe or (lambda *parts: ", ".join(str(p) for p in parts))
        self.state: dict[tuple, Any] = {}

    def run(self, device: torch.device, *parts: Any) -> Any:
        try:
            got = self._check(device, *parts)
            return True if got is None else got
        except Exception as e:  # noqa: BLE001 - the model keeps torch's ops, said once
            where = f"{device} ({self._describe(*parts)})" if parts else str(device)
            self._log.warning("%s failed its first-use check on %s (%s: %s): %s", self._kernel, where,
                              type(e).__name__, e, self._fallback)
            return False

    @staticmethod
    def _key(device: torch.device, parts: tuple) -> tuple:
        return (device.type, device.index, *parts)

    def value(self, device: torch.device, *parts: Any) -> Any:
        key = self._key(device, parts)
        if key not in self.state:
            self.state[key] = self.run(device, *parts)
        return self.state[key]

    def ok(self, device: torch.device, *parts: Any) -> bool:
        return bool(self.value(device, *parts))

    def known(self, device: torch.device, *parts: Any) -> Any:
        return self.state.get(self._key(device, parts))

    def checked(self, device: torch.device, *parts: Any) -> bool:
        return self._key(device, parts) in self.state

    def passed(self, device: torch.device) -> bool:
        here = self._key(device, ())
        return any(bool(v) for key, v in self.state.items() if key[:2] == here)
