"""The local backend of the pool contract: worker threads between two bounded queues.

    pool = LocalPool("rollout", handler, num_workers=8, max_queued=16, max_done=64)
    pool.submit(item)            # blocks while 16 items wait (backpressure)
    results = pool.poll(32, 1.0) # results or Failure values, in completion order
    pool.stop(drain=False)

`handler(item, ctx) -> result` runs in a worker thread (with `max_batch > 1`: `handler(items, ctx) -> results`,
one call for up to `max_batch` items that were waiting together, e.g. one judge call for many groups).
It fails its item(s) by raising `WorkFailed(reason)`; any other exception is a worker crash: the item
fails with reason "worker_crashed" and the thread is replaced (counted in `restarts`), so one bad item
never takes the pool down. Workers block when the
output queue is full, so a consumer that stops polling throttles the pool instead of growing memory.

Isolation beyond threads (an env that may hang or crash the interpreter) is the handler's concern: the
rollout handler runs its env in a child process (pools/envproc.py) and reports a hang as WorkFailed.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any, Callable, Generic, TypeVar

from thinkcraft.pools.contract import Failure, PoolHealth, PoolStopped

log = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")


class WorkFailed(Exception):
    """Raised by a handler: the item is dropped and counted under `reason`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class WorkerContext:
    """What a handler may consult: whether the pool is stopping (to abandon a long item early)."""

    def __init__(self, stopping: threading.Event, worker_index: int) -> None:
        self._stopping = stopping
        self.worker_index = worker_index

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()


_STOP = object()


class LocalPool(Generic[In, Out]):
    def __init__(
        self,
        name: str,
        handler: Callable[[In, WorkerContext], Out],
        num_workers: int,
        max_queued: int,
        max_done: int = 1024,
        on_start: Callable[[In], None] | None = None,
        on_end: Callable[[In], None] | None = None,
        max_batch: int = 1,
    ) -> None:
        if num_workers < 1 or max_queued < 1 or max_done < 1:
            raise ValueError("num_workers, max_queued and max_done must be >= 1")
        self.name = name
        self.handler = handler
        self.num_workers = num_workers
        self._in: queue.Queue = queue.Queue(maxsize=max_queued)
        self._done: queue.Queue = queue.Queue(maxsize=max_done)
        self._on_start = on_start
        self._on_end = on_end
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._abandon = threading.Event()
        self._threads: dict[int, threading.Thread] = {}
        self._running = 0
        self._completed = 0
        self._failed: collections.Counter[str] = collections.Counter()
        self._restarts = 0
        self._busy_s = 0.0
        self._busy_since: dict[int, float] = {}
        self._t0 = time.perf_counter()
        for i in range(num_workers):
            self._spawn(i)

    # ----------------------------------------------------------------------------------------- contract

    def submit(self, item: In, timeout_s: float | None = None) -> bool:
        if self._stopping.is_set():
            raise PoolStopped(f"pool {self.name} is stopped")
        try:
            self._in.put(item, timeout=timeout_s)
        except queue.Full:
            return False
        return True

    def poll(self, max_items: int = 64, timeout_s: float = 0.0) -> list[Any]:
        out: list[Any] = []
        try:
            out.append(self._done.get(timeout=timeout_s) if timeout_s > 0 else self._done.get_nowait())
        except queue.Empty:
            return out
        while len(out) < max_items:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        return out

    def health(self) -> PoolHealth:
        now = time.perf_counter()
        with self._lock:
            busy = self._busy_s + sum(now - t for t in self._busy_since.values())
            return PoolHealth(
                name=self.name, workers=sum(t.is_alive() for t in self._threads.values()), queued=self._in.qsize(),
                running=self._running, done=self._done.qsize(), completed=self._completed,
                failed=dict(self._failed), restarts=self._restarts, busy_s=busy, wall_s=now - self._t0,
            )

    def stop(self, drain: bool = False, timeout_s: float = 30.0) -> None:
        if not drain:
            self._abandon.set()
        self._stopping.set()
        for _ in self._threads:
            self._put_sentinel()
        deadline = time.perf_counter() + timeout_s
        for t in list(self._threads.values()):
            t.join(max(0.0, deadline - time.perf_counter()))
        # items never taken by a worker: reported, not silently lost
        while True:
            try:
                item = self._in.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                self._emit(Failure(item, "stopped", "never started"))

    # ------------------------------------------------------------------------------------------ workers

    def _put_sentinel(self) -> None:
        try:
            self._in.put_nowait(_STOP)
        except queue.Full:  # a full queue: the workers see `_stopping` after their current item
            pass

    def _spawn(self, index: int) -> None:
        t = threading.Thread(target=self._work, args=(index,), name=f"{self.name}-{index}", daemon=True)
        self._threads[index] = t
        t.start()

    def _take(self) -> Any:
        while True:
            if self._abandon.is_set():
                return _STOP
            try:
                return self._in.get(timeout=0.1)
            except queue.Empty:
                if self._stopping.is_set():
                    return _STOP

    def _take_more(self, first: Any) -> list[Any]:
        items = [first]
        while len(items) < self.max_batch:
            try:
                more = self._in.get_nowait()
            except queue.Empty:
                break
            if more is _STOP:
                self._put_sentinel()
                break
            items.append(more)
        return items

    def _work(self, index: int) -> None:
        ctx = WorkerContext(self._abandon, index)
        while True:
            first = self._take()
            if first is _STOP:
                return
            items = self._take_more(first)
            if self._abandon.is_set():
                for item in items:
                    self._emit(Failure(item, "stopped", "abandoned at stop"))
                continue
            with self._lock:
                self._running += len(items)
                self._busy_since[index] = time.perf_counter()
            crashed = False
            try:
                if self._on_start is not None:
                    for item in items:
                        self._on_start(item)
                results: list[Any] = (list(self.handler(items, ctx)) if self.max_batch > 1  # type: ignore[arg-type]
                                      else [self.handler(first, ctx)])
                if len(results) != len(items):
                    raise RuntimeError(f"handler returned {len(results)} results for {len(items)} items")
            except WorkFailed as e:
                results = [Failure(item, e.reason, e.detail) for item in items]
            except Exception as e:  # noqa: BLE001 - a crashing handler loses its items, never the pool
                log.exception("pool %s: worker %d crashed", self.name, index)
                results = [Failure(item, "worker_crashed", f"{type(e).__name__}: {e}") for item in items]
                crashed = True
            finally:
                if self._on_end is not None:
                    for item in items:
                        self._on_end(item)
                with self._lock:
                    self._running -= len(items)
                    self._busy_s += time.perf_counter() - self._busy_since.pop(index)
            if crashed:  # a fresh thread takes over (before the results go out: health() then counts it)
                with self._lock:
                    self._restarts += 1
                self._spawn(index)
            for item, result in zip(items, results):
                if isinstance(result, Failure) and self._abandon.is_set():
                    result = Failure(item, "stopped", result.detail)
                self._emit(result)
            if crashed:
                return

    def _emit(self, result: Any) -> None:
        with self._lock:
            if isinstance(result, Failure):
                self._failed[str(result.reason)] += 1
            else:
                self._completed += 1
        while True:
            try:
                self._done.put(result, timeout=0.1)
                return
            except queue.Full:  # backpressure from the consumer; a stopping pool drops results
                if self._abandon.is_set():
                    return
