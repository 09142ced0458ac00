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


# --- HTTP classification shared by every client (engines, label providers) -------------------------

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class HTTPStatusError(RuntimeError):
    """A non-2xx answer, with what retry logic needs. Raised by thinkcraft's HTTP clients."""

    def __init__(self, status: int, body: str = "", retry_after_s: float | None = None, url: str = "") -> None:
        self.status = status
        self.body = body
        self.retry_after_s = retry_after_s
        self.url = url
        super().__init__(f"HTTP {status} from {url}: {body[:300]}")


def parse_retry_after(value: str | None) -> float | None:
    """`Retry-After` header in seconds (numeric form; HTTP-date form is rare for APIs and ignored)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def is_retryable_http(e: BaseException) -> bool:
    """Timeouts, connection errors, 429 and 5xx are retried; 4xx (bad request, 401 bad key) are not."""
    if isinstance(e, HTTPStatusError):
        return e.status in RETRYABLE_STATUS
    try:
        import httpx
    except ImportError:  # pragma: no cover
        return False
    return isinstance(e, (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError))


def retry_after_of(e: BaseException) -> float | None:
    return e.retry_after_s if isinstance(e, HTTPStatusError) else None
