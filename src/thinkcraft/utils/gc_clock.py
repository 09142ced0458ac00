"""Python's cyclic garbage collector as a measured cost, and the heap frozen once a loop is warm.

A training process holds torch, transformers, JAX, a compiled env and Dynamo's caches: a few hundred thousand to
millions of tracked objects. Every full (generation-2) collection walks all of them, and the collector runs when
the allocations of the hot loop (a rollout builds ~10 containers per turn, 2,048 turns a step) cross its
thresholds, inside whatever line happens to allocate. Two tools:

- `GC_CLOCK` sums the seconds the collector ran, per generation (`gc.callbacks`), so a loop can report them as a
  metric (`host/gc_s`, `host/gc_full`) beside its timed phases.
- `freeze_once()` moves every object alive now into the permanent generation (`gc.freeze()`), which collections
  never walk again: called after a loop's first step (models built, programs compiled, graphs captured), later
  collections walk only what the loop itself keeps. What is frozen is never collected if it later becomes
  cyclic garbage; after the warm-up step that is setup state that lives as long as the process. vLLM freezes
  its heap the same way after capturing its CUDA graphs. `THINKCRAFT_GC_FREEZE=0` turns it off.
"""

from __future__ import annotations

import atexit
import gc
import threading
import time

from thinkcraft.utils.errors import env_switch


class GCClock:
    """Seconds the collector ran and collections made, per generation, since the process installed it."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._t0: dict[int, float] = {}  # per thread: a collection runs on the thread that allocated
        self._installed = False

    def install(self) -> GCClock:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def _callback(self, phase: str, info: dict) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._t0[tid] = time.perf_counter()
            return
        t0 = self._t0.pop(tid, None)
        gen = min(int(info.get("generation", 0)), 2)
        if t0 is not None:
            self.seconds[gen] += time.perf_counter() - t0
        self.collections[gen] += 1

    def snapshot(self) -> tuple[float, int]:
        """(seconds over every generation, full collections) so far."""
        return sum(self.seconds), self.collections[2]

    def metrics_since(self, before: tuple[float, int]) -> dict[str, float]:
        """`host/gc_s` (collector seconds) and `host/gc_full` (full collections) since `before` (a snapshot)."""
        s, full = self.snapshot()
        return {"host/gc_s": s - before[0], "host/gc_full": float(full - before[1])}


GC_CLOCK = GCClock()

_frozen = False


def freeze_once() -> bool:
    """`gc.freeze()` the first time it is called in the process (after a loop's warm-up step; see the module
    docstring), unless THINKCRAFT_GC_FREEZE=0. A collection first, so that the garbage of the warm-up step is
    not frozen with the heap. True when it froze."""
    global _frozen
    if _frozen or not env_switch("THINKCRAFT_GC_FREEZE", default=True):
        return False
    gc.collect()
    gc.freeze()
    _frozen = True
    # at exit the heap goes back to the collector: the interpreter's last collections then free what was frozen
    # (nanobind-based extensions - xgrammar - otherwise report their objects as leaked at shutdown)
    atexit.register(gc.unfreeze)
    return True
