"""Python's cyclic garbage collector as a measured cost of a loop's step.

A training process holds torch, transformers, JAX, a compiled env and Dynamo's caches: a few hundred thousand to
millions of tracked objects. A full (generation-2) collection walks all of them, and the collector runs when the
allocations of the hot loop (a rollout builds ~10 containers per turn, 2,048 turns a step) cross its thresholds,
inside whatever line happens to allocate - where a sampling profiler then shows the time. `GC_CLOCK` sums the
seconds the collector ran, per generation (`gc.callbacks`), so a loop reports them beside its timed phases
(`host/gc_s`, `host/gc_full`).

Measured on the Craftax llm-policy row (H200, 2026-12-01, bench/llm_policy_craftax.py): 0.06-0.12 s a step of
~4 s and no full collection in steady steps; freezing the heap after the first step then changed neither the
collector's time nor the rates (480 against 478 decisions/s end to end). Since (2026-12-02, the same row at 256
envs, `bench/results/logs/s53_*`, `s54_*`): a full collection every 4-5 steady steps, 0.5-0.65 s each, inside the
rollout (a step of ~3.7 s then takes ~4.3) - ~0.13 s a step on average, ~8% of a rollout. So the heap made before the
loop's first step ends (torch, transformers, JAX, the compiled graphs, the model) is frozen once after that step
(`freeze_after_first_step`, what vLLM does after capturing its graphs): one collection first (what the first step
left is freed, not frozen), then `gc.freeze()` moves the survivors out of the collector's reach - a later full
collection walks only what the loop made since. Objects frozen are still freed by reference counting; only cycles
among them that become garbage later are kept (the first step's own are collected before the freeze).
THINKCRAFT_GC_FREEZE=0: no freeze (the A/B switch). Measured (1 x H200, 2026-12-03, queue sets craftax16-18, 256 envs,
steps 1-5 of each run): no full collection in any of 12 runs with the freeze (60 steady steps); two in the two runs
without it (10 steps; those rollouts 2.14 and 2.16 s against 1.64-1.80), so the freeze removes the stalls - the
settled rates of the steps without a stall are the same either way.
"""

from __future__ import annotations

import atexit
import gc
import threading
import time

from thinkcraft.utils.errors import env_switch


class GCClock:
    """Seconds the collector ran (every generation) and full collections made, since the process installed it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._t0: dict[int, float] = {}  # per thread: a collection runs on the thread that allocated
        self._installed = False
        self._frozen = False
        self._atexit = False

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
        if t0 is not None:
            self.seconds += time.perf_counter() - t0
        self.full += int(info.get("generation", 0)) >= 2

    def snapshot(self) -> tuple[float, int]:
        """(seconds, full collections) so far."""
        return self.seconds, self.full

    def freeze_after_first_step(self) -> bool:
        """Collect, then freeze the heap, once per process (the module docstring says why); True where it froze
        now. Off with THINKCRAFT_GC_FREEZE=0."""
        if self._frozen or not env_switch("THINKCRAFT_GC_FREEZE", default=True):
            return False
        self._frozen = True
        gc.collect()
        gc.freeze()
        if not self._atexit:  # a process that ends without the loop's own unfreeze (its finally)
            atexit.register(gc.unfreeze)
            self._atexit = True
        return True

    def unfreeze(self) -> None:
        """The frozen heap back under the collector (a process that builds another model after a run: the first
        run's cycles are then collectable; and at exit: the interpreter's last collection skips a frozen heap, so
        Triton's native objects were reported leaked, `nanobind: leaked ...`), and the next loop's first step freezes
        again."""
        gc.unfreeze()
        self._frozen = False

    def metrics_since(self, before: tuple[float, int]) -> dict[str, float]:
        """`host/gc_s` (collector seconds) and `host/gc_full` (full collections) since `before` (a snapshot)."""
        s, full = self.snapshot()
        return {"host/gc_s": s - before[0], "host/gc_full": float(full - before[1])}


GC_CLOCK = GCClock()
