"""`thinkcraft collect`: roll out a policy in Craftax and write the visited states as Parquet.

One jitted `lax.scan` of `steps_per_call` steps per call: the policy acts (uniform random, or a `train
ppo` checkpoint), the env steps with exact auto-reset, and the semantic arrays of every visited state
are extracted on device (`envs.text.extract`); the host renders them (compact and craftax text) and
writes one atomic Parquet shard per call. Rows: env, seed, env_index, step (global), episode and
episode_step (per env), action taken, reward, done, compact_text, craftax_text, obs (list<float>).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from thinkcraft.utils.errors import ConfigError, UserError, check


@dataclass
class CollectConfig:
    out: str = "runs/collect"
    """Output folder: Parquet shards `part-*.parquet` (feed it to `thinkcraft label --input`)."""
    env_name: str = "Craftax-Symbolic-v1"
    """Symbolic Craftax env (`Craftax-Symbolic-v1`, `Craftax-Classic-Symbolic-v1`); ignored for ppo policies
    (the checkpoint's env is used)."""
    policy: str = "random"
    """`random` (uniform actions) or `ppo:<run_dir>` (a `thinkcraft train ppo` run; actions sampled)."""
    num_envs: int = 8
    """Parallel environments."""
    num_steps: int = 64
    """Steps per environment."""
    every: int = 1
    """Keep the states of every N-th step (1 = all)."""
    steps_per_call: int = 16
    """Steps per jitted scan (one compile; one shard per call)."""
    obs: bool = True
    """Also store the symbolic observation (8268 floats per Craftax row) as a list<float> column."""
    seed: int = 0
    seed_index: int = 0
    """With `ppo:<run_dir>` of a `--num-seeds K` run: which seed's policy acts (0 .. K-1)."""
    overwrite: bool = False
    """Replace an existing non-empty output folder."""

    def __post_init__(self) -> None:
        check(self.num_envs >= 1, "num_envs", "must be >= 1")
        check(self.num_steps >= 1, "num_steps", "must be >= 1")
        check(self.every >= 1, "every", "must be >= 1")
        check(self.steps_per_call >= 1, "steps_per_call", "must be >= 1")
        check(self.policy == "random" or self.policy.startswith("ppo:"), "policy",
              f"must be 'random' or 'ppo:<run_dir>', not {self.policy!r}")
        if self.policy == "random":
            from thinkcraft.envs.craftax import canonical_env_name

            try:
                name = canonical_env_name(self.env_name)
            except UserError as e:
                raise ConfigError("env_name", str(e)) from None
            check("Symbolic" in name, "env_name", f"{name} has pixel observations; use a Symbolic env")
        else:
            run_dir = Path(self.policy[len("ppo:"):])
            check((run_dir / "config.json").exists(), "policy", f"{run_dir} is not a `train ppo` run dir (no config.json)")
        if self.steps_per_call > self.num_steps:
            self.steps_per_call = self.num_steps


def _make_policy(cfg: CollectConfig) -> tuple[Any, Callable, Any, Any, str]:
    """(VecEnv, act, after_step, initial policy state, env name): `envs.scan.make_env_scan`'s policy (a
    recurrent one carries its memory as the scan's policy state)."""
    if cfg.policy == "random":
        from thinkcraft.envs.craftax import make_env
        from thinkcraft.envs.scan import random_actions

        env = make_env(cfg.env_name, cfg.num_envs, reset_ratio=1)
        return env, random_actions(env), None, None, env.name
    # ppo:<run_dir>: through the evaluation loader (same network, exact resets)
    try:
        from thinkcraft.train.evaluate import load_ppo_policy, make_actor
    except ImportError:  # pragma: no cover - depends on the train package
        raise UserError("--policy ppo:<run_dir> needs thinkcraft.train.evaluate, which is not installed") from None
    env, network, params, tcfg = load_ppo_policy(cfg.policy[len("ppo:"):], cfg.num_envs, cfg.seed_index)
    if "Symbolic" not in env.name:
        raise UserError(f"--policy: the checkpoint's env {env.name} has pixel observations; collect needs Symbolic")
    return (env, *make_actor(network, params, tcfg), env.name)


def _rollout_fn(env: Any, act: Callable, steps: int, after_step: Callable | None = None) -> Callable:
    """Jitted: carry -> (carry, (semantic arrays of the state each action was taken in, obs, action,
    reward, done)), each (T, N, ...)."""
    import jax

    from thinkcraft.envs.scan import make_env_scan
    from thinkcraft.envs.text.semantic import extract

    def record(s: Any) -> Any:
        return extract(s.env_state.env_state), s.obs, s.action, s.reward, s.done

    return jax.jit(make_env_scan(env, act, steps, record, after_step))


def _table(cols: dict[str, Any], obs: np.ndarray | None) -> Any:
    import pyarrow as pa

    t = pa.table(cols)
    if obs is not None:
        flat = pa.array(obs.reshape(-1).astype(np.float32))
        offsets = pa.array(np.arange(0, obs.size + 1, obs.shape[1], dtype=np.int32))
        t = t.append_column("obs", pa.ListArray.from_arrays(offsets, flat))
    return t


def run(cfg: CollectConfig) -> dict[str, Any]:
    """Roll the policy out and write the states (Parquet parts + manifest). One function of timed phases
    (build, resume, chunks, finish) a little over 80 lines: the chunk loop shares their locals."""
    import jax
    import pyarrow.parquet as pq

    from thinkcraft.envs.scan import EnvCarry
    from thinkcraft.envs.text.render import render
    from thinkcraft.utils.io import atomic_path, atomic_write_json
    from thinkcraft.utils.jaxcache import enable_compilation_cache
    from thinkcraft.utils.progress import RunProgress, console
    from thinkcraft.utils.signals import StopRequest
    from thinkcraft.utils.timing import PhaseTimer

    out = Path(cfg.out)
    # one shard per call, named by call index; a rerun into the same folder would mix two rollouts
    if out.exists() and any(out.glob("part-*.parquet")):
        if not cfg.overwrite:
            raise UserError(f"{out} already holds shards; pass --overwrite or choose another --out")
        for p in out.glob("part-*.parquet"):
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    enable_compilation_cache()
    timer = PhaseTimer()
    with timer.phase("build"):
        env, act, after_step, policy_state, env_name = _make_policy(cfg)
        play = _rollout_fn(env, act, cfg.steps_per_call, after_step)
        rng = jax.random.PRNGKey(cfg.seed)
        rng, k = jax.random.split(rng)
        obs, env_state = jax.jit(env.reset)(k)  # eager reset is slower than its (cached) compile
    # reset leaves some leaves weakly typed (player_direction); the scan's output carry is strongly
    # typed, so without this the second call would compile the whole scan again (minutes on CPU)
    carry = jax.tree.map(lambda x: jax.numpy.array(x, dtype=x.dtype), EnvCarry(env_state, obs, rng, policy_state))
    n = cfg.num_envs
    episode = np.zeros(n, np.int64)
    ep_step = np.zeros(n, np.int64)
    rows = 0
    t_global = 0
    num_calls = -(-cfg.num_steps // cfg.steps_per_call)
    with RunProgress(cfg.num_steps * n, "collect", unit="steps") as prog, StopRequest("stopping after the call in flight") as stop:
        for call in range(num_calls):
            with timer.phase("rollout" if call else "compile+rollout"):
                carry, (sem, obs_b, action, reward, done) = play(carry)
                sem, obs_b, action, reward, done = jax.device_get((sem, obs_b, action, reward, done))
            steps = min(cfg.steps_per_call, cfg.num_steps - t_global)
            cols: dict[str, list] = {k: [] for k in ("env", "seed", "env_index", "step", "episode", "episode_step",
                                                     "action", "reward", "done")}
            keep_t = []
            for t in range(steps):
                g = t_global + t
                if g % cfg.every == 0:
                    keep_t.append(t)
                    cols["env"] += [env_name] * n
                    cols["seed"] += [cfg.seed] * n
                    cols["env_index"] += list(range(n))
                    cols["step"] += [g] * n
                    cols["episode"] += episode.tolist()
                    cols["episode_step"] += ep_step.tolist()
                    cols["action"] += action[t].astype(int).tolist()
                    cols["reward"] += reward[t].astype(float).tolist()
                    cols["done"] += done[t].astype(bool).tolist()
                ep_step = np.where(done[t], 0, ep_step + 1)
                episode = episode + done[t]
            t_global += steps
            if keep_t:
                with timer.phase("render"):
                    # (T, N, ...) -> (T*N, ...) rows in (step, env) order, matching `cols`
                    flat = jax.tree.map(lambda a: a[np.asarray(keep_t)].reshape((-1,) + a.shape[2:]), sem)
                    cols["compact_text"] = render(flat, "compact")
                    cols["craftax_text"] = render(flat, "craftax")
                    ob = obs_b[np.asarray(keep_t)].reshape(len(keep_t) * n, -1) if cfg.obs else None
                with timer.phase("write"):
                    table = _table(cols, ob)
                    with atomic_path(out / f"part-{call:05d}.parquet") as tmp:
                        pq.write_table(table, tmp)
                rows += table.num_rows
            prog.update(t_global * n, rows=rows)
            if stop.requested:  # Ctrl-C / SIGTERM: the shards so far are complete; collect does not resume
                num_calls = call + 1
                console.print(f"{stop.name}: stopped after {t_global:,} of {cfg.num_steps:,} steps per env; "
                              f"{out} holds a complete smaller collection (collect does not resume: rerun with --overwrite)")
                break
    report = {"out": str(out), "env": env_name, "policy": cfg.policy, "rows": rows, "num_envs": n,
              "num_steps": t_global, "shards": num_calls, "interrupted": stop.requested, **timer.metrics(),
              "episodes_finished": int(episode.sum()), "config": asdict(cfg)}
    atomic_write_json(out / "_collect.json", report)  # "_": Parquet readers skip it
    console.print(f"collect: wrote {rows:,} states to {out} ({num_calls} shards); "
                  + ", ".join(f"{k} {v:.1f}s" for k, v in timer.metrics().items()))
    return report

