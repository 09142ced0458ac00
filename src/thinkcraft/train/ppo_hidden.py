"""`thinkcraft train ppo-hidden`: PPO on Craftax whose policy also reads a frozen LLM's hidden state of the
text observation, refreshed every `skip_n` env steps.

One PPO update of `num_steps` steps per env is a sequence of windows; at each refresh point:

    1. render      extract semantic arrays of every env on the device (jit) → host → compact text (numpy)
    2. llm         engine.hidden_states(shared instruction prefix + per-env text) — the prefix KV is
                   prefilled once and reused; only the per-env suffix is computed → DLPack → JAX (N, H)
    3. norm        running mean/variance update and z-normalisation (rl.hidden)
    4. env_policy  lax.scan of the window's env+policy steps (jit; without --overlap, 3 and 4 are one jitted
                   call timed as env_policy)
and after the last window:
    5. update      the same GAE + PPO update as plain PPO (rl.ppo.ppo_update)

Refresh rule: `skip_n` must divide `num_steps` (windows of skip_n steps inside each update) or be a
multiple of it (one refresh every skip_n/num_steps updates). `skip_n = 0` means "never": the plain PPO
path (`train ppo`) runs, no LLM is loaded.

`--overlap`: the LLM call for a refresh point's snapshot runs in a worker thread while the following
window's env+policy scan runs (the jitted scan holds the calling thread until it finishes - XLA drives its
loop from the host - but releases the GIL, so a second thread is what lets the two run together). The
policy then sees hidden states one refresh interval old (age starts at skip_n instead of 0; envs whose
episode ended since the snapshot get valid = 0). `timing/llm` is then the worker's time (overlapping
`timing/env_policy`); `timing/llm_wait` is what the loop actually waited for it.
On the same GPU the LLM is confined to all but `overlap_env_sms` SMs (a CUDA green context, see
llm/sm_partition.py): without that, the LLM's matmuls hold every SM, each of the env's many small kernels
queues behind them, and the two times nearly add up (bench/overlap_probe.py measures both). With the LLM
on another GPU (`--engine-device cuda:1`) or a server, the two overlap without a partition.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from thinkcraft.train.ppo import SHAPE_FIELDS as PPO_SHAPE_FIELDS
from thinkcraft.train.ppo import PPOConfig
from thinkcraft.utils.errors import ConfigError, UserError, check

SHAPE_FIELDS = PPO_SHAPE_FIELDS + ("skip_n", "hidden_proj_dim", "layer", "pooling", "text_format", "overlap",
                                   "engine_quantize")

DEFAULT_INSTRUCTIONS = (
    "You are an expert player of Craftax, a 2D open-world survival game. Below is the current game state. "
    "Think about what matters most for survival and progress.\n"
)


@dataclass
class PPOHiddenConfig(PPOConfig):
    """PPO whose policy also reads a frozen LLM's hidden state of the text observation."""

    env_name: str = "Craftax-Classic-Symbolic-v1"
    """Craftax-Symbolic-v1 | Craftax-Classic-Symbolic-v1 (aliases: craftax, craftax-classic)."""
    num_envs: int = 128
    """Parallel environments (each gets an LLM call per refresh)."""
    num_steps: int = 100
    """Steps per env per update; skip_n must divide it or be a multiple of it."""
    skip_n: int = 25
    """Refresh the hidden states every skip_n env steps (0 = never: plain PPO, no LLM)."""
    engine: str = "hf:default"
    """Engine spec: hf:<path-or-default>, vllm:<path>, sglang+http://host:port."""
    engine_device: str | None = None
    """Device for an in-process hf engine (default: cuda if available, else cpu)."""
    engine_max_batch_tokens: int | None = None
    """Tokens per engine forward chunk (default: the engine's own)."""
    engine_quantize: Literal["none", "fp8"] = "none"
    """hf engine: fp8 runs the frozen LLM's decoder matmuls in FP8 (Hopper/Ada): 1.24-1.30x the prefill
    rate on an H100; activations and weights rounded to 3 mantissa bits (per-token/per-channel scales)."""
    layer: int = -1
    """Which hidden layer to read (-1 = last, final-normed; 0 = embeddings)."""
    pooling: Literal["last", "mean"] = "last"
    """Pool the per-env text's tokens: last real token, or mean."""
    text_format: Literal["compact", "craftax"] = "compact"
    """Text rendering of the observation fed to the LLM."""
    instructions: str = DEFAULT_INSTRUCTIONS
    """Shared prompt prefix before every env's text (prefilled once; the format description is appended)."""
    hidden_proj_dim: int = 64
    """Width of the learned projection of the hidden state into the policy."""
    overlap: bool = False
    """Compute the next refresh's hidden states while the current window runs (one refresh interval stale)."""
    overlap_env_sms: int = 16
    """With --overlap and an in-process LLM on the policy's GPU: SMs kept free of LLM work for the env steps
    (the LLM runs on a CUDA green context of the others). 0 = no partition (the two then nearly serialise)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.skip_n >= 0, "skip_n", "must be >= 0 (0 = never)")
        if self.skip_n > 0:
            T, S = self.num_steps, self.skip_n
            if T % S and S % T:
                divs = [d for d in range(1, T + 1) if T % d == 0]
                near = sorted(set(divs + [T * 2, T * 4]), key=lambda d: abs(d - S))[:3]
                raise ConfigError("skip_n", f"{S} must divide num_steps={T} or be a multiple of it "
                                  f"(refreshes happen at window boundaries); nearest valid: {near}, "
                                  f"or change --num-steps")
        check(self.hidden_proj_dim > 0, "hidden_proj_dim", "must be > 0")
        check(self.overlap_env_sms >= 0, "overlap_env_sms", "must be >= 0 (0 = no SM partition)")
        if self.engine_quantize != "none" and not _is_hf(self.engine):
            raise ConfigError("engine_quantize", f"applies to the in-process hf engine, not {self.engine!r} "
                              f"(quantise a served model in its server: vLLM/SGLang --quantization fp8)")
        if "Pixels" in self.env_name:
            raise ConfigError("env_name", "ppo-hidden uses symbolic observations; pick a -Symbolic- env")

    @property
    def window_steps(self) -> int:
        return min(self.skip_n, self.num_steps)

    @property
    def windows_per_update(self) -> int:
        return self.num_steps // self.window_steps

    @property
    def updates_per_refresh(self) -> int:
        return max(1, self.skip_n // self.num_steps)

    def ppo_config(self) -> PPOConfig:
        known = {f.name for f in dataclasses.fields(PPOConfig)}
        return PPOConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in known})


class HiddenRunner(NamedTuple):
    runner: Any  # rl.ppo.RunnerState (its rollout.aux is an rl.hidden.HiddenAux)
    norm: Any  # rl.hidden.RunningNorm
    done_since_snapshot: Any  # (N,) bool, for --overlap: episodes ended since the pending snapshot


class _Pending(NamedTuple):
    hidden: Any  # (N, H) raw hidden states of a snapshot taken at a refresh point
    suffix_tokens: float


def _make_prompt_prefix(cfg: PPOHiddenConfig) -> str:
    from thinkcraft.envs.text import COMPACT_FORMAT_DOC

    doc = COMPACT_FORMAT_DOC.strip() + "\n" if cfg.text_format == "compact" else ""
    return cfg.instructions + doc + "Observation:\n"


def _is_hf(spec: str) -> bool:
    return spec == "hf" or spec.startswith("hf:")


def _engine_options(cfg: PPOHiddenConfig) -> dict[str, Any]:
    if not _is_hf(cfg.engine):
        return {}
    opts: dict[str, Any] = {}
    if cfg.engine_device:
        opts["device"] = cfg.engine_device
    if cfg.engine_max_batch_tokens:
        opts["max_batch_tokens"] = cfg.engine_max_batch_tokens
    if cfg.engine_quantize != "none":
        opts["quantize"] = cfg.engine_quantize
    return opts


class HiddenStateSource:
    """Phase 1+2: env states → text → LLM hidden states (N, H) as a JAX array. Times its two phases."""

    def __init__(self, engine: Any, cfg: PPOHiddenConfig, env_kind: str, timer: Any) -> None:
        from thinkcraft.llm.protocol import Batch

        self.engine = engine
        self.cfg = cfg
        self.env_kind = env_kind
        self.timer = timer
        self.prefix = _make_prompt_prefix(cfg)
        self._Batch = Batch
        self._prefix_ids: list[int] | None = None
        self._token_renderer: Any = None

    def texts(self, env_state: Any) -> list[str] | list[list[int]]:
        """The envs' observations as text, or - compact format with an in-process engine - straight as
        token ids (CompactTokenRenderer: each piece tokenized once, equal to tokenizing the text)."""
        import jax

        from thinkcraft.envs.text import CompactTokenRenderer, extract, render

        with self.timer.phase("render"):
            sem = jax.device_get(extract(env_state))
            if self.cfg.text_format == "compact" and self._token_path():
                if self._token_renderer is None:
                    self._token_renderer = CompactTokenRenderer(self.engine.tokenizer)
                return self._token_renderer.render(sem, env_kind=self.env_kind)
            return render(sem, fmt=self.cfg.text_format, env_kind=self.env_kind)

    @staticmethod
    def _to_policy(h: Any) -> Any:
        """(N, H) torch hidden states -> a JAX array on the policy's device (JAX's first). The LLM may live
        elsewhere (--engine-device cuda:1, or the CPU): another GPU's output is peer-copied by torch first
        (DLPack cannot cross devices), anything else is placed by JAX."""
        import jax

        from thinkcraft.llm.dlpack import torch_to_jax

        target = jax.devices()[0]
        if h.device.type == "cuda" and target.platform == "gpu" and not _on_policy_gpu(h.device):
            h = h.to(f"cuda:{target.local_hardware_id}")  # ~1 MB
        x = torch_to_jax(h)
        return x if x.devices() == {target} else jax.device_put(x, target)

    def _token_path(self) -> bool:
        eng = self.engine
        return all(hasattr(eng, a) for a in ("tokenize_batch", "hidden_states_torch", "tokenizer"))

    def hidden(self, texts: list[str] | list[list[int]]) -> _Pending:
        import jax.numpy as jnp

        with self.timer.phase("llm"):
            eng = self.engine
            try:
                if self._token_path():
                    if self._prefix_ids is None:
                        self._prefix_ids, _ = eng.tokenize_batch(self._Batch([""], prefix=self.prefix))
                    if texts and isinstance(texts[0], str):
                        _, items = eng.tokenize_batch(self._Batch(texts, prefix=self.prefix))
                    else:
                        items = texts
                    h = eng.hidden_states_torch(self._Batch(items, prefix=self._prefix_ids), self.cfg.layer, self.cfg.pooling)
                    n_tok = float(np.mean([len(i) for i in items]))
                    return _Pending(self._to_policy(h), n_tok)
                h = eng.hidden_states(self._Batch(texts, prefix=self.prefix), self.cfg.layer, self.cfg.pooling)
                return _Pending(jnp.asarray(h, jnp.float32), float("nan"))
            except UserError:
                raise
            except Exception as e:  # engine failures after the engine's own retries
                raise EngineFailed(str(e)) from e


class EngineFailed(RuntimeError):
    pass


def _on_policy_gpu(dev: Any) -> bool:
    """Is this CUDA torch device the GPU JAX (the policy) runs on - JAX's first device?"""
    import jax
    import torch

    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return index == jax.devices()[0].local_hardware_id


def _partition_for_overlap(engine: Any, cfg: PPOHiddenConfig) -> tuple[int | None] | None:
    """--overlap with an in-process engine on the policy's GPU: confine the engine to all but
    `overlap_env_sms` SMs. Returns (the engine's previous limit,) to restore, or None if nothing changed.
    Without green-context support it warns and runs unpartitioned."""
    if not (cfg.overlap and cfg.overlap_env_sms > 0 and hasattr(engine, "set_sm_limit")):
        return None
    import jax
    import torch

    from thinkcraft.utils.progress import console

    dev = getattr(engine, "device", None)
    if not (isinstance(dev, torch.device) and dev.type == "cuda" and jax.devices()[0].platform == "gpu"):
        return None
    if not _on_policy_gpu(dev):
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


def run(cfg: PPOHiddenConfig, engine: Any = None) -> dict[str, Any]:
    """Train. `engine` (optional) is an already-built Engine to use instead of `cfg.engine` (benchmarks,
    notebooks); it is not closed at the end."""
    if cfg.skip_n == 0:
        # "never": exactly the plain PPO path (same kernels, same speed, no LLM)
        from thinkcraft.train.ppo import run as run_ppo

        named = cfg.run_dir or cfg.run_name
        return run_ppo(cfg.ppo_config() if named else dataclasses.replace(
            cfg.ppo_config(), run_name=f"ppo-hidden-never-{cfg.run_label()}-{time.strftime('%Y%m%d-%H%M%S')}"))
    # JAX must not grab most of the GPU: torch (the LLM) shares it
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp

    from thinkcraft.envs.craftax import achievement_names, achievement_weights, env_kind
    from thinkcraft.llm import make_engine
    from thinkcraft.rl.hidden import (
        AugInput, RunningNorm, aux_after_step, empty_aux, make_policy_input, refresh,
    )
    from thinkcraft.rl.networks import ActorCriticAug
    from thinkcraft.rl.ppo import episode_sums, init_runner_state, make_rollout, ppo_update
    from thinkcraft.train.ppo import build, episode_metrics
    from thinkcraft.train.session import TrainSession
    from thinkcraft.utils.jaxcache import enable_compilation_cache
    from thinkcraft.utils.progress import console

    session = TrainSession(cfg, "ppo-hidden", shape_fields=SHAPE_FIELDS, defaults=PPOHiddenConfig(),
                           total_steps=lambda c: c.num_updates * c.batch_size,
                           title=lambda c: f"PPO+LLM {c.env_name} skip_n={c.skip_n}",
                           plot_keys=("episode/return", "achievements/mean_rate", "sps", "llm/share"))
    cfg = session.cfg

    # 1. the engine first: hidden-state support and size are checked before anything compiles
    own_engine = engine is None
    if own_engine:
        engine = make_engine(cfg.engine, **_engine_options(cfg))
    caps = engine.capabilities
    if not caps.hidden_states:
        raise UserError(f"engine {cfg.engine!r} cannot return hidden states; use hf:<model> or sglang+http://...")
    H = caps.hidden_size
    if H is None:
        raise UserError(f"engine {cfg.engine!r} does not report its hidden size")
    if session.resuming and session.saved_derived.get("hidden_size") not in (None, H):
        raise UserError(f"hidden size mismatch: the checkpoint was trained with hidden size "
                        f"{session.saved_derived['hidden_size']}, engine {cfg.engine!r} gives {H}")
    session.save_config(num_updates=cfg.num_updates, batch_size=cfg.batch_size, hidden_size=H,
                        windows_per_update=cfg.windows_per_update, updates_per_refresh=cfg.updates_per_refresh)
    enable_compilation_cache()

    # 2. env, network, optimizer, state
    env, _, tx = build(cfg.ppo_config())
    network = ActorCriticAug(env.num_actions, cfg.layer_width, hidden_proj_dim=cfg.hidden_proj_dim,
                             dtype=jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32)
    N, W, S = cfg.num_envs, cfg.windows_per_update, cfg.window_steps
    policy_input = make_policy_input(float(cfg.skip_n))
    sample = AugInput(jnp.zeros((1, env.obs_dim)), jnp.zeros((1, H)), jnp.zeros((1,)), jnp.zeros((1,)))

    def init(rng):
        runner = init_runner_state(env, network, tx, rng, aux=empty_aux(N, H), sample_input=sample)
        return HiddenRunner(runner, RunningNorm.create(H), jnp.zeros((N,), bool))

    rng = jax.random.PRNGKey(cfg.seed)
    state = session.restore(jax.eval_shape(init, rng)) if session.resuming else jax.jit(init)(rng)
    # Committed to the policy's device like everything the loop feeds back (the hidden states arrive
    # committed through DLPack): a jitted call whose inputs go from uncommitted to committed compiles again,
    # and for the fused refresh+window that is a second compile of the whole rollout (~40 s on a GPU).
    state = jax.device_put(state, jax.devices()[0])
    start_update = int(state.runner.update)

    # 3. jitted kernels (shared with plain PPO: make_rollout, ppo_update)
    rollout = make_rollout(env, network.apply, S, policy_input, aux_after_step)
    hp = cfg.hyper()

    def _install(state: HiddenRunner, hidden: jax.Array, age: jax.Array, valid: jax.Array) -> HiddenRunner:
        norm, aux = refresh(state.norm, hidden, jnp.full((N,), age, jnp.int32), valid)
        r = state.runner
        return HiddenRunner(r._replace(rollout=r.rollout._replace(aux=aux)), norm, jnp.zeros((N,), bool))

    def _window(state: HiddenRunner):
        r = state.runner
        rs, traj, stats = rollout(r.train_state.params, r.rollout)
        info = {"age": traj.obs.age.mean() * cfg.skip_n, "valid": traj.obs.valid.mean()}
        done_any = state.done_since_snapshot | traj.done.any(0)
        return HiddenRunner(r._replace(rollout=rs), state.norm, done_any), traj, stats, info

    install = jax.jit(_install)
    window = jax.jit(_window)
    # Synchronous refresh: install (age 0, every env valid) and the window in one jitted call (one dispatch
    # of the big runner state instead of two; on an H100 at skip_n=1 no measurable SPS change). The window
    # alone is compiled only when some windows have no refresh (skip_n > num_steps).
    @jax.jit
    def window_after_refresh(state: HiddenRunner, hidden: jax.Array):
        return _window(_install(state, hidden, 0, jnp.ones((N,), bool)))

    def _update(state: HiddenRunner, trajs: tuple):
        r = state.runner
        traj = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *trajs)
        ts = r.train_state
        _, last_value = network.apply(ts.params, policy_input(r.rollout.obs, r.rollout.aux))
        rng, k = jax.random.split(r.rollout.rng)
        ts, metrics = ppo_update(ts, traj, last_value, k, hp)
        r = r._replace(train_state=ts, rollout=r.rollout._replace(rng=rng), update=r.update + 1)
        return state._replace(runner=r), metrics

    update_fn = jax.jit(_update, donate_argnums=0)

    src = HiddenStateSource(engine, cfg, env_kind(cfg.env_name), session.timer)
    names = achievement_names(cfg.env_name)
    max_return = float(sum(achievement_weights(cfg.env_name)))
    end_update = cfg.num_updates
    if cfg.stop_after_updates:
        end_update = min(end_update, start_update + cfg.stop_after_updates)
    update = start_update
    pending: _Pending | None = None
    future: Any = None
    executor = ThreadPoolExecutor(1, thread_name_prefix="llm") if cfg.overlap else None
    timer = session.timer
    console.print(f"ppo-hidden: {N} envs, {W} window(s) of {S} steps per update, refresh every {cfg.skip_n} steps, "
                  f"engine {cfg.engine} (hidden size {H}){', overlap' if cfg.overlap else ''}")

    sm_restore = _partition_for_overlap(engine, cfg)
    try:
        with session:
            session.start(update)
            while session.running(update, end_update):
                t_update0 = time.perf_counter()
                timer.reset()
                trajs, stats_sum, infos, tokens = [], None, [], []
                refresh_update = (update % cfg.updates_per_refresh) == 0
                for w in range(W):
                    fresh = None  # hidden states of the current observations (synchronous refresh)
                    if refresh_update:
                        if not cfg.overlap:
                            p = src.hidden(src.texts(state.runner.rollout.env_state))
                            fresh = p.hidden
                            tokens.append(p.suffix_tokens)
                        else:
                            texts = src.texts(state.runner.rollout.env_state)  # snapshot of this refresh point
                            if pending is None:  # the very first refresh: synchronous, age 0
                                # ...but on the worker thread, so that its first-call costs (per-thread
                                # cuBLAS handles and workspaces, compiled-graph guards) land in this update,
                                # which compiles anyway, not in the first overlapped window
                                pending = executor.submit(src.hidden, texts).result()
                                with timer.phase("norm"):
                                    # "all valid" built from the loop's own (committed) array: an uncommitted
                                    # jnp.ones here made the next refresh compile `install` again (~0.5 s)
                                    state = install(state, pending.hidden, 0, ~jnp.zeros_like(state.done_since_snapshot))
                            else:  # the previous snapshot's hidden states, one refresh interval old
                                if future is not None:
                                    with timer.phase("llm_wait"):
                                        pending = future.result()
                                with timer.phase("norm"):
                                    state = install(state, pending.hidden, cfg.skip_n, ~state.done_since_snapshot)
                                # this snapshot's LLM call runs in a worker thread while the window runs (the
                                # jitted scan holds the calling thread until it is done; JAX releases the GIL)
                                future = executor.submit(src.hidden, texts)
                            tokens.append(pending.suffix_tokens)
                    t0 = time.perf_counter()
                    state, traj, stats, info = window(state) if fresh is None else window_after_refresh(state, fresh)
                    jax.block_until_ready(state.runner.rollout.obs)
                    timer.add("env_policy", time.perf_counter() - t0)
                    trajs.append(traj)
                    infos.append(info)
                    stats_sum = stats if stats_sum is None else jax.tree.map(jnp.add, stats_sum, stats)
                with timer.phase("update"):
                    state, metrics = update_fn(state, tuple(trajs))
                    metrics = jax.device_get(metrics)
                update += 1
                wall = time.perf_counter() - t_update0
                sps = cfg.batch_size / wall
                stats_h = jax.device_get(stats_sum)
                infos = jax.device_get(infos)
                rec = {k: float(v) for k, v in metrics.items()}
                rec.update(episode_metrics(episode_sums(stats_h), names, max_return))
                rec.update(timer.metrics())
                # the loop's time outside its timed phases; under --overlap the LLM phase runs in the worker
                # beside them (the loop's share of it is timing/llm_wait), so it is not part of the loop's sum
                loop_phases = timer.total() - (timer.seconds("llm") if cfg.overlap else 0.0)
                rec["timing/other"] = wall - loop_phases
                rec.update({
                    "sps": sps, "timing/update_wall": wall,
                    # the LLM's busy time over the wall; with --overlap it runs beside the env, so what the loop
                    # lost to it is llm/wait_share (the time it waited for a refresh to finish)
                    "llm/share": timer.seconds("llm") / wall,
                    "llm/wait_share": (timer.seconds("llm_wait") if cfg.overlap else timer.seconds("llm")) / wall,
                    "llm/refreshes": len(tokens),
                    "llm/prompt_suffix_tokens": float(np.nanmean(tokens)) if tokens and not np.isnan(tokens).all() else None,
                    "hidden/age_mean": float(np.mean([i["age"] for i in infos])),
                    "hidden/valid_frac": float(np.mean([i["valid"] for i in infos])),
                    "hidden/norm_count": float(state.norm.count),
                })
                shares = {"llm": f"{100 * rec['llm/share']:.0f}%"}
                if cfg.overlap:
                    shares["wait"] = f"{100 * rec['llm/wait_share']:.0f}%"
                session.log(update, update * cfg.batch_size, rec, sps=sps, **shares,
                            ret=rec.get("episode/return", float("nan")))
                if cfg.overlap and update == start_update + 2 and timer.seconds("llm_wait") > 0.5 * wall:
                    # after one steady update: say once if overlap cannot help (the LLM alone is the cycle)
                    console.print(f"[yellow]overlap: the loop waited {timer.seconds('llm_wait'):.2f} s of {wall:.2f} s for "
                                  f"the LLM - it is the bottleneck, and overlap only hides env time behind it "
                                  f"(at small skip_n it can cost speed). Faster refreshes: --engine-quantize fp8, "
                                  f"an earlier --layer, a larger --skip-n; or run without --overlap")
                session.maybe_checkpoint(update, update * cfg.batch_size, state, state.runner.train_state.params)
            session.maybe_checkpoint(update, update * cfg.batch_size, state, state.runner.train_state.params, force=True)
    except EngineFailed as e:
        raise UserError(f"the LLM engine failed: {e}. The last checkpoint in {session.run_dir} is intact; "
                        f"continue with {session.resume_command}") from None
    finally:
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        if sm_restore is not None:
            engine.set_sm_limit(sm_restore[0])
        if own_engine:
            engine.close()
    summary = session.summary
    summary.update({"update": update, "env_steps": update * cfg.batch_size, "hidden_size": H})
    console.print(f"done: {update:,} updates, {update * cfg.batch_size:,} steps; return "
                  f"{summary.get('episode/return', float('nan')):.2f}; sps {summary.get('sps', 0):,.0f}; "
                  f"LLM share {100 * summary.get('llm/share', 0):.0f}%"
                  + (f" (the loop waited {100 * summary.get('llm/wait_share', 0):.0f}%)" if cfg.overlap else "")
                  + f"; run dir {session.run_dir}")
    return summary
