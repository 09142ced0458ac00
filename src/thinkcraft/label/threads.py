"""CPU threads for torch that degrade gracefully on a shared machine.

torch's default is one intra-op thread per core. Its OpenMP parallel regions end in a barrier, so when
another process keeps a core busy, every op waits for the thread that was descheduled: on the 2-core
dev machine, labelling with the bundled model beside one busy-loop process ran ~9x slower with 2
threads than with 1 (issue 22; bench/label.py --busy measures it). The rule here:

    threads = cores this process may use (os.sched_getaffinity) - cores other processes keep busy now

at least 1. "Busy now" is the number of runnable tasks in /proc/loadavg (an instantaneous count, not
the 1-minute average), minus this thread, sampled a few times between batches (when our own workers
are idle), so the choice follows the load as it changes during a run. `--threads N` fixes it instead.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_LOADAVG = Path("/proc/loadavg")


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def busy_cpus(samples: int = 3, interval_s: float = 0.01) -> int:
    """Cores other processes keep busy right now (median of a few reads; 0 where /proc is missing)."""
    counts = []
    for i in range(samples):
        try:
            running = int(_LOADAVG.read_text().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0
        counts.append(max(0, running - 1))  # the reader itself is running
        if i + 1 < samples:
            time.sleep(interval_s)
    return sorted(counts)[len(counts) // 2]


def auto_threads(cpus: int | None = None, busy: int | None = None) -> int:
    """The rule of the module docstring (arguments for tests; default: measured now)."""
    cpus = usable_cpus() if cpus is None else cpus
    busy = busy_cpus() if busy is None else busy
    return max(1, cpus - busy)


class ThreadPolicy:
    """`apply()` before each batch: sets torch's intra-op threads (fixed, or re-chosen from the load)."""

    def __init__(self, requested: int = 0) -> None:
        self.requested = requested
        """0 = auto (see the module docstring); N >= 1 = exactly N."""
        self.history: list[int] = []
        """Thread counts chosen, one per `apply` (the report shows their range)."""

    def apply(self) -> int:
        import torch

        n = self.requested if self.requested > 0 else auto_threads()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self.history.append(n)
        return n

    def summary(self) -> str:
        if not self.history:
            return ""
        lo, hi = min(self.history), max(self.history)
        mode = "fixed" if self.requested > 0 else "auto"
        return f"{lo}" + (f"-{hi}" if hi != lo else "") + f" ({mode}, {usable_cpus()} usable cores)"
