"""The engine side of the rollout pool: many rollout workers, their turns batched onto the engines.

Rollout workers call `EngineFront.run(prompts, keys, sampling, ...)` and block. One thread per engine ("slot") serves them in one of two ways (`batching`):

**whole** (any engine: `generate(batch)`): the slot takes the waiting requests as one batch when

    - every episode that could ask is asking (pending rows ≥ `expected_rows()`, a count the rollout pool
      keeps: rows of running episodes + rows of queued groups that a free worker would start now), or
    - the batch is full (`max_batch_rows`), or
    - the oldest request has waited `batch_wait_s` (a straggler env never holds the engine).

  Rows are ordered by the workers' keys (group id, sample), so a batch is the same whatever the threads'
  timing: with η = 0 the first rule makes every batch exactly the synchronous loop's batch (same prompts,
  same order, same sampling stream).

**continuous** (engines with `Capabilities.continuous_batching`, the in-process hf engine): every row is
submitted at once and joins the engine's running decode batch at the next step boundary; the slot thread
steps the engine and hands each request back as soon as its rows finished, so no group waits for another's
long generation. A group's turns go to one engine (sticky by `route`): with `episodes` keys the engine keeps
each episode's KV between turns and prefills only the new tokens (`release` drops it when the episode
ends); `prefix_len` tokens of a prompt (the system prompt) are a prefix whose KV is stored once.

Weights and versions: each slot has a `WeightSync` (pools/weights.py). `publish(update)` hands the newest
learner weights to every slot; a whole-call slot applies them between two batches, a continuous one between
two decode steps (running rows go on under the new weights; every result says from which token:
`GenerationResult.weight_versions`, AReaL's partial rollouts). A failed update keeps the slot's old
version, is logged and counted, and retried; a slot that lags the learner by more than `max_lag` versions
(η) starts nothing new until it catches up, and after `max_update_failures` failures in a row the front
stops with a clear error (`fatal`) instead of training on data staler than η.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Literal, Sequence

from thinkcraft.llm.protocol import Batch, GenerationRequest, GenerationResult, SamplingParams

log = logging.getLogger(__name__)


class EngineFault(RuntimeError):
    """A generate call failed (the engine raised, timed out, or the front stopped)."""


@dataclass(eq=False)
class _Request:
    prompts: list[list[int]]
    keys: list[Any]
    sampling: SamplingParams
    t_submit: float
    prefix_len: int = 0
    episodes: list[Hashable] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    results: list[GenerationResult | None] = field(default_factory=list)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.results = [None] * len(self.prompts)

    def fail(self, err: BaseException) -> None:
        if not self.done.is_set():
            self.error = err
            self.done.set()


class FairLock:
    """A lock granted in the order it was asked for (a ticket lock). A continuous-batching slot thread takes
    its engine's lock for every decode step, in a tight loop; a plain lock promises a waiter nothing (the
    thread that just released it may take it again first), so a learner sharing the engine's parameters could
    wait for many steps. Not reentrant."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._next = 0
        self._serving = 0

    def acquire(self) -> bool:
        with self._cv:
            ticket = self._next
            self._next += 1
            while self._serving != ticket:
                self._cv.wait()
        return True

    def release(self) -> None:
        with self._cv:
            self._serving += 1
            self._cv.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


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
    lock: Any = field(default_factory=FairLock)
    """Held during each generate call; a learner that shares this engine's parameters holds it while it
    changes them (time-slicing one device)."""
    busy_s: float = 0.0
    batches: int = 0
    rows: int = 0
    update_failures: int = 0
    failed_in_a_row: int = 0
    retry_at: float = 0.0
    updates: int = 0
    """Weight updates this engine took (a shared engine's are free: nothing moves)."""
    update_s: float = 0.0
    """Seconds those updates took (copy + load, the slot's lock held): issue 21's weight-sync time."""


@dataclass(frozen=True)
class EngineStats:
    wall_s: float
    busy_s: tuple[float, ...]
    batches: int
    """Generate calls (whole-call batching) or decode steps (continuous)."""
    rows: int
    """Rows summed over those batches: rows / batches is the mean batch."""
    versions: tuple[int, ...]
    update_failures: int
    generate_failures: int
    updates: tuple[int, ...] = ()
    """Weight updates each engine took, and their seconds (`update_s`)."""
    update_s: tuple[float, ...] = ()

    @property
    def idle_share(self) -> float:
        """Share of wall time the engines did not generate (1 - busy / (engines × wall))."""
        return 1.0 - sum(self.busy_s) / max(len(self.busy_s) * self.wall_s, 1e-9)


class EngineFront:
    def __init__(
        self,
        slots: Sequence[EngineSlot],
        *,
        batching: Literal["whole", "continuous"] = "whole",
        max_batch_rows: int = 1024,
        batch_wait_s: float = 0.02,
        expected_rows: Callable[[], int] = lambda: 0,
        max_lag: int | None = None,
        max_update_failures: int = 5,
        update_backoff_s: float = 0.5,
    ) -> None:
        self.slots = list(slots)
        if batching == "continuous":
            plain = [s.name for s in self.slots if not supports_continuous(s.engine)]
            if plain:
                raise ValueError(f"continuous batching needs engines that batch continuously; {plain} do not")
            if len({id(s.engine) for s in self.slots}) < len(self.slots):  # each slot polls its engine's results
                raise ValueError("continuous batching: two slots share one engine; give each engine one slot")
        self.batching = batching
        self.max_batch_rows = max_batch_rows
        self.batch_wait_s = batch_wait_s
        self.expected_rows = expected_rows
        self.max_lag = max_lag
        self.max_update_failures = max_update_failures
        self.update_backoff_s = update_backoff_s
        self._cv = threading.Condition()
        self._pending: list[_Request] = []  # whole-call batching: one queue for every slot
        self._queues: list[list[_Request]] = [[] for _ in self.slots]  # continuous: per slot
        self._routes: dict[Hashable, int] = {}
        self._load = [0] * len(self.slots)  # continuous: rows queued or running per slot
        self._row_cap = [max_batch_rows] * len(self.slots)  # whole calls: rows a slot's batch may take (`reserve`)
        self._update: Any = None  # the newest published WeightUpdate
        self._stopping = False
        self.fatal: str | None = None
        self.generate_failures = 0
        self._t0 = time.perf_counter()
        loop = self._run_continuous if batching == "continuous" else self._run
        self._threads = [threading.Thread(target=loop, args=(k,), name=f"engine-{s.name}", daemon=True)
                         for k, s in enumerate(self.slots)]
        for t in self._threads:
            t.start()

    @property
    def continuous(self) -> bool:
        return self.batching == "continuous"

    # ------------------------------------------------------------------------------------ worker side

    def run(self, prompts: list[list[int]], keys: list[Any], sampling: SamplingParams,
            timeout_s: float | None = None, *, prefix_len: int = 0, episodes: list[Hashable] | None = None,
            route: Hashable | None = None) -> list[GenerationResult]:
        """One result per prompt (n = 1): the completion and the weight versions that made it. Continuous
        batching: `route` (a group id) keeps a group on one engine, `episodes` (one key per prompt) lets the
        engine keep each episode's KV for its next turn, the first `prefix_len` tokens are a shared prefix.
        Whole-call batching ignores the three."""
        req = _Request([list(p) for p in prompts], list(keys), sampling, time.perf_counter(), prefix_len,
                       list(episodes) if episodes is not None and self.continuous else None)
        with self._cv:
            if self._stopping or self.fatal:
                raise EngineFault(self.fatal or "the engine front is stopped")
            if self.continuous:
                k = self._route(route)
                self._queues[k].append(req)
                self._load[k] += len(req.prompts)
            else:
                self._pending.append(req)
            self._cv.notify_all()
        if not req.done.wait(timeout_s):
            with self._cv:  # by identity: another request may hold equal prompts
                self._pending = [r for r in self._pending if r is not req]
                for k, q in enumerate(self._queues):
                    if any(r is req for r in q):
                        q[:] = [r for r in q if r is not req]
                        self._load[k] -= len(req.prompts)
            req.fail(EngineFault("abandoned"))  # rows still running are dropped when they finish
            raise EngineFault(f"no completion within {timeout_s:g}s (engine busy, hung or dead)")
        if req.error is not None:
            raise EngineFault(f"{type(req.error).__name__}: {req.error}") from req.error
        assert all(r is not None for r in req.results)
        return req.results  # type: ignore[return-value]

    def release(self, route: Hashable | None, episodes: Sequence[Hashable] = ()) -> None:
        """The group `route` ended (its engine may go to another group) and so did `episodes`: their KV is
        dropped (continuous batching; a no-op otherwise)."""
        if not self.continuous:
            return
        with self._cv:
            k = self._routes.pop(route, None) if route is not None else None
        for slot in ([self.slots[k]] if k is not None else self.slots):
            for e in episodes:
                slot.engine.release(e)

    @property
    def sizes_caches(self) -> bool:
        """Does `reserve` size any engine (continuous batching, or a Ray engine actor)?"""
        return self.continuous or any(getattr(s.engine, "reserves_whole_batches", False) for s in self.slots)

    def reserve(self, rows: int, tokens: int, prefix_tokens: int = 0, group_rows: int = 0) -> None:
        """Continuous batching: size every engine's KV cache for its share of `rows` sequences of `tokens` columns
        after a shared prefix of `prefix_tokens` (call before the first request: a cache is not grown while rows
        run) - all of them with one engine; with K engines ceil(rows / K) + `group_rows` (one group over the share:
        groups go to the least loaded engine, so the loads differ by about a group). The static decode step
        computes every slot of its cache, so K engines each sized for every row did K times the decode work (not
        yet measured on a GPU; until 2026-11-30 each continuous engine was sized for all rows); a request over an
        engine's slots waits for one to free.
        Whole-batch engines that ask for it (`reserves_whole_batches`: Ray engine actors batching whole calls) get
        their share of the rows: the static decode step computes every slot, so a cache sized for all rows on each
        of K engines would cost K times the decode work; and a batch such an engine takes is cut at its share, so
        that its cache never grows in the middle of a run (4 x H200, 2026-11-29: the two actors of a 3-GPU run each
        captured a decode graph again, at steps 3 and 7, ~25 s while the other engine and the learner waited -
        read as a cache grown by a batch over the share, which the front then still allowed)."""
        whole = [s for s in self.slots if not self.continuous and getattr(s.engine, "reserves_whole_batches", False)]
        k_all = len(self.slots)
        for k, slot in enumerate(self.slots):
            if self.continuous:
                share = rows if k_all == 1 else min(rows, -(-rows // k_all) + max(int(group_rows), 0))
                slot.engine.reserve(share, tokens, prefix_tokens)
            elif slot in whole:
                share = -(-rows // len(whole))
                slot.engine.reserve(share, tokens, prefix_tokens)
                with self._cv:
                    self._row_cap[k] = max(1, min(self.max_batch_rows, share))

    def notify(self) -> None:
        """The rollout pool's expected row count changed: re-check whether a batch is ready."""
        with self._cv:
            self._cv.notify_all()

    def _route(self, route: Hashable | None) -> int:
        """The slot of `route` (sticky), or the least loaded one for a new route. Under `_cv`."""
        if route is not None and route in self._routes:
            return self._routes[route]
        k = min(range(len(self.slots)), key=lambda j: self._load[j])
        if route is not None:
            self._routes[route] = k
        return k

    # ----------------------------------------------------------------------------------- learner side

    def publish(self, update: Any) -> None:
        """The learner's new weights (a WeightUpdate); every slot takes them before its next batch (whole-call)
        or decode step (continuous)."""
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
                           sum(s.update_failures for s in self.slots), self.generate_failures,
                           tuple(s.updates for s in self.slots), tuple(s.update_s for s in self.slots))

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            pending, self._pending = self._pending, []
            for q in self._queues:
                pending += q
                q.clear()
            self._cv.notify_all()
        for r in pending:
            r.fail(EngineFault("the engine front stopped"))
        for t in self._threads:
            t.join(timeout_s)

    # ------------------------------------------------------------------------ slot threads: whole calls

    def _ready(self, now: float, cap: int) -> tuple[bool, float]:
        """(take a batch of at most `cap` rows now?, seconds to wait otherwise)."""
        if not self._pending:
            return False, 0.5
        rows = sum(len(r.prompts) for r in self._pending)
        if rows >= min(cap, self.max_batch_rows) or rows >= max(1, self.expected_rows()):
            return True, 0.0
        left = self.batch_wait_s - (now - min(r.t_submit for r in self._pending))
        return left <= 0, max(left, 1e-3)

    def _lagging(self, slot: EngineSlot) -> bool:
        return (self.max_lag is not None and self._update is not None
                and self._update.version - slot.sync.version > self.max_lag)

    def _update_due(self, slot: EngineSlot, now: float) -> bool:
        return self._update is not None and self._update.version > slot.sync.version and now >= slot.retry_at

    def _take(self, k: int) -> list[_Request] | None:
        """Wait until slot k should run a batch (at most its row cap: whole requests, at least one); None when
        stopping."""
        slot = self.slots[k]
        with self._cv:
            while True:
                if self._stopping or self.fatal:
                    return None
                now = time.perf_counter()
                if self._update_due(slot, now):
                    return []  # apply the update first (outside the condition lock)
                if self._lagging(slot):
                    self._cv.wait(max(slot.retry_at - now, 1e-3))
                    continue
                cap = self._row_cap[k]
                ready, wait = self._ready(now, cap)
                if ready:
                    taken, rows = [], 0
                    while self._pending and (not taken or rows + len(self._pending[0].prompts) <= cap):
                        r = self._pending.pop(0)
                        taken.append(r)
                        rows += len(r.prompts)
                    return taken
                self._cv.wait(wait)

    def _run(self, k: int) -> None:
        slot = self.slots[k]
        while True:
            taken = self._take(k)
            if taken is None:
                return
            if not taken:
                self._apply_update(slot)
                continue
            self._generate(slot, taken)

    def _generate(self, slot: EngineSlot, taken: list[_Request]) -> None:
        by_sampling: dict[SamplingParams, list[tuple[_Request, int]]] = {}
        for r in taken:
            for i in range(len(r.prompts)):
                by_sampling.setdefault(r.sampling, []).append((r, i))
        try:
            for sampling, rows in by_sampling.items():
                rows.sort(key=lambda ri: ri[0].keys[ri[1]])
                with slot.lock:
                    version = slot.sync.version
                    t0 = time.perf_counter()
                    with self._context(slot):
                        comps = slot.engine.generate(Batch(items=[r.prompts[i] for r, i in rows]), sampling)
                    slot.busy_s += time.perf_counter() - t0
                if len(comps) != len(rows):
                    raise EngineFault(f"the engine returned {len(comps)} completions for {len(rows)} prompts")
                for (r, i), c in zip(rows, comps):
                    r.results[i] = GenerationResult(-1, c, tag=r.keys[i], weight_versions=[(0, version)])
                slot.batches += 1
                slot.rows += len(rows)
        except Exception as e:  # noqa: BLE001 - every request of the batch fails; the workers drop their groups
            self.generate_failures += 1
            log.warning("%s: generate failed for %d requests (%s: %s)", slot.name, len(taken), type(e).__name__, e)
            for r in taken:
                r.fail(e)
            return
        for r in taken:
            r.done.set()

    # ------------------------------------------------------------------------ slot threads: continuous

    def _run_continuous(self, k: int) -> None:
        """Submit what was routed here, apply due weight updates between decode steps, step, hand back."""
        slot = self.slots[k]
        running: dict[int, tuple[_Request, int]] = {}  # engine handle -> (request, row)
        while True:
            with self._cv:
                while True:
                    now = time.perf_counter()
                    if self._stopping or self.fatal:
                        stopping = True
                        break
                    stopping = False
                    update = self._update_due(slot, now)
                    taken: list[_Request] = []
                    if not self._lagging(slot):  # lagging past η: nothing new starts on these weights
                        taken, self._queues[k] = self._queues[k], []
                    if taken or running or update:
                        break
                    self._cv.wait(max(slot.retry_at - now, 1e-3) if self._update is not None
                                  and self._update.version > slot.sync.version else 0.5)
            if stopping:
                for r, _ in running.values():
                    r.fail(EngineFault(self.fatal or "the engine front stopped"))
                return
            if update:
                self._apply_update(slot)
            for r in taken:
                self._submit(k, r, running)
            if running:
                self._step(k, running)

    def _submit(self, k: int, r: _Request, running: dict[int, tuple[_Request, int]]) -> None:
        slot = self.slots[k]
        if r.done.is_set():  # abandoned (timed out) while queued
            self._unload(k, len(r.prompts))
            return
        submitted = 0
        try:
            for i, prompt in enumerate(r.prompts):
                p = r.prefix_len if 0 < r.prefix_len < len(prompt) else 0
                h = slot.engine.submit(GenerationRequest(prompt, r.sampling, prefix_len=p, tag=r.keys[i],
                                                         episode=r.episodes[i] if r.episodes else None))
                running[h] = (r, i)
                submitted += 1
        except Exception as e:  # noqa: BLE001 - a bad request (e.g. longer than a slot): its group fails
            log.warning("%s: a request was refused (%s: %s)", slot.name, type(e).__name__, e)
            r.fail(e)
            self._unload(k, len(r.prompts) - submitted)  # the rows submitted come back (and are dropped)

    def _step(self, k: int, running: dict[int, tuple[_Request, int]]) -> None:
        slot = self.slots[k]
        slot.rows += len(running)  # stats: rows per decode step (the running batch), as whole calls count theirs
        try:
            with slot.lock:  # a learner sharing these parameters changes them between two steps, never during one
                t0 = time.perf_counter()
                with self._context(slot):
                    slot.engine.step()
                slot.busy_s += time.perf_counter() - t0
            slot.batches += 1
        except Exception as e:  # noqa: BLE001 - the engine ended every running request with an error result
            self.generate_failures += 1
            log.warning("%s: decode step failed (%s: %s); its requests fail", slot.name, type(e).__name__, e)
        for res in slot.engine.poll():
            got = running.pop(res.handle, None)
            if got is None:
                continue
            r, i = got
            self._unload(k, 1)
            if res.error:
                r.fail(EngineFault(res.error))
            elif not r.done.is_set():
                r.results[i] = res
                if all(x is not None for x in r.results):
                    r.done.set()

    def _unload(self, k: int, rows: int) -> None:
        with self._cv:
            self._load[k] -= rows

    # ------------------------------------------------------------------------------------------- both

    @staticmethod
    def _context(slot: EngineSlot) -> Any:
        import contextlib

        return slot.gen_context() if slot.gen_context is not None else contextlib.nullcontext()

    def _apply_update(self, slot: EngineSlot) -> None:
        update = self._update
        old = slot.sync.version
        try:
            # in the generate calls' context (autocast): an engine recomputing KV it keeps computes it as they do
            with slot.lock, self._context(slot):
                t0 = time.perf_counter()
                slot.sync.apply(update)
                slot.update_s += time.perf_counter() - t0
            slot.updates += 1
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
            for q in self._queues:
                pending += q
                q.clear()
        for r in pending:
            r.fail(err)


def supports_continuous(engine: Any) -> bool:
    """The engine batches continuously (submit / step / poll / release: `Capabilities.continuous_batching`)."""
    caps = getattr(engine, "capabilities", None)
    return bool(getattr(caps, "continuous_batching", False)) and callable(getattr(engine, "submit", None))
