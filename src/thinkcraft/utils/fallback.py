"""A fast path (compiled, CUDA-graphed) that falls back to its eager twin for good, once and with a warning:
a compiler or capture failure never stops generation or training. Used by the hf engine's decode step and
bookkeeping, its hidden-state prefill, and the llm-policy learner's packed forward."""

from __future__ import annotations

import logging
from typing import Any, Callable


class OrEager:
    """`fast` until it first raises, then `eager` for good, with one warning on `logger` ("<what> unavailable
    (<error type>: <error>); running eager" - the benches count these); `on_failure` runs once then.
    `failed` says which one runs."""

    def __init__(self, fast: Callable[..., Any], eager: Callable[..., Any], what: str, logger: logging.Logger,
                 on_failure: Callable[[], Any] | None = None) -> None:
        self.fast, self.eager, self.what, self.logger, self.on_failure = fast, eager, what, logger, on_failure
        self.failed = False

    def __call__(self, *args: Any) -> Any:
        if not self.failed:
            try:
                return self.fast(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: eager is always correct
                self.failed = True
                if self.on_failure is not None:
                    self.on_failure()
                self.logger.warning("%s unavailable (%s: %s); running eager", self.what, type(e).__name__, e)
        return self.eager(*args)



def compiled_or_eager(fn: Callable[..., Any], what: str, logger: logging.Logger, dynamic: bool = False
                      ) -> Callable[..., Any]:
    """`fn` through torch.compile (no CUDA graphs), eager after a failure (`OrEager`: "compiled <what>")."""
    import torch

    return OrEager(torch.compile(fn, dynamic=dynamic), fn, f"compiled {what}", logger)
