"""Rich progress bar with throughput (SPS) and ETA; quiet fallback when not a terminal."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


class RunProgress:
    """`with RunProgress(total_steps, "train") as p: p.update(done_steps, sps=..., extra="...")`.

    When stderr is not a TTY (CI, logs) it prints one line every `log_every_s` seconds instead.
    """

    def __init__(self, total: int, description: str, log_every_s: float = 10.0, unit: str = "steps") -> None:
        self.total = total
        self.description = description
        self.unit = unit
        self.log_every_s = log_every_s
        self._live = sys.stderr.isatty()
        self._last_log = 0.0
        self._progress: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> "RunProgress":
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

    def update(self, completed: int, **fields: Any) -> None:
        info = "  ".join(f"{k} {_fmt(v)}" for k, v in fields.items())
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, info=info)
        else:
            now = time.time()
            if now - self._last_log >= self.log_every_s or completed >= self.total:
                self._last_log = now
                console.print(f"{self.description}: {completed:,}/{self.total:,} {self.unit}  {info}")

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}"
    return str(v)
