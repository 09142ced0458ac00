"""`thinkcraft eval <run_dir>`: run a trained policy for M episodes; report return and achievements."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tyro

from thinkcraft.utils.errors import UserError, check


@dataclass
class EvalConfig:
    run_dir: tyro.conf.Positional[str]
    """A run directory written by `thinkcraft train ppo`."""
    episodes: int = 32
    """Episodes to evaluate (the first M that finish)."""
    num_envs: int = 32
    """Parallel environments."""
    greedy: bool = False
    """Take the most likely action instead of sampling."""
    seed: int = 12345
    """Seed of the evaluation worlds and action sampling."""
    steps_per_call: int = 256
    """Env steps per jitted call (progress granularity)."""
    max_steps_per_env: int = 100_000
    """Give up after this many steps per env (Craftax episodes end by 10,000 steps)."""
    out: str | None = None
    """Where to write the JSON report (default: <run_dir>/eval.json)."""
    seed_index: int = 0
    """Which seed of a `--num-seeds K` run to evaluate (0 .. K-1; seed_index i was trained with seed + i)."""

    def __post_init__(self) -> None:
        check(self.episodes > 0, "episodes", "must be > 0")
        check(self.num_envs > 0, "num_envs", "must be > 0")
        check(self.steps_per_call > 0, "steps_per_call", "must be > 0")
        check(self.seed_index >= 0, "seed_index", "must be >= 0")
        check_evaluable(self.run_dir)


def check_evaluable(run_dir: str | Path) -> None:
    """Refuse, in milliseconds and before JAX or craftax load, a directory that is not a `train ppo` run with
    a checkpoint: missing, no config.json (not a run dir), another command's run, or no checkpoint yet."""
    from thinkcraft.train.ppo import PPOConfig

    d = Path(run_dir)
    what = "`thinkcraft eval` takes the run directory of a `thinkcraft train ppo` run"
    if not d.is_dir():
        raise UserError(f"{d}: no such directory; {what}")
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"{d} is not a run directory (no config.json); {what}")
    try:
        saved = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{cfg_path} cannot be read ({e}); {what}") from None
    if not isinstance(saved, dict):
        raise UserError(f"{cfg_path} is not a run config (a JSON object); {what}")
    extra = set(saved) - {f.name for f in dataclasses.fields(PPOConfig)} - {"_derived"}
    if extra or "env_name" not in saved:
        kind = "llm-policy" if "algo" in saved else "ppo-hidden" if "skip_n" in saved else None
        raise UserError(f"{d} is {f'a `train {kind}` run' if kind else 'a run of another command'}, not a `train ppo` run; "
                        f"{what}")
    from thinkcraft.train.checkpoint import has_checkpoint

    if not has_checkpoint(d):  # verified checkpoints: checkpoint/<update>/params.msgpack, named by latest.json
        raise UserError(f"{d} has no checkpoint (checkpoint/latest.json): the run stopped before its first one, "
                        f"so there is nothing to evaluate")


def load_ppo_policy(run_dir: str | Path, num_envs: int, seed_index: int = 0):
    """(env, network, params, train config) of a `train ppo` run - of seed `seed_index` of a `--num-seeds K`
    run (its checkpoint holds all K; the config's `seed` is then that seed's); env uses exact resets
    (ratio 1). Act with `make_actor`."""
    import jax

    from thinkcraft.rl.ppo import init_params
    from thinkcraft.train.checkpoint import load_config_dict, load_params
    from thinkcraft.train.ppo import PPOConfig, build_env, build_network, initial_memory

    saved = load_config_dict(run_dir)
    known = {f.name for f in dataclasses.fields(PPOConfig)}
    cfg = PPOConfig(**{k: v for k, v in saved.items() if k in known})
    K = cfg.num_seeds
    if not 0 <= seed_index < K:
        raise UserError(f"--seed-index {seed_index}: {run_dir} holds {K} seed(s) (seed indices 0..{K - 1})")
    cfg = dataclasses.replace(cfg, num_envs=num_envs, optimistic_reset_ratio=1,
                              total_timesteps=max(cfg.total_timesteps, num_envs * cfg.num_steps),
                              num_minibatches=1, stop_after_updates=0, seed=cfg.seed + seed_index, num_seeds=1,
                              devices=1, coordinator_address=None, num_processes=None, process_id=None)
    env = build_env(cfg)
    network = build_network(cfg, env)

    # the parameters' shapes only (nothing runs); a K-seed checkpoint stacks them on a leading axis
    x = jax.ShapeDtypeStruct((1, env.obs_dim), np.float32)
    template = jax.eval_shape(lambda k, x: init_params(network, k, x, initial_memory(cfg)), jax.random.PRNGKey(0), x)
    stacked = jax.tree.map(lambda x: np.zeros((K,) * (K > 1) + x.shape, x.dtype), template)
    params = load_params(run_dir, stacked)
    return env, network, (params if K == 1 else jax.tree.map(lambda x: x[seed_index], params)), cfg


def make_actor(network: Any, params: Any, cfg: Any, greedy: bool = False):
    """`(act, after_step, policy_state)` for `envs.scan.make_env_scan`: a sampled (or greedy) action from the
    policy; for --policy rnn its memory (initially zeros) as the scan's `policy_state`, reset after done."""
    from thinkcraft.rl.ppo import policy_step
    from thinkcraft.train.ppo import initial_memory

    def choose(pi, key):
        return pi.mode() if greedy else pi.sample(seed=key)

    memory = initial_memory(cfg)
    if memory is None:
        return (lambda obs, key: choose(network.apply(params, obs)[0], key)), None, None

    def act(obs, key, memory):
        memory, pi, _ = policy_step(network.apply, params, obs, memory)
        return choose(pi, key), memory

    return act, (lambda memory, done: memory._replace(reset=done)), memory


def run(cfg: EvalConfig) -> dict[str, Any]:
    import jax

    from thinkcraft.envs.craftax import achievement_names, achievement_weights
    from thinkcraft.envs.scan import EnvCarry, make_env_scan
    from thinkcraft.utils.jaxcache import enable_compilation_cache
    from thinkcraft.utils.progress import RunProgress, console

    run_dir = Path(cfg.run_dir)
    check_evaluable(run_dir)  # again: run() may be called without the CLI
    enable_compilation_cache()
    env, network, params, tcfg = load_ppo_policy(run_dir, cfg.num_envs, cfg.seed_index)
    act, after_step, memory = make_actor(network, params, tcfg, cfg.greedy)
    play = jax.jit(make_env_scan(env, act, cfg.steps_per_call, record=lambda s: s.info, after_step=after_step))
    rng = jax.random.PRNGKey(cfg.seed)
    rng, k = jax.random.split(rng)
    obs, env_state = env.reset(k)
    carry = EnvCarry(env_state, obs, rng, memory)
    returns: list[float] = []
    lengths: list[int] = []
    achievements: list[np.ndarray] = []
    t0 = time.perf_counter()
    steps = 0
    with RunProgress(cfg.episodes, f"eval {run_dir.name}", unit="episodes") as progress:
        while len(returns) < cfg.episodes:
            if steps >= cfg.max_steps_per_env:
                raise UserError(f"only {len(returns)} episodes finished in {steps} steps per env")
            carry, info = play(carry)
            info = jax.device_get(info)
            steps += cfg.steps_per_call
            t_idx, e_idx = np.nonzero(info.done)
            order = np.lexsort((e_idx, t_idx))  # time order, then env index
            for t, e in zip(t_idx[order], e_idx[order]):
                returns.append(float(info.episode_return[t, e]))
                lengths.append(int(info.episode_length[t, e]))
                achievements.append(info.achievements[t, e])
            progress.update(min(len(returns), cfg.episodes))
    returns, lengths = returns[: cfg.episodes], lengths[: cfg.episodes]
    ach = np.stack(achievements[: cfg.episodes]).astype(np.float64)
    names = achievement_names(tcfg.env_name)
    max_return = sum(achievement_weights(tcfg.env_name))
    report = {
        "run_dir": str(run_dir),
        "seed_index": cfg.seed_index,
        "env_name": tcfg.env_name,
        "episodes": cfg.episodes,
        "greedy": cfg.greedy,
        "return_mean": float(np.mean(returns)),
        "return_std": float(np.std(returns)),
        "return_pct_max": float(100 * np.mean(returns) / max_return),
        "length_mean": float(np.mean(lengths)),
        "achievement_rates": {n: float(r) for n, r in zip(names, ach.mean(0))},
        "seconds": time.perf_counter() - t0,
    }
    from rich.table import Table

    table = Table(title=f"{run_dir.name}: {cfg.episodes} episodes ({'greedy' if cfg.greedy else 'sampled'})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("return", f"{report['return_mean']:.2f} ± {report['return_std']:.2f}")
    table.add_row("% of max return", f"{report['return_pct_max']:.2f}")
    table.add_row("length", f"{report['length_mean']:.1f}")
    for n, r in report["achievement_rates"].items():
        if r > 0:
            table.add_row(f"achievement {n}", f"{100 * r:.1f}%")
    console.print(table)
    out = Path(cfg.out) if cfg.out else run_dir / "eval.json"
    from thinkcraft.utils.io import atomic_write_json

    atomic_write_json(out, report)
    return report
