"""Progress of long commands: a rich bar on a terminal, plain lines otherwise.

- A value not known yet (NaN, e.g. the return before any episode has ended) prints as `–`.
- Rates and durations (`sps`, fields named `*_per_s`, `*_s` or `s_per_*`) are shown smoothed: a
  time-weighted exponential moving average with a 30 s time constant (each value weighs by the wall time
  since the previous one, so the shown rate is close to the rate over the last ~30 s, and one slow chunk —
  a checkpoint, a compile — does not swing it). The metrics files keep the raw values.
- When stderr is not a terminal (CI, `2> log`) there is no bar, one plain line every `log_every_s`, and
  rich does not wrap lines at 80 columns (`soft_wrap`): a log line is one line.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)
console.soft_wrap = not console.is_terminal  # files and pipes get whole lines; a terminal wraps at its width

UNKNOWN = "–"
SMOOTH_TAU_S = 30.0


def is_smoothed(name: str) -> bool:
    """Progress fields shown as a moving average: rates and durations, by their unit in the name."""
    return name == "sps" or name.endswith(("_per_s", "_s")) or name.startswith("s_per_")


class TimeEma:
    """Time-weighted EMA with bias correction: the first value is shown as is, later ones blend in by
    weight 1 - exp(-dt / tau), dt = wall time since the previous value. Non-finite values are skipped."""

    def __init__(self, tau_s: float = SMOOTH_TAU_S, start: float | None = None) -> None:
        self.tau_s = tau_s
        self._num = 0.0
        self._den = 0.0
        self._t = time.monotonic() if start is None else start

    def update(self, x: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if math.isfinite(x):
            decay = math.exp(-max(now - self._t, 0.0) / self.tau_s)
            self._num = decay * self._num + (1 - decay) * x
            self._den = decay * self._den + (1 - decay)
            self._t = now
            if self._den == 0.0:  # two values in the same instant: nothing to weigh by yet
                self._num, self._den = x, 1.0
        return self.value

    @property
    def value(self) -> float:
        return self._num / self._den if self._den > 0 else float("nan")


class RunProgress:
    """`with RunProgress(total_steps, "train") as p: p.update(done_steps, sps=..., ret=...)`."""

    def __init__(self, total: int, description: str, log_every_s: float = 10.0, unit: str = "steps",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.clock = clock
        self.description = description
        self.unit = unit
        self.log_every_s = log_every_s
        self._live = sys.stderr.isatty()
        self._last_log = 0.0
        self._progress: Progress | None = None
        self._task: Any = None
        self._smoothed: dict[str, TimeEma] = {}
        self._start = clock()

    def __enter__(self) -> "RunProgress":
        self._start = self.clock()
        if self._live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(self.description, total=self.total, info="")
        return self

    def info(self, **fields: Any) -> str:
        """The fields as shown: rates/durations smoothed, unknown values as `–`."""
        now = self.clock()
        shown = []
        for k, v in fields.items():
            if is_smoothed(k) and isinstance(v, (int, float)) and not isinstance(v, bool):
                v = self._smoothed.setdefault(k, TimeEma(start=self._start)).update(float(v), now)
            shown.append(f"{k} {fmt_value(v)}")
        return "  ".join(shown)

    def update(self, completed: int, **fields: Any) -> None:
        info = self.info(**fields)
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, info=info)
        else:
            now = time.time()
            if now - self._last_log >= self.log_every_s or completed >= self.total:
                self._last_log = now
                console.print(f"{self.description}: {completed:,}/{self.total:,} {self.unit}  {info}",
                              markup=False, highlight=False)

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)


def fmt_value(v: Any) -> str:
    """A number for a progress or summary line: `–` when unknown (NaN/inf), thousands separators from 100."""
    if isinstance(v, float):
        if not math.isfinite(v):
            return UNKNOWN
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}"
    return str(v)
