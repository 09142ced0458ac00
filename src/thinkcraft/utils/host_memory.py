"""This process's host memory as Linux reports it: resident set, its peak (resettable), and what the machine - or
the memory cgroup the process runs in, where that is tighter - has left. What the learner sizes its micro-batches
by off CUDA (`train/llm_policy/learner.py`): a CPU run has no allocator counters, and a budget that does not fit
is not an exception there but the kernel's OOM killer. Every function returns None where the file it reads is
missing or unreadable (not Linux, a sandbox): the caller then keeps a fixed size."""

from __future__ import annotations

import re
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")  # cgroup v2, the process's own group mounted at the root (containers)


def _kib_field(path: Path, name: str) -> int | None:
    try:
        m = re.search(rf"^{name}:\s+(\d+) kB", path.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def rss_bytes() -> int | None:
    """Resident set size now (VmRSS)."""
    return _kib_field(_STATUS, "VmRSS")


def peak_rss_bytes() -> int | None:
    """The resident set's peak since the process started or since `reset_peak` (VmHWM)."""
    return _kib_field(_STATUS, "VmHWM")


def reset_peak() -> bool:
    """Start the peak over from the present resident set (writing 5 to /proc/self/clear_refs, Linux >= 4.0);
    False where that is not possible."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    peak, now = peak_rss_bytes(), rss_bytes()
    return peak is not None and now is not None


def _cgroup_left() -> int | None:
    """The memory cgroup's limit less its usage, where a limit is set."""
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        used = int((_CGROUP / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(int(limit) - used, 0)


def available_bytes() -> int | None:
    """Memory a new allocation can take without swapping or a kill: the machine's MemAvailable, or the cgroup's
    room where that is smaller."""
    avail = _kib_field(_MEMINFO, "MemAvailable")
    group = _cgroup_left()
    if avail is None:
        return group
    return avail if group is None else min(avail, group)
