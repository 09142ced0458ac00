"""`run(cfg)`: ppo-hidden's outer loop — setup in numbered steps, then per update: windows (each preceded by
the schedule's refresh) and the PPO update, every phase timed (`timing/<phase>`), then log and checkpoint."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np

from thinkcraft.train.ppo_hidden.config import SHAPE_FIELDS, PPOHiddenConfig, build_engine
from thinkcraft.train.ppo_hidden.kernels import HiddenRunner, Kernels
from thinkcraft.train.ppo_hidden.schedule import RefreshSchedule
from thinkcraft.train.ppo_hidden.source import EngineFailed
from thinkcraft.llm.protocol import EngineError
from thinkcraft.utils.errors import UserError


def run(cfg: PPOHiddenConfig, engine: Any = None) -> dict[str, Any]:
    """Train. `engine` (optional) is an already-built Engine to use instead of `cfg.engine` (benchmarks,
    notebooks); it is not closed at the end."""
    if cfg.skip_n == 0:
        return _run_never(cfg)
    # JAX must not grab most of the GPU: torch (the LLM) shares it
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from thinkcraft.train.session import TrainSession
    from thinkcraft.utils.progress import console

    session = TrainSession(cfg, "ppo-hidden", shape_fields=SHAPE_FIELDS, defaults=PPOHiddenConfig(),
                           total_steps=lambda c: c.num_updates * c.batch_size,
                           title=lambda c: f"PPO+LLM {c.env_name} skip_n={c.skip_n}",
                           plot_keys=("episode/return", "achievements/mean_rate", "sps", "llm/share"))
    cfg = session.cfg

    # 1. the engine first: hidden-state support and size are checked before anything compiles (inside the
    # session, so that Ctrl-C / SIGTERM during the load or the compile stops cleanly too)
    own_engine = engine is None
    with session:
        if own_engine:
            engine = build_engine(cfg)
        try:
            update = _setup_and_train(cfg, session, engine)
        finally:
            if own_engine:
                engine.close()

    # 5. summary
    summary = session.summary
    summary.update({"update": update, "env_steps": update * cfg.batch_size})
    console.print(f"done: {update:,} updates, {update * cfg.batch_size:,} steps; return "
                  f"{summary.get('episode/return', float('nan')):.2f}; sps {summary.get('sps', 0):,.0f}; "
                  f"LLM share {100 * summary.get('llm/share', 0):.0f}%"
                  + (f" (the loop waited {100 * summary.get('llm/wait_share', 0):.0f}%)" if cfg.overlap else "")
                  + f"; run dir {session.run_dir}")
    return summary


def _setup_and_train(cfg: PPOHiddenConfig, session: Any, engine: Any) -> int:
    """Steps 1-4 after the engine exists: check it, build and restore, compile, train. Returns the update
    count reached."""
    import jax

    from thinkcraft.envs.craftax import env_kind
    from thinkcraft.rl.seeds import init_seeds, seeds_template
    from thinkcraft.train.ppo import build_env, build_optimizer, make_env_shards
    from thinkcraft.train.ppo_hidden.kernels import build_kernels, build_network, make_init, state_axes
    from thinkcraft.train.ppo_hidden.schedule import make_schedule
    from thinkcraft.train.ppo_hidden.source import HiddenStateSource
    from thinkcraft.utils.jaxcache import enable_compilation_cache
    from thinkcraft.utils.progress import console

    H = _hidden_size(engine, cfg, session)
    enable_compilation_cache()

    # 2. env, network, optimizer, state (restored when resuming); with --devices D each device's env shard
    shards = make_env_shards(cfg, session)
    D = shards.count
    env = build_env(cfg, shards.local(cfg.num_envs))
    network = build_network(cfg, env)
    init = make_init(cfg, env, network, build_optimizer(cfg), H, shards)
    S = cfg.num_seeds  # each seed initialised by the same jitted init (rl/seeds.py)
    state = (session.restore(seeds_template(init, cfg.seed, S)) if session.resuming
             else init_seeds(jax.jit(init), cfg.seed, S))
    # written only now: a resumed run's checkpoint has been verified by `restore` first
    session.save_config(num_updates=cfg.num_updates, batch_size=cfg.batch_size, hidden_size=H,
                        windows_per_update=cfg.windows_per_update, updates_per_refresh=cfg.updates_per_refresh,
                        **({"env_shards": D} if D > 1 else {}))
    # Committed to the policy's device like everything the loop feeds back (the hidden states arrive
    # committed through DLPack): a jitted call whose inputs go from uncommitted to committed compiles
    # again, and for the fused refresh+window that is a second compile of the whole rollout (~40 s on a GPU).
    # With --devices: split over the mesh (the hidden states arrive replicated on it: source.py).
    state = jax.device_put(state, jax.devices()[0]) if D == 1 else shards.place(state, state_axes(), S)

    # 3. jitted kernels (shared with plain PPO: make_rollout, ppo_update) and the hidden-state source
    kernels = build_kernels(cfg, env, network, shards)
    src = HiddenStateSource(engine, cfg, env_kind(cfg.env_name), session.timer, shards)
    seeds = (f" × {S} seeds" if S > 1 else "") + (f" over {D} devices" if D > 1 else "")
    console.print(f"ppo-hidden: {cfg.num_envs} envs{seeds}, {cfg.windows_per_update} window(s) of {cfg.window_steps} "
                  f"steps per update, refresh every {cfg.skip_n} steps, engine {cfg.engine} (hidden size {H})"
                  + (f" on {', '.join(cfg.feature_devices)}" if cfg.feature_devices else "")
                  + (f" x {cfg.ray_feature_engines} Ray actors" if cfg.ray_feature_engines else "")
                  + (", hidden input ZEROS (the blank ablation: the engine is not called)"
                     if cfg.hidden_input == "zeros" else "")
                  + f"{', overlap' if cfg.overlap else ''}; "
                  + (f"resets draw from a pool of {cfg.pool_size} worlds per refresh" if cfg.pool_size
                     else "hidden input masked after a reset until the next refresh (no reset pool)"))

    # 4. updates: windows (each after the schedule's refresh), the PPO update, log, checkpoint
    session.summary["hidden_size"] = H
    try:
        with make_schedule(cfg, src, kernels, engine) as schedule:
            return _train(cfg, session, state, kernels, schedule)
    except EngineFailed as e:
        raise UserError(f"the LLM engine failed: {e}. The last checkpoint in {session.run_dir} is intact; "
                        f"continue with {session.resume_command}") from None


def _run_never(cfg: PPOHiddenConfig) -> dict[str, Any]:
    """skip_n = 0, "never": exactly the plain PPO path (same kernels, same speed, no LLM)."""
    from thinkcraft.train.ppo import run as run_ppo

    named = cfg.run_dir or cfg.run_name
    return run_ppo(cfg.ppo_config() if named else dataclasses.replace(
        cfg.ppo_config(), run_name=f"ppo-hidden-never-{cfg.run_label()}-{time.strftime('%Y%m%d-%H%M%S')}"))


def _hidden_size(engine: Any, cfg: PPOHiddenConfig, session: Any) -> int:
    """The engine's hidden size, checked: it gives hidden states, reports their size (a remote engine
    asks its server: `model_info`), and (resuming) the size matches the checkpoint's."""
    caps = engine.capabilities
    if not caps.hidden_states:
        raise UserError(f"engine {cfg.engine!r} cannot return hidden states; use hf:<model> or sglang+http://...")
    if caps.hidden_size is None and caps.remote_model_info:
        try:
            engine.model_info()
        except EngineError as e:
            raise UserError(f"engine {cfg.engine!r}: could not learn the model's hidden size from the server: {e}") from None
        caps = engine.capabilities
    H = caps.hidden_size
    if H is None:
        raise UserError(f"engine {cfg.engine!r} does not report its hidden size")
    if session.resuming and session.saved_derived.get("hidden_size") not in (None, H):
        raise UserError(f"hidden size mismatch: the checkpoint was trained with hidden size "
                        f"{session.saved_derived['hidden_size']}, engine {cfg.engine!r} gives {H}")
    return H


def _train(cfg: PPOHiddenConfig, session: Any, state: HiddenRunner, kernels: Kernels,
           schedule: RefreshSchedule) -> int:
    """The update loop (inside the session): returns the number of updates done when it stops."""
    from thinkcraft.envs.craftax import achievement_names, achievement_weights

    names = achievement_names(cfg.env_name)
    max_return = float(sum(achievement_weights(cfg.env_name)))
    start_update = update = int(np.asarray(state.runner.update).reshape(-1)[0])
    end_update = cfg.num_updates
    if cfg.stop_after_updates:
        end_update = min(end_update, start_update + cfg.stop_after_updates)
    timer = session.timer
    session.start(update)
    while session.running(update, end_update):
        t_update0 = time.perf_counter()
        timer.reset()
        state, metrics, stats_sum, infos = _one_update(cfg, state, update, kernels, schedule, timer)
        update += 1
        wall = time.perf_counter() - t_update0
        recs = _update_metrics(cfg, timer, wall, metrics, stats_sum, infos, schedule.pop_suffix_tokens(), state,
                               names, max_return)
        rec = recs[0]
        shares = {"llm": f"{100 * rec['llm/share']:.0f}%"}
        if cfg.overlap:
            shares["wait"] = f"{100 * rec['llm/wait_share']:.0f}%"
        rets = [r["episode/return"] for r in recs if "episode/return" in r]
        session.log_seeds(update, update * cfg.batch_size, recs, sps=rec["sps"], **shares,
                          ret=float(np.mean(rets)) if rets else float("nan"))
        if cfg.overlap and update == start_update + 2:
            _warn_if_llm_bound(timer.seconds("llm_wait"), wall)
        session.maybe_checkpoint(update, update * cfg.batch_size, state, state.runner.train_state.params)
    session.maybe_checkpoint(update, update * cfg.batch_size, state, state.runner.train_state.params, force=True)
    return update


def _one_update(cfg: PPOHiddenConfig, state: HiddenRunner, update: int, kernels: Kernels,
                schedule: RefreshSchedule, timer: Any) -> tuple[HiddenRunner, Any, Any, list]:
    """The windows of one update (refresh, env_policy) and its PPO update; (state, loss metrics, episode
    stats summed over the windows, per-window hidden-state info)."""
    import jax
    import jax.numpy as jnp

    trajs, stats_sum, infos = [], None, []
    memory = state.runner.rollout.memory  # --policy rnn: the update reruns the windows from here
    for _ in range(cfg.windows_per_update):
        state, fresh = schedule.before_window(state, update)
        t0 = time.perf_counter()
        state, traj, stats, info = kernels.window(state) if fresh is None else kernels.window_after_refresh(state, fresh)
        jax.block_until_ready(state.runner.rollout.obs)
        timer.add("env_policy", time.perf_counter() - t0)
        trajs.append(traj)
        infos.append(info)
        stats_sum = stats if stats_sum is None else jax.tree.map(jnp.add, stats_sum, stats)
    with timer.phase("update"):
        state, metrics = kernels.update(state, tuple(trajs), memory)
        metrics = jax.device_get(metrics)
    return state, metrics, stats_sum, infos


def _update_metrics(cfg: PPOHiddenConfig, timer: Any, wall: float, metrics: dict, stats_sum: Any, infos: list,
                    tokens: list[float], state: HiddenRunner, names: tuple[str, ...], max_return: float) -> list[dict]:
    """One update's records, one per seed: losses, episodes and hidden-state stats of the seed, and what
    the seeds share - `timing/<phase>`, sps (all seeds' steps), the LLM's share."""
    import jax

    from thinkcraft.rl.ppo import episode_sums
    from thinkcraft.rl.seeds import split_seeds
    from thinkcraft.train.ppo import episode_metrics

    S = cfg.num_seeds
    shared = dict(timer.metrics())
    # the loop's time outside its timed phases; under --overlap the LLM phase runs in the worker beside them
    # (the loop's share of it is timing/llm_wait), so it is not part of the loop's sum
    loop_phases = timer.total() - (timer.seconds("llm") if cfg.overlap else 0.0)
    shared["timing/other"] = wall - loop_phases
    shared.update({
        "sps": S * cfg.batch_size / wall, "timing/update_wall": wall,
        # the LLM's busy time over the wall; with --overlap it runs beside the env, so what the loop lost to
        # it is llm/wait_share (the time it waited for a refresh to finish)
        "llm/share": timer.seconds("llm") / wall,
        "llm/wait_share": (timer.seconds("llm_wait") if cfg.overlap else timer.seconds("llm")) / wall,
        "llm/refreshes": len(tokens),
        "llm/prompt_suffix_tokens": float(np.nanmean(tokens)) if tokens and not np.isnan(tokens).all() else None,
    })
    if S > 1:
        shared["sps_per_seed"] = cfg.batch_size / wall
    per_seed = zip(split_seeds(metrics, S), split_seeds(jax.device_get(stats_sum), S),
                   split_seeds(jax.device_get(infos), S), split_seeds(jax.device_get(state.norm.count), S))
    recs = []
    for m, stats, seed_infos, norm_count in per_seed:
        rec = {k: float(v) for k, v in m.items()}
        rec.update(episode_metrics(episode_sums(stats), names, max_return))
        rec.update(shared)
        rec.update({
            "hidden/age_mean": float(np.mean([i["age"] for i in seed_infos])),
            "hidden/valid_frac": float(np.mean([i["valid"] for i in seed_infos])),
            "hidden/norm_count": float(norm_count),
        })
        if cfg.pool_size and rec.get("episode/count") is not None:
            # resets per refresh interval / pool worlds: > 1 means worlds were shared (rl/hidden.py)
            rec["hidden/pool_draws_per_world"] = rec["episode/count"] * cfg.skip_n / cfg.num_steps / cfg.pool_size
        recs.append(rec)
    return recs


def _warn_if_llm_bound(wait_s: float, wall_s: float) -> None:
    """After one steady overlapped update: say once if overlap cannot help (the LLM alone is the cycle)."""
    if wait_s <= 0.5 * wall_s:
        return
    from thinkcraft.utils.progress import console

    console.print(f"[yellow]overlap: the loop waited {wait_s:.2f} s of {wall_s:.2f} s for the LLM - it is the "
                  f"bottleneck, and overlap only hides env time behind it (at small skip_n it can cost speed). "
                  f"Faster refreshes: --engine-quantize fp8, an earlier --layer, a larger --skip-n; or run "
                  f"without --overlap")
