"""Bounded retries with exponential backoff and jitter, and which HTTP failures are worth retrying.

What is retried — only what can succeed on a second try:
- 429 Too Many Requests (rate limit: it clears), 502/503/504 (gateway down, overloaded, gateway
  timeout: transient by definition), 408 Request Timeout (the server timed out waiting for us);
- timeouts and connection errors (httpx `TimeoutException`, `NetworkError`, `RemoteProtocolError`);
- 500 only when the server itself says a retry may help (`Retry-After` or `x-should-retry: true`): a
  plain 500 is an internal error, for the same request almost always the same error again, and
  retrying it only multiplies the load and the wait before the caller sees it.
Never retried: every other 4xx (400 bad request, 401/403 key, 404, 409, 422 ...) and 501/505.
`x-should-retry: false` (sent by OpenAI- and Anthropic-style APIs, e.g. a 429 for an exhausted quota)
always wins: nothing more is tried.

Waits: the server's `Retry-After` (seconds or an HTTP date) or `retry-after-ms` when given (capped at
`RetryPolicy.max_delay_s`), else exponential backoff with jitter.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, Awaitable, Callable, Mapping, TypeVar

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
    """Cap on any one wait, a server's Retry-After included."""
    jitter: float = 0.25
    """Relative random jitter so that many clients do not retry in lockstep."""

    def delay_s(self, attempt: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        if retry_after_s is not None:
            return min(max(retry_after_s, 0.0), self.max_delay_s)
        d = min(self.base_delay_s * (2 ** (attempt - 1)), self.max_delay_s)
        return d * (1.0 + self.jitter * (2 * random.random() - 1))


async def retry_async(
    fn: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    retryable: Callable[[BaseException], bool],
    what: str = "call",
    retry_after: Callable[[BaseException], float | None] = lambda e: None,
) -> T:
    """`await fn()` until it succeeds, at most `policy.max_attempts` times. A non-retryable error is
    raised as it is at once; a retryable one that outlasts the attempts is raised as `RetryError`."""
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return await fn()
        except Exception as e:  # noqa: BLE001 - filtered by `retryable`
            if not retryable(e):
                raise
            if attempt == policy.max_attempts:
                raise RetryError(f"{what} failed after {attempt} attempts: {e}") from e
            await asyncio.sleep(policy.delay_s(attempt, retry_after(e)))
    raise AssertionError("unreachable")  # pragma: no cover


# --- HTTP classification shared by every client (engines, label providers) -------------------------

RETRYABLE_STATUS = frozenset({408, 429, 502, 503, 504})
"""Statuses retried without the server's say-so (500 needs Retry-After or x-should-retry: true)."""


class HTTPStatusError(RuntimeError):
    """A non-2xx answer, with what retry logic needs. Raised by thinkcraft's HTTP clients."""

    def __init__(
        self, status: int, body: str = "", retry_after_s: float | None = None, url: str = "",
        should_retry: bool | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.retry_after_s = retry_after_s
        self.url = url
        self.should_retry = should_retry
        """The server's `x-should-retry` header (None when absent)."""
        super().__init__(f"HTTP {status} from {url}: {body[:300]}")


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """`Retry-After` in seconds: delta-seconds, or an HTTP date (RFC 9110 §10.2.3); None if unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def retry_after_from(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait from `retry-after-ms` (OpenAI's finer form) or `Retry-After`."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    return parse_retry_after(headers.get("retry-after"))


def is_retryable_status(e: HTTPStatusError) -> bool:
    if e.should_retry is False:
        return False
    if e.status == 500:
        return e.should_retry is True or e.retry_after_s is not None
    return e.status in RETRYABLE_STATUS


def is_retryable_http(e: BaseException) -> bool:
    """True for what can succeed on retry (see the module docstring); never for another 4xx."""
    if isinstance(e, HTTPStatusError):
        return is_retryable_status(e)
    try:
        import httpx
    except ImportError:  # pragma: no cover
        return False
    return isinstance(e, (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError))


def retry_after_of(e: BaseException) -> float | None:
    return e.retry_after_s if isinstance(e, HTTPStatusError) else None


def status_error(response: Any, url: str) -> HTTPStatusError:
    """The HTTPStatusError of an httpx response (status, text, Retry-After and x-should-retry read)."""
    flag = (response.headers.get("x-should-retry") or "").strip().lower()
    return HTTPStatusError(response.status_code, response.text, retry_after_from(response.headers), url,
                           {"true": True, "false": False}.get(flag))
