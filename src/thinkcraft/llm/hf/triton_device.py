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


FUSED_TOKENS_MAX = env_int("THINKCRAFT_FUSED_TOKENS_MAX", 0, least=0)
"""The most tokens a forward may hold for the elementwise kernels (fused_mlp, fused_rope) to take it; 0 (the default):
every size, the packed prefills' too. History: from 2026-12-03 they served decode-sized forwards only (2,048 tokens):
with the prefill then bound by its host's launches, the kernels' time saved there had not become rollout time
(queue sets craftax16/17). Since the prefill is bound by the device, they pay in it: on the Craftax row (Qwen2.5-0.5B
shape, 256 envs, 1 x H200, 2026-12-04, queue set craftax28, the device's phases timed, runs in turns on one machine)
the packed prefill (~23k tokens a call) took 65-69 ms of device time a call with both kernels at every size against
81-84 ms with torch's ops there, the decode iteration unchanged (2.41 vs 2.40-2.43 ms), the rollout 1,276 and 1,251
decisions/s against 1,169 (BENCHMARKS §7b). THINKCRAFT_FUSED_TOKENS_MAX=2048 (read at import) gives the old bound."""


def fused_size(tokens: int) -> bool:
    """Whether a forward over `tokens` tokens is one the elementwise kernels take (`FUSED_TOKENS_MAX`)."""
    return FUSED_TOKENS_MAX == 0 or tokens <= FUSED_TOKENS_MAX


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
