"""The engine side of the rollout pool: many rollout workers, one batched engine call at a time per engine.

Rollout workers call `EngineFront.generate(prompts, keys, sampling)` and block; one thread per engine
("slot") takes the waiting requests as one batch when

    - every episode that could ask is asking (pending rows ≥ `expected_rows()`, a count the rollout pool
      keeps: rows of running episodes + rows of queued groups that a free worker would start now), or
    - the batch is full (`max_batch_rows`), or
    - the oldest request has waited `batch_wait_s` (a straggler env never holds the engine).

Rows are ordered by the workers' keys (group id, sample), so a batch is the same whatever the threads'
timing: with η = 0 the first rule makes every batch exactly the synchronous loop's batch (same prompts,
same order, same sampling stream). Continuous batching (issue 19: requests joining the running decode
batch at step boundaries) replaces the whole-call batching here without changing this interface.

Weights and versions: each slot has a `WeightSync` (pools/weights.py). `publish(update)` hands the newest
learner weights to every slot; a slot applies them between two batches, before its next call (and, with
the engine hook of issue 19, between decode steps). A failed update keeps the slot's old version, is
logged and counted, and retried before the next batch; a slot that lags the learner by more than
`max_lag` versions (η) generates nothing until it catches up, and after `max_update_failures` failures in
a row the front stops with a clear error (`fatal`) instead of training on data staler than η.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from thinkcraft.llm.protocol import Batch, Completion, SamplingParams

log = logging.getLogger(__name__)


class EngineFault(RuntimeError):
    """A generate call failed (the engine raised, timed out, or the front stopped)."""


@dataclass(eq=False)
class _Request:
    prompts: list[list[int]]
    keys: list[Any]
    sampling: SamplingParams
    t_submit: float
    done: threading.Event = field(default_factory=threading.Event)
    completions: list[Completion] | None = None
    version: int = -1
    error: BaseException | None = None


@dataclass
class EngineSlot:
    """One engine and how its weights follow the learner's."""

    engine: Any
    sync: Any
    """A pools.weights.WeightSync: shared parameters, an in-process copy, or an HTTP endpoint."""
    name: str = "engine0"
    device: str | None = None
    """The device it generates on ("cuda:1"); None for a remote (HTTP) engine."""
    gen_context: Callable[[], Any] | None = None
    """Context entered around each generate call (e.g. bf16 autocast)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held during each generate call; a learner that shares this engine's parameters holds it while it
    changes them (time-slicing one device)."""
    busy_s: float = 0.0
    batches: int = 0
    rows: int = 0
    update_failures: int = 0
    failed_in_a_row: int = 0
    retry_at: float = 0.0


@dataclass(frozen=True)
class EngineStats:
    wall_s: float
    busy_s: tuple[float, ...]
    batches: int
    rows: int
    versions: tuple[int, ...]
    update_failures: int
    generate_failures: int

    @property
    def idle_share(self) -> float:
        """Share of wall time the engines did not generate (1 - busy / (engines × wall))."""
        return 1.0 - sum(self.busy_s) / max(len(self.busy_s) * self.wall_s, 1e-9)


class EngineFront:
    def __init__(
        self,
        slots: Sequence[EngineSlot],
        *,
        max_batch_rows: int = 1024,
        batch_wait_s: float = 0.02,
        expected_rows: Callable[[], int] = lambda: 0,
        max_lag: int | None = None,
        max_update_failures: int = 5,
        update_backoff_s: float = 0.5,
    ) -> None:
        self.slots = list(slots)
        self.max_batch_rows = max_batch_rows
        self.batch_wait_s = batch_wait_s
        self.expected_rows = expected_rows
        self.max_lag = max_lag
        self.max_update_failures = max_update_failures
        self.update_backoff_s = update_backoff_s
        self._cv = threading.Condition()
        self._pending: list[_Request] = []
        self._update: Any = None  # the newest published WeightUpdate
        self._stopping = False
        self.fatal: str | None = None
        self.generate_failures = 0
        self._t0 = time.perf_counter()
        self._threads = [threading.Thread(target=self._run, args=(s,), name=f"engine-{s.name}", daemon=True)
                         for s in self.slots]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------------------------ worker side

    def generate(self, prompts: list[list[int]], keys: list[Any], sampling: SamplingParams,
                 timeout_s: float | None = None) -> tuple[list[Completion], int]:
        """Completions for `prompts` (one per prompt, n = 1) and the weight version that made them."""
        req = _Request([list(p) for p in prompts], list(keys), sampling, time.perf_counter())
        with self._cv:
            if self._stopping or self.fatal:
                raise EngineFault(self.fatal or "the engine front is stopped")
            self._pending.append(req)
            self._cv.notify_all()
        if not req.done.wait(timeout_s):
            with self._cv:  # by identity: another request may hold equal prompts
                self._pending = [r for r in self._pending if r is not req]
            raise EngineFault(f"no completion within {timeout_s:g}s (engine busy, hung or dead)")
        if req.error is not None:
            raise EngineFault(f"{type(req.error).__name__}: {req.error}") from req.error
        assert req.completions is not None
        return req.completions, req.version

    def notify(self) -> None:
        """The rollout pool's expected row count changed: re-check whether a batch is ready."""
        with self._cv:
            self._cv.notify_all()

    # ----------------------------------------------------------------------------------- learner side

    def publish(self, update: Any) -> None:
        """The learner's new weights (a WeightUpdate); every slot takes them before its next batch."""
        with self._cv:
            if self._update is None or update.version > self._update.version:
                self._update = update
            self._cv.notify_all()

    @property
    def published_version(self) -> int:
        return self._update.version if self._update is not None else min(s.sync.version for s in self.slots)

    def stats(self) -> EngineStats:
        now = time.perf_counter()
        return EngineStats(now - self._t0, tuple(s.busy_s for s in self.slots), sum(s.batches for s in self.slots),
                           sum(s.rows for s in self.slots), tuple(s.sync.version for s in self.slots),
                           sum(s.update_failures for s in self.slots), self.generate_failures)

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            pending, self._pending = self._pending, []
            self._cv.notify_all()
        for r in pending:
            r.error = EngineFault("the engine front stopped")
            r.done.set()
        for t in self._threads:
            t.join(timeout_s)

    # ----------------------------------------------------------------------------------- slot threads

    def _ready(self, now: float) -> tuple[bool, float]:
        """(take a batch now?, seconds to wait otherwise)."""
        if not self._pending:
            return False, 0.5
        rows = sum(len(r.prompts) for r in self._pending)
        if rows >= self.max_batch_rows or rows >= max(1, self.expected_rows()):
            return True, 0.0
        left = self.batch_wait_s - (now - min(r.t_submit for r in self._pending))
        return left <= 0, max(left, 1e-3)

    def _lagging(self, slot: EngineSlot) -> bool:
        return (self.max_lag is not None and self._update is not None
                and self._update.version - slot.sync.version > self.max_lag)

    def _take(self, slot: EngineSlot) -> list[_Request] | None:
        """Wait until this slot should run a batch; None when stopping."""
        with self._cv:
            while True:
                if self._stopping or self.fatal:
                    return None
                now = time.perf_counter()
                needs_update = self._update is not None and self._update.version > slot.sync.version
                if needs_update and now >= slot.retry_at:
                    return []  # apply the update first (outside the condition lock)
                if needs_update and self._lagging(slot):
                    self._cv.wait(max(slot.retry_at - now, 1e-3))
                    continue
                ready, wait = self._ready(now)
                if ready:
                    taken, rows = [], 0
                    while self._pending and (not taken or rows + len(self._pending[0].prompts) <= self.max_batch_rows):
                        r = self._pending.pop(0)
                        taken.append(r)
                        rows += len(r.prompts)
                    return taken
                self._cv.wait(wait)

    def _run(self, slot: EngineSlot) -> None:
        while True:
            taken = self._take(slot)
            if taken is None:
                return
            if not taken:
                self._apply_update(slot)
                continue
            self._generate(slot, taken)

    def _apply_update(self, slot: EngineSlot) -> None:
        import contextlib

        update = self._update
        old = slot.sync.version
        try:
            # in the generate calls' context (autocast): an engine recomputing KV it keeps computes it as they do
            with slot.lock, (slot.gen_context() if slot.gen_context is not None else contextlib.nullcontext()):
                slot.sync.apply(update)
            slot.failed_in_a_row = 0
        except Exception as e:  # noqa: BLE001 - the engine keeps its old weights; retried
            slot.update_failures += 1
            slot.failed_in_a_row += 1
            slot.retry_at = time.perf_counter() + self.update_backoff_s * min(2 ** (slot.failed_in_a_row - 1), 16)
            log.warning("%s: weight update to version %d failed (%s: %s); the engine keeps version %d and "
                        "retries (%d/%d)", slot.name, update.version, type(e).__name__, e, old,
                        slot.failed_in_a_row, self.max_update_failures)
            if slot.failed_in_a_row >= self.max_update_failures:
                with self._cv:
                    self.fatal = (f"{slot.name}: weight update to version {update.version} failed "
                                  f"{slot.failed_in_a_row} times in a row (last: {type(e).__name__}: {e}); the "
                                  f"engine is still at version {old}")
                    self._cv.notify_all()
                self._fail_pending(EngineFault(self.fatal))

    def _fail_pending(self, err: BaseException) -> None:
        with self._cv:
            pending, self._pending = self._pending, []
        for r in pending:
            r.error = err
            r.done.set()

    def _generate(self, slot: EngineSlot, taken: list[_Request]) -> None:
        import contextlib

        by_sampling: dict[SamplingParams, list[tuple[_Request, int]]] = {}
        for r in taken:
            for i in range(len(r.prompts)):
                by_sampling.setdefault(r.sampling, []).append((r, i))
        outs: dict[tuple[int, int], Completion] = {}
        try:
            for sampling, rows in by_sampling.items():
                rows.sort(key=lambda ri: ri[0].keys[ri[1]])
                with slot.lock:
                    version = slot.sync.version
                    ctx = slot.gen_context() if slot.gen_context is not None else contextlib.nullcontext()
                    t0 = time.perf_counter()
                    with ctx:
                        comps = slot.engine.generate(Batch(items=[r.prompts[i] for r, i in rows]), sampling)
                    slot.busy_s += time.perf_counter() - t0
                if len(comps) != len(rows):
                    raise EngineFault(f"the engine returned {len(comps)} completions for {len(rows)} prompts")
                for (r, i), c in zip(rows, comps):
                    outs[(id(r), i)] = c
                    r.version = version
                slot.batches += 1
                slot.rows += len(rows)
        except Exception as e:  # noqa: BLE001 - every request of the batch fails; the workers drop their groups
            self.generate_failures += 1
            log.warning("%s: generate failed for %d requests (%s: %s)", slot.name, len(taken), type(e).__name__, e)
            for r in taken:
                r.error = e
                r.done.set()
            return
        for r in taken:
            r.completions = [outs[(id(r), i)] for i in range(len(r.prompts))]
            r.done.set()
