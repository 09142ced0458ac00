"""SIGTERM is Ctrl-C: the one place long commands turn SIGINT and SIGTERM into a stop request.

Cluster schedulers (Slurm, Kubernetes) preempt a job with SIGTERM and kill it some seconds later; a
person presses Ctrl-C. Both should end a long command the same way: finish the chunk in flight, save,
print how to continue, exit 0. A second signal aborts at once (the previous checkpoint stays valid).

Two forms, for the two shapes of loop we have:

- `StopRequest` (a context manager) for loops that check a flag between chunks (the training shell,
  `collect`): the first signal sets `requested`, a second raises KeyboardInterrupt.
- `sigterm_as_interrupt(hint)` (a decorator on a command's entry point) for work that is journaled item by
  item deep inside its own loops (`label`, `distill`): SIGTERM raises `Preempted`, a KeyboardInterrupt, so
  the cleanup that Ctrl-C already runs (report, journal) runs for it too; the entry point then prints the
  hint and returns 0.

Handlers are only installed in the main thread (Python delivers signals there; elsewhere this is a no-op)
and the previous handlers are restored on exit.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import Any, Callable, TypeVar

from thinkcraft.utils.progress import console

SIGNALS = (signal.SIGINT, signal.SIGTERM)
F = TypeVar("F", bound=Callable[..., Any])


def signal_name(signum: int) -> str:
    return {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}.get(signum, signal.Signals(signum).name)


class Preempted(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM under `sigterm_as_interrupt`."""


class StopRequest:
    """`with StopRequest("stopping after this chunk ...") as stop: while not stop.requested: ...`

    `signum` is the first signal received (None while none came)."""

    def __init__(self, message: str = "stopping after the chunk in flight") -> None:
        self.message = message
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal_name(self.signum) if self.signum is not None else ""

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # the second signal: abort now
            self._restore()
            raise KeyboardInterrupt
        self.signum = signum
        # a plain write, not rich: the handler runs between two bytecodes of whatever the main thread does,
        # possibly inside rich's own print (a first print importing its emoji table: a re-entrant import fails)
        os.write(2, f"\n{signal_name(signum)}: {self.message}; send it again to abort now\n".encode())

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.getsignal(s)
                signal.signal(s, self._handle)
        return self

    def _restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def __exit__(self, *exc: Any) -> None:
        self._restore()


def sigterm_as_interrupt(hint: str) -> Callable[[F], F]:
    """Decorate a command's entry point: within it SIGTERM raises `Preempted` (a KeyboardInterrupt) in the
    main thread; if that escapes, print "<SIGTERM>: <hint>" and return 0. Ctrl-C is left as it is."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)

            def on_term(signum: int, frame: Any) -> None:
                signal.signal(signal.SIGTERM, previous)  # a second SIGTERM takes the default action
                raise Preempted

            previous = signal.signal(signal.SIGTERM, on_term)
            try:
                return fn(*args, **kwargs)
            except Preempted:
                console.print(f"\n[yellow]SIGTERM: stopped; {hint}[/yellow]", soft_wrap=True)
                return 0
            finally:
                signal.signal(signal.SIGTERM, previous)

        return inner  # type: ignore[return-value]

    return wrap
