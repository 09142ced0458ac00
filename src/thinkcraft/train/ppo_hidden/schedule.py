"""When the hidden states are refreshed, and from which snapshot: the two refresh schedules.

The loop calls one method before each window of an update:

    state, fresh = schedule.before_window(state, update)
    state, ... = kernels.window(state) if fresh is None else kernels.window_after_refresh(state, fresh)

* `SyncRefresh`: at a refresh point, render the current observations and call the LLM; the window then
  starts with hidden states of age 0 (installed inside the fused `window_after_refresh`).
* `OverlappedRefresh` (`--overlap`): at a refresh point, install the *previous* snapshot's hidden states
  (one refresh interval old: age skip_n; envs whose episode ended since that snapshot get valid = 0) and
  start this snapshot's LLM call in a worker thread, which runs while the window's jitted scan holds the
  calling thread (XLA drives its loop from the host but releases the GIL). The very first refresh is
  synchronous (age 0). On the policy's GPU the LLM is confined to all but `overlap_env_sms` SMs (a CUDA
  green context, llm/sm_partition.py): without that its matmuls hold every SM, the env's many small
  kernels queue behind them, and the two times nearly add up (bench/overlap_probe.py measures both).

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
    """What both schedules share: the config, the source, the refreshes' suffix lengths, close()."""

    def __init__(self, cfg: PPOHiddenConfig, src: HiddenStateSource) -> None:
        self.cfg = cfg
        self.src = src
        self._tokens: list[float] = []

    def before_window(self, state: HiddenRunner, update: int) -> tuple[HiddenRunner, Any]:
        """(state, fresh (N, H) hidden states for window_after_refresh, or None: run the window alone)."""
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


class SyncRefresh(RefreshSchedule):
    """Refresh from the current observations, then run the window (age 0)."""

    def before_window(self, state: HiddenRunner, update: int) -> tuple[HiddenRunner, Any]:
        if not self.cfg.refreshes_in(update):
            return state, None
        fresh = self.src.hidden(self.src.texts(state.runner.rollout.env_state))
        self._tokens.append(fresh.suffix_tokens)
        return state, fresh.hidden


class OverlappedRefresh(RefreshSchedule):
    """Install the previous snapshot's hidden states; compute this snapshot's in a worker thread."""

    def __init__(self, cfg: PPOHiddenConfig, src: HiddenStateSource, install: Any, engine: Any) -> None:
        super().__init__(cfg, src)
        self.install = install  # the jitted kernels.install
        self.engine = engine
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="llm")
        self._pending: FreshHidden | None = None  # the hidden states the next refresh point installs
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

        timer = self.src.timer
        texts = self.src.texts(state.runner.rollout.env_state)  # snapshot of this refresh point
        if self._pending is None:  # the very first refresh: synchronous, age 0
            # ...but on the worker thread, so that its first-call costs (per-thread cuBLAS handles and
            # workspaces, compiled-graph guards) land in this update, which compiles anyway, not in the
            # first overlapped window
            self._pending = self._executor.submit(self.src.hidden, texts).result()
            with timer.phase("norm"):
                # "all valid" built from the loop's own (committed) array: an uncommitted jnp.ones here made
                # the next refresh compile `install` again (~0.5 s)
                state = self.install(state, self._pending.hidden, 0, ~jnp.zeros_like(state.done_since_snapshot))
        else:  # the previous snapshot's hidden states, one refresh interval old
            if self._future is not None:
                with timer.phase("llm_wait"):
                    self._pending = self._future.result()
            with timer.phase("norm"):
                state = self.install(state, self._pending.hidden, self.cfg.skip_n, ~state.done_since_snapshot)
            # this snapshot's LLM call runs in a worker thread while the window runs (the jitted scan holds
            # the calling thread until it is done; JAX releases the GIL)
            self._future = self._executor.submit(self.src.hidden, texts)
        self._tokens.append(self._pending.suffix_tokens)
        return state, None

    def close(self) -> None:
        """Wait for the worker's call in flight, stop it, and give the engine its SMs back."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._sm_restore is not None:
            self.engine.set_sm_limit(self._sm_restore[0])
            self._sm_restore = None


def make_schedule(cfg: PPOHiddenConfig, src: HiddenStateSource, install: Any, engine: Any) -> RefreshSchedule:
    return OverlappedRefresh(cfg, src, install, engine) if cfg.overlap else SyncRefresh(cfg, src)


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
