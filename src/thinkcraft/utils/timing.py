"""Timed phases: every loop phase's wall time becomes a `timing/<phase>` metric (STYLE.md §4)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from typing import Iterator


class PhaseTimer:
    """Accumulates seconds per named phase between `reset()` calls.

    >>> t = PhaseTimer()
    >>> with t.phase("env"):
    ...     pass
    >>> sorted(t.metrics())
    ['timing/env']
    """

    def __init__(self) -> None:
        self._seconds: dict[str, float] = defaultdict(float)
        # phases may run in worker threads (ppo-hidden --overlap times its LLM calls there)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] += seconds

    def seconds(self, name: str) -> float:
        return self._seconds.get(name, 0.0)

    def total(self) -> float:
        with self._lock:
            return sum(self._seconds.values())

    def metrics(self, prefix: str = "timing/") -> dict[str, float]:
        with self._lock:
            return {prefix + k: v for k, v in self._seconds.items()}

    def reset(self) -> None:
        with self._lock:
            self._seconds.clear()
