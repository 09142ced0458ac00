"""A stall watchdog: when a loop has made no progress for a while, every thread's Python stack is written to a
file and a warning says where - so that a run that seems to hang shows where it waits (a lock, a device call, a
compile), without stopping it (a slow first step that compiles is not a hang)."""

from __future__ import annotations

import faulthandler
import logging
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


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
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            log.warning("no %s for %.1f s: every thread's stack written to %s (a slow start - compiles - can do "
                        "this; a hang shows where it waits)", self.what, idle, self.path)
