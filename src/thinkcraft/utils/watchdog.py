"""A stall watchdog: when a loop has made no progress for a while, every thread's Python stack is written to a
file and a warning says where - so that a run that seems to hang shows where it waits (a lock, a device call, a
compile), without stopping it (a slow first step that compiles is not a hang)."""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def thread_stacks(ends: int = 15) -> str:
    """Every thread's name and Python stack, outermost call first. A deep stack (a torch.compile trace runs
    hundreds of frames deep) keeps its `ends` outermost and innermost frames: faulthandler's dump keeps only the
    innermost 100, which hid which of our threads was compiling (2026-11-27)."""
    names = {t.ident: f"{t.name}{' (daemon)' if t.daemon else ''}" for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        frames = traceback.format_stack(frame)
        if len(frames) > 2 * ends:
            frames = frames[:ends] + [f"  ... {len(frames) - 2 * ends} frames ...\n"] + frames[-ends:]
        out.append(f"Thread {names.get(ident, '?')} ({ident}), most recent call last:\n{''.join(frames)}")
    return "\n".join(out)


def dump_stacks_later(after_s: float, file: Any = None) -> threading.Timer:
    """`thread_stacks()` into `file` (stderr) after `after_s` seconds, once (a daemon timer); faulthandler's dump
    5 s later as the backstop for a process whose GIL is held by native code (the timer thread cannot run then)."""
    def dump() -> None:
        f = file or sys.stderr
        f.write(f"\n=== every thread's stack at {after_s:.0f} s ({time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        f.write(thread_stacks())
        f.flush()

    timer = threading.Timer(after_s, dump)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(after_s + 5.0, repeat=False, file=file or sys.stderr)
    return timer


class StallWatchdog:
    """`with StallWatchdog(after_s, path, what) as wd:` ... `wd.beat()` at every unit of progress. After `after_s`
    seconds without a beat, all threads' stacks are appended to `path` once (and again after `after_s` more
    seconds of the same stall); `stalls` counts the dumps. `after_s` 0: off."""

    def __init__(self, after_s: float, path: str | Path, what: str) -> None:
        self.after_s = float(after_s)
        self.path = Path(path)
        self.what = what
        self.stalls = 0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self._last = time.monotonic()

    def __enter__(self) -> StallWatchdog:
        if self.after_s > 0:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        dumped_at = None  # when the stall under way was last dumped: one dump per after_s of it
        while not self._stop.wait(min(self.after_s / 4, 5.0)):
            now = time.monotonic()
            idle = now - self._last
            if idle < self.after_s:
                dumped_at = None
                continue
            if dumped_at is not None and now - dumped_at < self.after_s:
                continue
            dumped_at = now
            self.stalls += 1
            with open(self.path, "a") as f:
                f.write(f"\n=== no {self.what} for {idle:.1f} s ({time.strftime('%Y-%m-%d %H:%M:%S')}): "
                        "every thread's stack\n")
                f.write(thread_stacks())
            log.warning("no %s for %.1f s: every thread's stack written to %s (a slow start - compiles - can do "
                        "this; a hang shows where it waits)", self.what, idle, self.path)


class GilProbe:
    """How long this process's Python threads could not run: a daemon thread sleeps `interval_s` in a loop and
    measures how late it wakes. A wake later than `warn_s` means the interpreter lock was held that long by
    native code that does not release it (or the process was not scheduled) - no Python thread, the stall
    watchdog's included, can run meanwhile. Why: the 2-GPU async runs of 2026-11-27 made no learner step in
    9 minutes while the stall dump's Python timer could not run in 20 s; this says so in the run's metrics and
    log, and a lag of ~0 rules it out. `take_max()` returns the largest lag since the previous call."""

    def __init__(self, interval_s: float = 0.02, warn_s: float = 1.0) -> None:
        # 50 wakes a second: each one may make a busy thread hand over the lock, so not every switch interval
        self.interval_s, self.warn_s = float(interval_s), float(warn_s)
        self.lags_over_warn = 0
        self._max = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

    def start(self) -> GilProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def take_max(self) -> float:
        with self._lock:
            m, self._max = self._max, 0.0
        return m

    def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            if self._stop.wait(self.interval_s):
                return
            lag = max(0.0, time.monotonic() - t0 - self.interval_s)
            with self._lock:
                self._max = max(self._max, lag)
            if lag >= self.warn_s:
                self.lags_over_warn += 1
                log.warning("no Python thread could run for %.1f s (the interpreter lock held by native code, or the "
                            "process not scheduled)", lag)
