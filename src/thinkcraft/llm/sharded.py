"""`ShardedEngine`: one hidden-state engine made of K engines (e.g. in-process hf engines on cuda:1..K).

    eng = ShardedEngine([lambda d=d: make_engine("hf:/m", device=d) for d in ("cuda:1", "cuda:2")],
                        gather_device="cuda:0", timeout_s=300, retries=2)
    h = eng.hidden_states_torch(batch)       # (N, H) on cuda:0, rows in the batch's order

Each call splits the batch's items into K contiguous shards (sizes differ by at most one), runs shard k on
engine k in its own thread, and concatenates the K results in shard order on `gather_device`: row i of the
result is item i's, whatever engine computed it. The shared prefix goes to every engine (each caches its
own prefix KV). This is ppo-hidden's `--feature-devices` (DESIGN "Scale-out": the refresh's texts sharded
over engines on other GPUs, gathered in order); it works unchanged under `--overlap` (the schedule's worker
thread makes the call).

Timing: `shard_s[k]` is engine k's seconds inside its shard calls (its device synchronised at the end, so
its GPU work is in it), `call_s` the calls' wall seconds, `calls` their count, and `recent` the last calls one
by one (wall seconds, each engine's seconds): a median over them leaves out the first calls' compiles, which
dominate a short run's totals (2026-11-28: a 5-update ppo-hidden run's mean refresh read 535 ms against a
steady ~240 ms). A refresh that does not get
faster with more engines shows each shard taking as long as the whole batch on one engine (host-bound
shards take turns on the interpreter lock: their wall times all stretch alike).

Faults: a shard whose engine raises, or does not answer within `timeout_s`, is given to a new engine built
by the same factory (the old one is closed, or abandoned if it hangs: its thread is a daemon), and retried,
at most `retries` times per call; then the call raises `EngineError` naming the device and the cause. A run
therefore never hangs on a dead engine: the longest a call can take is (retries + 1) x timeout_s per shard.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Literal, Sequence

import numpy as np

from thinkcraft.llm.protocol import Batch, Capabilities, Completion, EngineCapabilityError, EngineError, SamplingParams

log = logging.getLogger(__name__)


def shard_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """[start, stop) of k contiguous shards of n items, sizes n // k or n // k + 1, larger ones first
    (numpy.array_split's rule); empty shards when n < k."""
    q, r = divmod(n, k)
    bounds, start = [], 0
    for i in range(k):
        stop = start + q + (i < r)
        bounds.append((start, stop))
        start = stop
    return bounds


class _Call:
    """One shard's call in a daemon thread: `wait(timeout)` -> ("ok", value) | ("error", exc) | ("timeout", None)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._out: tuple[str, Any] = ("timeout", None)
        self._done = threading.Event()

        def target() -> None:
            try:
                self._out = ("ok", fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._out = ("error", e)
            self._done.set()

        threading.Thread(target=target, daemon=True, name="sharded-engine-call").start()

    def wait(self, timeout_s: float) -> tuple[str, Any]:
        return self._out if self._done.wait(timeout_s) else ("timeout", None)


class ShardedEngine:
    """K engines behind one Engine for hidden states (module doc). `factories[k]()` builds engine k (again
    after a fault); the engines must share a model (same tokenizer and hidden size: checked at start)."""

    def __init__(self, factories: Sequence[Callable[[], Any]], gather_device: Any = None, timeout_s: float = 600.0,
                 retries: int = 2, names: Sequence[str] | None = None) -> None:
        if not factories:
            raise ValueError("ShardedEngine needs at least one engine factory")
        self.factories = list(factories)
        self.names = list(names) if names is not None else [f"engine {k}" for k in range(len(factories))]
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.restarts = 0
        """Engines replaced after a fault since the start (a metric for the caller)."""
        self.calls, self.call_s = 0, 0.0
        self.shard_s = [0.0] * len(factories)
        """Seconds each engine spent in its shards (module doc, "Timing")."""
        self.recent: collections.deque[tuple[float, tuple[float, ...]]] = collections.deque(maxlen=1024)
        """The last calls: (wall seconds, seconds of each engine in it, 0 for an engine without a shard)."""
        self.engines = [f() for f in self.factories]
        caps = [e.capabilities for e in self.engines]
        if not all(c.hidden_states for c in caps):
            raise EngineCapabilityError("every engine of a ShardedEngine must return hidden states")
        sizes = {c.hidden_size for c in caps}
        if len(sizes) != 1:
            raise EngineCapabilityError(f"the sharded engines disagree on the hidden size: {sorted(map(str, sizes))}")
        self._caps = caps[0]
        self.gather_device = gather_device
        self.tokenizer = getattr(self.engines[0], "tokenizer", None) if self._caps.tokenizer else None
        self.on_close: list[Callable[[], None]] = []
        """Called after the engines are closed (e.g. stopping a Ray that was started for them)."""

    @property
    def capabilities(self) -> Capabilities:
        c = self._caps
        device = str(self.gather_device) if self.gather_device is not None and c.device_tensors else c.device
        return Capabilities(hidden_states=True, generate=False, logprobs=False, prefix_reuse=c.prefix_reuse,
                            hidden_size=c.hidden_size, num_layers=c.num_layers, token_ids_in=c.token_ids_in,
                            tokenizer=c.tokenizer, device_tensors=c.device_tensors, device=device)

    # --- the tokenizer (engine 0's; every engine has the same) ---------------------------------------

    def tokenize_batch(self, batch: Batch) -> tuple[list[int], list[list[int]]]:
        return self.engines[0].tokenize_batch(batch)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.engines[0].apply_chat_template(*args, **kwargs)

    # --- hidden states ------------------------------------------------------------------------------

    def hidden_states_torch(self, batch: Batch, layer: int = -1, pooling: Literal["last", "mean"] = "last") -> Any:
        """(N, H) torch tensor on `gather_device` (default: engine 0's device), rows in the batch's order."""
        import torch

        parts = self._map(batch, lambda e, b: e.hidden_states_torch(b, layer, pooling))
        dev = self.gather_device if self.gather_device is not None else parts[0].device
        return torch.cat([p.to(dev) for p in parts])

    def hidden_states(self, batch: Batch, layer: int = -1, pooling: Literal["last", "mean"] = "last") -> np.ndarray:
        parts = self._map(batch, lambda e, b: np.asarray(e.hidden_states(b, layer, pooling), np.float32))
        return np.concatenate(parts)

    def generate(self, batch: Batch, sampling: SamplingParams) -> list[Completion]:
        raise EngineCapabilityError("a ShardedEngine computes hidden states only (ppo-hidden's feature engines)")

    def _map(self, batch: Batch, fn: Callable[[Any, Batch], Any]) -> list[Any]:
        """fn(engine k, shard k) for the non-empty shards, in parallel, each retried on a fresh engine
        after a fault; the results in shard order."""
        items = list(batch.items)
        shards = [(k, Batch(items[a:b], prefix=batch.prefix))
                  for k, (a, b) in enumerate(shard_bounds(len(items), len(self.engines))) if b > a]
        if not shards:  # an empty batch: engine 0's own (0, H) answer
            return [self._on_device(0, fn, batch)]
        t0 = time.perf_counter()
        shard0 = list(self.shard_s)
        calls = {k: _Call(lambda k=k, b=b: self._on_device(k, fn, b)) for k, b in shards}
        out = {}
        for k, b in shards:
            attempt = 0
            while True:
                status, value = calls[k].wait(self.timeout_s)
                if status == "ok":
                    out[k] = value
                    break
                cause = f"no answer in {self.timeout_s:g} s" if status == "timeout" else f"{type(value).__name__}: {value}"
                if attempt >= self.retries:
                    raise EngineError(f"feature engine {self.names[k]} failed {attempt + 1} time(s) on a shard of "
                                      f"{len(b)} items; last: {cause}")
                attempt += 1
                self._restart(k, cause, abandon=status == "timeout")
                calls[k] = _Call(lambda k=k, b=b: self._on_device(k, fn, b))
        wall = time.perf_counter() - t0
        self.calls += 1
        self.call_s += wall
        self.recent.append((wall, tuple(b - a for a, b in zip(shard0, self.shard_s))))
        return [out[k] for k, _ in shards]

    def _on_device(self, k: int, fn: Callable[[Any, Batch], Any], batch: Batch) -> Any:
        """fn(engine k, batch) with engine k's GPU as the thread's current CUDA device (a new thread starts
        on cuda:0; kernels that read the current device, streams among them, must see the engine's), timed
        into shard_s[k] with the device synchronised at the end (the gather waits for it anyway)."""
        engine = self.engines[k]
        device = engine.capabilities.device
        t0 = time.perf_counter()
        try:
            if device is None or not device.startswith("cuda"):
                return fn(engine, batch)
            import torch

            with torch.cuda.device(torch.device(device)):
                out = fn(engine, batch)
                torch.cuda.current_stream().synchronize()
                return out
        finally:
            self.shard_s[k] += time.perf_counter() - t0

    def _restart(self, k: int, cause: str, abandon: bool) -> None:
        """Engine k replaced by a fresh one from its factory (the old one closed unless it hangs)."""
        log.warning("feature engine %s failed (%s): restarting it and retrying its shard", self.names[k], cause)
        old = self.engines[k]
        # a hung in-process engine is abandoned as it is (closing it could block on it); one that says how to
        # be abandoned (`abandon()`: a Ray actor is killed) is told
        stop = getattr(old, "abandon", None) if abandon else old.close
        if stop is not None:
            try:
                stop()
            except Exception:  # noqa: BLE001 - a broken engine may fail to close; it is dropped either way
                pass
        self.engines[k] = self.factories[k]()
        self.restarts += 1

    def close(self) -> None:
        for e in self.engines:
            e.close()
        for f in self.on_close:
            f()


def median_call_ms(engine: Any, since: int = 0, skip: int = 0) -> tuple[float, list[float]] | None:
    """(median wall ms, each engine's median ms) of a ShardedEngine's calls made after its `since`-th call,
    the first `skip` of those left out (warm-ups: their compiles); None for an engine that keeps no such
    record, or no call left to read (only the last 1,024 calls are kept)."""
    import statistics

    new = getattr(engine, "calls", 0) - since
    recent = list(getattr(engine, "recent", ()))[-new:][skip:] if new > 0 else []
    if not recent:
        return None
    per_engine = zip(*(shards for _, shards in recent))
    return (round(1000.0 * statistics.median(w for w, _ in recent), 2),
            [round(1000.0 * statistics.median(col), 2) for col in per_engine])
