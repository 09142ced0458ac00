"""When the hidden states are refreshed, and from which snapshot: the two refresh schedules.

The loop calls one method before each window of an update:

    state, fresh = schedule.before_window(state, update)
    state, ... = kernels.window(state) if fresh is None else kernels.window_after_refresh(state, fresh)

* `SyncRefresh`: at a refresh point, draw the interval's reset pool, render the current observations and
  the pool's worlds and call the LLM once on both; the window then starts with hidden states of age 0
  (installed inside the fused `window_after_refresh`), and resets take the pool's worlds and hidden states.
* `OverlappedRefresh` (`--overlap`): at a refresh point, install the *previous* snapshot's hidden states
  (one refresh interval old: age skip_n) and the pool made at the previous snapshot (encoded with it), and
  start this snapshot's LLM call - the envs and the next interval's pool - in a worker thread, which runs
  while the window's jitted scan holds the calling thread (XLA drives its loop from the host but releases
  the GIL). An env whose episode ended since the previous snapshot keeps the pool world's hidden state it
  reset into (without a pool: valid = 0 until the next refresh). The very first refresh is synchronous
  (age 0; it encodes both pools). On the policy's GPU the LLM is confined to all but `overlap_env_sms`
  SMs (a CUDA green context, llm/sm_partition.py): without that its matmuls hold every SM, the env's many
  small kernels queue behind them, and the two times nearly add up (bench/overlap_probe.py measures both).

Both record each refresh's mean suffix length (`pop_suffix_tokens`) and are context managers; the
overlapped one owns its worker, its pending result and the SM partition, and gives them back on close.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from thinkcraft.train.ppo_hidden.config import PPOHiddenConfig
from thinkcraft.train.ppo_hidden.kernels import HiddenRunner
from thinkcraft.train.ppo_hidden.source import FreshHidden, HiddenStateSource, on_policy_gpu
from thinkcraft.utils.errors import ConfigError, UserError


class RefreshSchedule:
    """What both schedules share: the config, the source, the kernels, the refreshes' suffix lengths."""

    def __init__(self, cfg: PPOHiddenConfig, src: HiddenStateSource, kernels: Any) -> None:
        self.cfg = cfg
        self.src = src
        self.kernels = kernels
        self._tokens: list[float] = []

    def before_window(self, state: HiddenRunner, update: int) -> tuple[HiddenRunner, Any]:
        """(state, fresh (N [+ P], H) hidden states for window_after_refresh, or None: run the window alone)."""
        raise NotImplementedError

    def pop_suffix_tokens(self) -> list[float]:
        """Mean suffix tokens of each refresh since the last call (their number = refreshes)."""
        out, self._tokens = self._tokens, []
        return out

    def close(self) -> None:
        pass

    def __enter__(self) -> "RefreshSchedule":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pooled_snapshot(state: HiddenRunner, *pools: Any) -> list[Any]:
    """The batched craftax states a refresh renders, in order: the envs, then each given reset pool's worlds."""
    return [state.runner.rollout.env_state] + [p.env_state for p in pools]


class SyncRefresh(RefreshSchedule):
    """Draw the interval's reset pool; encode the current observations and the pool; run the window (age 0)."""

    def before_window(self, state: HiddenRunner, update: int) -> tuple[HiddenRunner, Any]:
        if not self.cfg.refreshes_in(update):
            return state, None
        pools = ()
        if self.cfg.pool_size:
            state = self.kernels.new_pool(state)
            pools = (state.runner.rollout.env_state.pool,)
        fresh = self.src.hidden(self.src.texts(*pooled_snapshot(state, *pools)))
        self._tokens.append(fresh.suffix_tokens)
        return state, fresh.hidden


class OverlappedRefresh(RefreshSchedule):
    """Install the previous snapshot's hidden states; compute this snapshot's in a worker thread."""

    def __init__(self, cfg: PPOHiddenConfig, src: HiddenStateSource, kernels: Any, engine: Any) -> None:
        super().__init__(cfg, src, kernels)
        self.engine = engine
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="llm")
        # the hidden states the next refresh point installs: (envs (N, H), its pool's (P, H) or None, tokens)
        self._pending: tuple[Any, Any, float] | None = None
        self._future: Future | None = None  # the LLM call of the latest snapshot
        try:
            self._sm_restore = _partition_for_overlap(engine, cfg)
        except BaseException:
            self._executor.shutdown(wait=False)
            raise

    def before_window(self, state: HiddenRunner, update: int) -> tuple[HiddenRunner, Any]:
        """(state with the previous snapshot's hidden states installed, None): the window runs plain."""
        if not self.cfg.refreshes_in(update):
            return state, None
        import jax.numpy as jnp

        N, P = self.cfg.num_envs, self.cfg.pool_size
        timer, install = self.src.timer, self.kernels.install
        if P:  # the pool made at the previous snapshot becomes current; a new one is made for the next interval
            state = self.kernels.new_pool(state)
        first = self._pending is None
        # this refresh point's snapshot: the envs and the next interval's pool (the first: the current pool too)
        pools = (((state.runner.rollout.env_state.pool,) if first else ()) + (state.next_pool,)) if P else ()
        texts = self.src.texts(*pooled_snapshot(state, *pools))
        # "all valid" / "keep none" built from the loop's own (committed) array: an uncommitted jnp.ones here
        # made the next refresh compile `install` again (~0.5 s)
        none = jnp.zeros_like(state.done_since_snapshot)
        if first:  # the very first refresh: synchronous, age 0
            # ...but on the worker thread, so that its first-call costs (per-thread cuBLAS handles and
            # workspaces, compiled-graph guards) land in this update, which compiles anyway, not in the
            # first overlapped window
            fresh = self._executor.submit(self.src.hidden, texts).result()
            h = fresh.hidden
            S = self.cfg.num_seeds
            h_envs, h_pool, h_next = ((_rows(h, 0, N, S), _rows(h, N, N + P, S), _rows(h, N + P, None, S)) if P
                                      else (h, None, None))
            with timer.phase("norm"):
                state = install(state, h_envs, 0, ~none, h_pool, none)
            self._pending = (h_envs, h_next, fresh.suffix_tokens)
        else:  # the previous snapshot's hidden states, one refresh interval old
            if self._future is not None:
                with timer.phase("llm_wait"):
                    self._pending = _split(self._future.result(), N, P, self.cfg.num_seeds)
            h_envs, h_pool, _ = self._pending
            ended = state.done_since_snapshot
            with timer.phase("norm"):
                if P:  # envs that reset since the snapshot act on their pool world's hidden state: keep it
                    state = install(state, h_envs, self.cfg.skip_n, ~none, h_pool, ended)
                else:
                    state = install(state, h_envs, self.cfg.skip_n, ~ended, None, none)
            # this snapshot's LLM call runs in a worker thread while the window runs (the jitted scan holds
            # the calling thread until it is done; JAX releases the GIL)
            self._future = self._executor.submit(self.src.hidden, texts)
        self._tokens.append(self._pending[2])
        return state, None

    def close(self) -> None:
        """Wait for the worker's call in flight, stop it, and give the engine its SMs back."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._sm_restore is not None:
            self.engine.set_sm_limit(self._sm_restore[0])
            self._sm_restore = None


def make_schedule(cfg: PPOHiddenConfig, src: HiddenStateSource, kernels: Any, engine: Any) -> RefreshSchedule:
    return OverlappedRefresh(cfg, src, kernels, engine) if cfg.overlap else SyncRefresh(cfg, src, kernels)


def _rows(h: Any, start: int, stop: int | None, num_seeds: int) -> Any:
    """Rows start:stop of a refresh's hidden states: (rows, H), or with --num-seeds (K, rows, H)."""
    return h[start:stop] if num_seeds == 1 else h[:, start:stop]


def _split(fresh: FreshHidden, num_envs: int, pool_size: int, num_seeds: int = 1) -> tuple[Any, Any, float]:
    """A worker result -> (the envs' hidden states, the next pool's or None, mean suffix tokens)."""
    h = fresh.hidden
    if not pool_size:
        return h, None, fresh.suffix_tokens
    return _rows(h, 0, num_envs, num_seeds), _rows(h, num_envs, None, num_seeds), fresh.suffix_tokens


def _partition_for_overlap(engine: Any, cfg: PPOHiddenConfig) -> tuple[int | None] | None:
    """--overlap with an in-process engine on the policy's GPU: confine the engine to all but
    `overlap_env_sms` SMs. Returns (the engine's previous limit,) to restore, or None if nothing changed.
    Without green-context support it warns and runs unpartitioned."""
    if not (cfg.overlap and cfg.overlap_env_sms > 0 and engine.capabilities.sm_partition):
        return None
    import jax
    import torch

    from thinkcraft.utils.progress import console

    dev = torch.device(engine.capabilities.device or "cpu")
    if not (dev.type == "cuda" and jax.devices()[0].platform == "gpu"):
        return None
    if not on_policy_gpu(dev):
        return None  # the LLM has its own GPU: nothing to share
    total = torch.cuda.get_device_properties(dev).multi_processor_count
    if cfg.overlap_env_sms >= total:
        raise ConfigError("overlap_env_sms", f"{cfg.overlap_env_sms} leaves no SMs for the LLM (the GPU has {total})")
    try:
        prev = engine.set_sm_limit(total - cfg.overlap_env_sms)
    except UserError as e:
        console.print(f"[yellow]--overlap without an SM partition ({e}); LLM and env time will nearly add up")
        return None
    console.print(f"overlap: LLM on {total - cfg.overlap_env_sms} of {total} SMs, {cfg.overlap_env_sms} kept for the env")
    return (prev,)
