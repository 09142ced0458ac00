"""Remote OpenAI-compatible endpoints: per-endpoint limits, weighted sharing, and failure handling.

Each endpoint (from a TOML/JSON file) has its own key, RPM / TPM budget (token buckets: at most one
second's worth in a burst, then the steady rate — we stay under the provider's limits, never around
them), a concurrency cap (that many workers), and a weight. Jobs are dealt to endpoints by smooth
weighted round-robin, so each gets its weight's share of the work; the share of an endpoint that
stops is taken over by the others.

Failures: 401/403 stops that endpoint (its job goes back to the queue for the others); 429 pauses the
whole endpoint for `Retry-After` (or an exponential backoff) and retries; 502/503/504, timeouts and
connection errors are retried with bounded exponential backoff (a plain 500 and other 4xx are not: they
would fail again; see `thinkcraft.utils.retry`), and an endpoint that never answered is stopped as
unreachable. Every event is counted per endpoint for the final report.

Keys: `api_key_env = "VAR"` (an environment variable) or `api_key_file = "path"` (its first line), or
`api_key` inline in the endpoints file.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import httpx

from thinkcraft.utils.errors import ConfigError, UserError
from thinkcraft.utils.apikey import resolve_api_key
from thinkcraft.utils.retry import HTTPStatusError, RetryPolicy, is_retryable_http, status_error

_ENDPOINT_KEYS = {
    "name", "base_url", "model", "api_key", "api_key_env", "api_key_file", "rpm", "tpm", "max_concurrency", "weight",
    "timeout_s", "max_attempts", "api", "extra_body", "cache_control",
}


@dataclass(frozen=True)
class EndpointConfig:
    name: str
    base_url: str
    """e.g. `http://127.0.0.1:8000/v1` (the `/chat/completions` path is appended)."""
    model: str
    api_key: str | None = None
    """Resolved key (from `api_key_env`, `api_key_file`, or given inline); sent as `Authorization: Bearer`."""
    rpm: float | None = None
    """Requests per minute allowed (None = no limit)."""
    tpm: float | None = None
    """Tokens (prompt + max new) per minute allowed (None = no limit)."""
    max_concurrency: int = 4
    weight: float = 1.0
    timeout_s: float = 120.0
    max_attempts: int = 4
    """Attempts per request for 429/5xx/timeouts (bounded)."""
    api: str = "chat"
    """`chat` (/chat/completions, prefix as system message) or `completions` (/completions, prefix+item)."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """Provider-specific request fields, e.g. `{prompt_cache_key = "craftax-v1"}` for OpenAI prompt caching."""
    cache_control: bool = False
    """Mark the shared prefix `cache_control: ephemeral` (Anthropic-style explicit caching, as accepted by
    OpenRouter and Anthropic's OpenAI-compatible API). OpenAI, vLLM and SGLang cache a repeated prefix
    by themselves: the prefix is always sent first, byte-identical, for that reason."""


@dataclass(frozen=True)
class EndpointsFile:
    endpoints: tuple[EndpointConfig, ...]
    model: str
    """Logical model name used in item keys (all endpoints must serve the same model)."""


def load_endpoints(path: str | os.PathLike) -> EndpointsFile:
    """TOML (`[[endpoints]]` tables) or JSON (`{"endpoints": [...]}`); keys come from the environment."""
    p = Path(path)
    if not p.exists():
        raise ConfigError("endpoints", f"{p} does not exist")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix == ".json":
            d = json.loads(text)
        else:
            import tomllib

            d = tomllib.loads(text)
    except Exception as e:  # noqa: BLE001 - parse errors of either format
        raise ConfigError("endpoints", f"{p}: cannot parse: {e}") from None
    raw = d.get("endpoints")
    if not raw:
        raise ConfigError("endpoints", f"{p}: no [[endpoints]] entries")
    eps = []
    for i, e in enumerate(raw):
        where = f"{p} endpoint #{i + 1}"
        unknown = set(e) - _ENDPOINT_KEYS
        if unknown:
            raise ConfigError("endpoints", f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(_ENDPOINT_KEYS)}")
        for req in ("base_url", "model"):
            if req not in e:
                raise ConfigError("endpoints", f"{where}: missing {req!r}")
        try:
            key = resolve_api_key(e.get("api_key"), e.get("api_key_env"), e.get("api_key_file"))
        except UserError as err:
            raise ConfigError("endpoints", f"{where}: {err}") from None
        ep = EndpointConfig(
            name=e.get("name", f"ep{i}"), base_url=e["base_url"].rstrip("/"), model=e["model"], api_key=key,
            rpm=e.get("rpm"), tpm=e.get("tpm"), max_concurrency=int(e.get("max_concurrency", 4)),
            weight=float(e.get("weight", 1.0)), timeout_s=float(e.get("timeout_s", 120.0)),
            max_attempts=int(e.get("max_attempts", 4)), api=e.get("api", "chat"),
            extra_body=dict(e.get("extra_body", {})), cache_control=bool(e.get("cache_control", False)),
        )
        if ep.api not in ("chat", "completions"):
            raise ConfigError("endpoints", f"{where}: api must be 'chat' or 'completions', not {ep.api!r}")
        if ep.max_concurrency < 1 or ep.weight <= 0 or ep.max_attempts < 1:
            raise ConfigError("endpoints", f"{where}: max_concurrency, weight and max_attempts must be positive")
        if (ep.rpm is not None and ep.rpm <= 0) or (ep.tpm is not None and ep.tpm <= 0):
            raise ConfigError("endpoints", f"{where}: rpm/tpm must be positive (leave them out for no limit)")
        eps.append(ep)
    if len({e.name for e in eps}) != len(eps):
        raise ConfigError("endpoints", f"{p}: endpoint names must be unique")
    model = d.get("model")
    if model is None:
        models = {e.model for e in eps}
        if len(models) > 1:
            raise ConfigError("endpoints", f"{p}: endpoints serve different models {sorted(models)}; set a top-level "
                              "model = '<name>' to key their labels as one model")
        model = models.pop()
    return EndpointsFile(tuple(eps), model)


# --- rate limiting -------------------------------------------------------------------------------


class TokenBucket:
    """Refills `rate_per_s`, holds at most `capacity`; a cost larger than the capacity waits for a full
    bucket and then drives it negative (so a huge request still goes, and the debt delays the next)."""

    def __init__(self, rate_per_s: float, capacity: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self.level = capacity
        self.clock = clock
        self._t = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self._t) * self.rate_per_s)
        self._t = now

    def wait_s(self, cost: float) -> float:
        """Seconds until `cost` may be taken (0 = now)."""
        self._refill()
        need = min(cost, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate_per_s

    def take(self, cost: float) -> None:
        self._refill()
        self.level -= cost

    def adjust(self, delta: float) -> None:
        """Charge (or refund) the difference between an estimated and the actual cost."""
        self._refill()
        self.level = min(self.capacity, self.level - delta)


class RateLimiter:
    """RPM and TPM buckets of one endpoint; `await acquire(tokens)` before each request."""

    def __init__(self, rpm: float | None, tpm: float | None) -> None:
        self.requests = TokenBucket(rpm / 60.0, max(1.0, rpm / 60.0)) if rpm else None
        self.tokens = TokenBucket(tpm / 60.0, max(1.0, tpm / 60.0)) if tpm else None
        self._lock = asyncio.Lock()
        self.waited_s = 0.0

    async def acquire(self, est_tokens: float) -> None:
        async with self._lock:  # one waiter at a time: FIFO and no thundering herd
            while True:
                w = max(self.requests.wait_s(1.0) if self.requests else 0.0,
                        self.tokens.wait_s(est_tokens) if self.tokens else 0.0)
                if w <= 0:
                    break
                self.waited_s += w
                await asyncio.sleep(w)
            if self.requests:
                self.requests.take(1.0)
            if self.tokens:
                self.tokens.take(est_tokens)

    def settle(self, est_tokens: float, actual_tokens: float) -> None:
        if self.tokens:
            self.tokens.adjust(actual_tokens - est_tokens)


# --- one request ----------------------------------------------------------------------------------


@dataclass
class Answer:
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    latency_s: float


class EndpointStopped(Exception):
    """This endpoint will take no more work (bad key, unreachable); the job goes to the others."""


class RequestFailed(Exception):
    """Bounded retries exhausted on this endpoint (5xx / timeouts / 429 that did not clear)."""


@dataclass
class EndpointStats:
    requests: int = 0
    ok: int = 0
    items: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    http_429: int = 0
    http_5xx: int = 0
    http_4xx: int = 0
    timeouts: int = 0
    connect_errors: int = 0
    retries: int = 0
    failed_requests: int = 0
    rate_wait_s: float = 0.0
    stopped: str | None = None
    structured: bool | None = None
    """Structured outputs (`response_format`): True = accepted, False = refused (parse and re-ask), None = not asked."""


class Endpoint:
    def __init__(self, cfg: EndpointConfig, client: httpx.AsyncClient, sampling: dict[str, Any]) -> None:
        self.cfg = cfg
        self.client = client
        self.sampling = sampling
        self.limiter = RateLimiter(cfg.rpm, cfg.tpm)
        self.policy = RetryPolicy(max_attempts=cfg.max_attempts, base_delay_s=0.5, max_delay_s=60.0)
        self.stats = EndpointStats()
        self.paused_until = 0.0
        self.ever_answered = False

    @property
    def alive(self) -> bool:
        return self.stats.stopped is None

    def stop(self, reason: str) -> None:
        if self.stats.stopped is None:
            self.stats.stopped = reason

    def _request(self, system: str, user: str, max_tokens: int, response_format: dict[str, Any] | None = None
                 ) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.cfg.model, **self.sampling, "max_tokens": max_tokens,
                                **self.cfg.extra_body}
        if response_format is not None:
            body["response_format"] = response_format
        if self.cfg.api == "chat":
            content: Any = system
            if self.cfg.cache_control:
                content = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
            msgs = ([{"role": "system", "content": content}] if system else []) + [{"role": "user", "content": user}]
            return self.cfg.base_url + "/chat/completions", {**body, "messages": msgs}
        return self.cfg.base_url + "/completions", {**body, "prompt": system + user}

    async def complete(self, system: str, user: str, max_tokens: int, response_format: dict[str, Any] | None = None
                       ) -> Answer:
        """One answer, with this endpoint's limits and bounded retries; raises EndpointStopped/RequestFailed.

        With `response_format` (structured outputs, chat API only): an endpoint that refuses it (HTTP 400/422
        before it ever accepted one) is asked again without it, and from then on never with it: its answers
        are parsed and re-asked instead."""
        if response_format is None or self.cfg.api != "chat" or self.stats.structured is False:
            return await self._complete(system, user, max_tokens, None)
        try:
            ans = await self._complete(system, user, max_tokens, response_format)
        except RequestFailed as e:
            cause = e.__cause__
            refused = isinstance(cause, HTTPStatusError) and cause.status in (400, 422)
            if not refused or self.stats.structured:
                raise
            self.stats.structured = False
            self.stats.failed_requests -= 1  # not a failed item: asked again below
            return await self._complete(system, user, max_tokens, None)
        self.stats.structured = True
        return ans

    async def _complete(self, system: str, user: str, max_tokens: int, response_format: dict[str, Any] | None
                        ) -> Answer:
        url, body = self._request(system, user, max_tokens, response_format)
        # TPM budgets count prompt + requested tokens; ~4 characters per token until usage says better
        est_tokens = (len(system) + len(user)) / 4.0 + max_tokens
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        last: BaseException | None = None
        for attempt in range(1, self.policy.max_attempts + 1):
            if not self.alive:
                raise EndpointStopped(self.stats.stopped)
            # a 429 pauses every worker of this endpoint, not only the one that got it
            pause = self.paused_until - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            t_wait = time.monotonic()
            await self.limiter.acquire(est_tokens)
            self.stats.rate_wait_s += time.monotonic() - t_wait
            self.stats.requests += 1
            t0 = time.monotonic()
            try:
                r = await self.client.post(url, json=body, headers=headers, timeout=self.cfg.timeout_s)
                if r.status_code >= 400:
                    raise status_error(r, url)
                data = r.json()
                ans = _parse_answer(data, self.cfg.api, time.monotonic() - t0)
            except HTTPStatusError as e:
                self.ever_answered = True
                last = e
                if e.status in (401, 403):
                    self.stop(f"HTTP {e.status}: key rejected — check this endpoint's api_key / api_key_env / api_key_file")
                    raise EndpointStopped(self.stats.stopped) from e
                if e.status == 429:
                    self.stats.http_429 += 1
                    delay = self.policy.delay_s(attempt, e.retry_after_s)
                    self.paused_until = max(self.paused_until, time.monotonic() + delay)
                elif e.status >= 500:
                    self.stats.http_5xx += 1
                else:
                    self.stats.http_4xx += 1
                if not is_retryable_http(e):
                    self.stats.failed_requests += 1
                    raise RequestFailed(str(e)) from e
            except (httpx.TimeoutException, asyncio.TimeoutError) as e:
                self.ever_answered = True  # it accepted the connection
                self.stats.timeouts += 1
                last = e
            except (httpx.NetworkError, httpx.RemoteProtocolError) as e:
                self.stats.connect_errors += 1
                last = e
            except (ValueError, KeyError, IndexError, TypeError) as e:  # a 200 with a body we cannot read
                self.ever_answered = True
                self.stats.failed_requests += 1
                raise RequestFailed(f"unreadable response: {e!r}") from e
            else:
                self.ever_answered = True
                self.stats.ok += 1
                self.stats.prompt_tokens += ans.prompt_tokens
                self.stats.completion_tokens += ans.completion_tokens
                self.stats.cached_tokens += ans.cached_tokens
                self.limiter.settle(est_tokens, ans.prompt_tokens + ans.completion_tokens)
                return ans
            if attempt < self.policy.max_attempts:
                self.stats.retries += 1
                if not (isinstance(last, HTTPStatusError) and last.status == 429):
                    await asyncio.sleep(self.policy.delay_s(attempt))
        if not self.ever_answered:
            self.stop(f"unreachable after {self.policy.max_attempts} attempts: {last!r}")
            raise EndpointStopped(self.stats.stopped) from last
        self.stats.failed_requests += 1
        raise RequestFailed(f"{self.cfg.name}: gave up after {self.policy.max_attempts} attempts: {last}") from last


def _parse_answer(data: dict[str, Any], api: str, latency_s: float) -> Answer:
    choice = data["choices"][0]
    text = choice["message"]["content"] if api == "chat" else choice["text"]
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Answer(
        text=text or "",
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        latency_s=latency_s,
    )


# --- scheduling -----------------------------------------------------------------------------------


class JobBoard:
    """Per-endpoint queues dealt by smooth weighted round-robin (nginx's algorithm)."""

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        self.endpoints = list(endpoints)
        self.queues: dict[str, deque[Any]] = {e.cfg.name: deque() for e in endpoints}
        self._current = {e.cfg.name: 0.0 for e in endpoints}
        self.in_flight = 0
        self.changed = asyncio.Event()

    def _pick(self) -> str:
        alive = [e for e in self.endpoints if e.alive] or self.endpoints
        total = sum(e.cfg.weight for e in alive)
        for e in alive:
            self._current[e.cfg.name] += e.cfg.weight
        best = max(alive, key=lambda e: self._current[e.cfg.name])
        self._current[best.cfg.name] -= total
        return best.cfg.name

    def put(self, job: Any, front: bool = False) -> None:
        q = self.queues[self._pick()]
        q.appendleft(job) if front else q.append(job)
        self.changed.set()

    def take(self, ep: Endpoint) -> Any | None:
        own = self.queues[ep.cfg.name]
        if own:
            return own.popleft()
        # weights fix each endpoint's share; only a stopped endpoint's share moves to the others
        for e in self.endpoints:
            q = self.queues[e.cfg.name]
            if q and not e.alive:
                return q.pop()
        return None

    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())


async def serve_jobs(
    endpoints: Sequence[Endpoint],
    board: JobBoard,
    handle: Callable[[Endpoint, Any], Awaitable[None]],
) -> None:
    """Run every job on the board (handlers may add more) until none is left or no endpoint is alive.

    `handle(endpoint, job)` does one job; it raises EndpointStopped to hand the job back to the board."""

    async def worker(ep: Endpoint) -> None:
        while ep.alive:
            job = board.take(ep)
            if job is None:
                if board.in_flight == 0 and board.pending() == 0:
                    board.changed.set()  # wake the others so they can exit too
                    return
                board.changed.clear()
                await board.changed.wait()
                continue
            board.in_flight += 1
            try:
                await handle(ep, job)
            except EndpointStopped:
                board.put(job, front=True)
            finally:
                board.in_flight -= 1
                board.changed.set()
        board.changed.set()

    tasks = [asyncio.create_task(worker(ep)) for ep in endpoints for _ in range(ep.cfg.max_concurrency)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


def all_stopped_error(endpoints: Sequence[Endpoint], remaining: int) -> UserError:
    why = "; ".join(f"{e.cfg.name}: {e.stats.stopped}" for e in endpoints)
    return UserError(f"every endpoint stopped with {remaining} items left ({why}); finished items are saved, "
                     "fix the endpoints and re-run to label the rest")
