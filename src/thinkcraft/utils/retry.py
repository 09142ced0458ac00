"""Bounded retries with exponential backoff and jitter, for engine and provider calls."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


class RetryError(RuntimeError):
    """Raised when every attempt failed; `__cause__` is the last error."""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4
    """Attempts in all (1 = no retry)."""
    base_delay_s: float = 0.5
    """Delay before the 2nd attempt; doubles each time."""
    max_delay_s: float = 20.0
    jitter: float = 0.25
    """Relative random jitter so that many clients do not retry in lockstep."""

    def delay_s(self, attempt: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        if retry_after_s is not None:
            return min(max(retry_after_s, 0.0), self.max_delay_s)
        d = min(self.base_delay_s * (2 ** (attempt - 1)), self.max_delay_s)
        return d * (1.0 + self.jitter * (2 * random.random() - 1))


def retry_call(
    fn: Callable[[], T],
    policy: RetryPolicy,
    retryable: Callable[[BaseException], bool],
    what: str = "call",
    retry_after: Callable[[BaseException], float | None] = lambda e: None,
) -> T:
    last: BaseException | None = None
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 - filtered by `retryable`
            if not retryable(e) or attempt == policy.max_attempts:
                if retryable(e):
                    raise RetryError(f"{what} failed after {attempt} attempts: {e}") from e
                raise
            last = e
            time.sleep(policy.delay_s(attempt, retry_after(e)))
    raise RetryError(f"{what} failed") from last  # pragma: no cover


async def retry_async(
    fn: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    retryable: Callable[[BaseException], bool],
    what: str = "call",
    retry_after: Callable[[BaseException], float | None] = lambda e: None,
) -> T:
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return await fn()
        except BaseException as e:  # noqa: BLE001
            if not retryable(e) or attempt == policy.max_attempts:
                if retryable(e):
                    raise RetryError(f"{what} failed after {attempt} attempts: {e}") from e
                raise
            await asyncio.sleep(policy.delay_s(attempt, retry_after(e)))
    raise AssertionError("unreachable")  # pragma: no cover
