"""A fast path (compiled, CUDA-graphed) that falls back to its eager twin for good, once and with a warning:
a compiler or capture failure never stops generation or training. Used by the hf engine's decode step and
bookkeeping, its hidden-state prefill, and the llm-policy learner's packed forward."""

from __future__ import annotations

import logging
from typing import Any, Callable


def or_eager(fast: Callable[..., Any], eager: Callable[..., Any], what: str, logger: logging.Logger,
             on_failure: Callable[[], Any] | None = None) -> Callable[..., Any]:
    """`fast` until it first raises, then `eager` for good, with one warning on `logger` ("<what> unavailable
    (<error type>: <error>); running eager" - the benches count these); `on_failure` runs once then."""
    failed = False

    def call(*args: Any) -> Any:
        nonlocal failed
        if not failed:
            try:
                return fast(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: eager is always correct
                failed = True
                if on_failure is not None:
                    on_failure()
                logger.warning("%s unavailable (%s: %s); running eager", what, type(e).__name__, e)
        return eager(*args)

    return call


def compiled_or_eager(fn: Callable[..., Any], what: str, logger: logging.Logger, dynamic: bool = False
                      ) -> Callable[..., Any]:
    """`fn` through torch.compile (no CUDA graphs), eager after a failure (`or_eager`: "compiled <what>")."""
    import torch

    return or_eager(torch.compile(fn, dynamic=dynamic), fn, f"compiled {what}", logger)
