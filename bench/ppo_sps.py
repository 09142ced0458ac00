"""PPO throughput on Craftax: thinkcraft vs Craftax_Baselines, and the environment-only floor, in one run.

    python bench/ppo_sps.py --num-envs 128 1024                       # thinkcraft PPO + env-only
    python bench/ppo_sps.py --num-envs 128 1024 --baselines-dir .ref/Craftax_Baselines --looped  # + the references
    python bench/ppo_sps.py --num-envs 1024 --policy mlp rnn --baselines-dir .ref/Craftax_Baselines  # + the GRU policy

For each num_envs it measures, all with num_steps=64 and Baselines' defaults:
  * `thinkcraft`      — `thinkcraft train ppo`'s jitted chunk (K updates per call), steady SPS and first call
                        (init + compile + first chunk);
  * `thinkcraft-env`  — thinkcraft's VecEnv alone (random actions, optimistic resets, episode logging);
  * with `--looped`, `thinkcraft-looped` and `thinkcraft-looped-env`: the same with craftax's inner loops left
    as loops (`unroll_env_scans=off`; the default, auto, unrolls them on a GPU — envs/unroll.py);
  * `baselines`       — Craftax_Baselines `ppo.py` `make_train` (K updates per call), steady = second call;
  * `baselines-env`   — Baselines' LogWrapper + OptimisticResetVecEnvWrapper alone, random actions;
  * with `--policy rnn`: `thinkcraft-rnn` (`train ppo --policy rnn`'s chunk) and `baselines-rnn` (Baselines'
    `ppo_rnn.py` `make_train`), both with Baselines' defaults (LAYER_SIZE 512, 8 minibatches of envs).
`--baselines-dir` is a checkout of github.com/MichaelTMatthews/Craftax_Baselines (its distrax, wandb, ICM and
logging imports are shimmed here: those paths are off). Writes bench/results/ppo_sps.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import card, print_table, today, write_records  # noqa: E402


def time_env_only(window, reset_carry, repeats: int) -> tuple[float, float]:
    """(first call s, median steady s) of `window(carry) -> carry` (a scan of random-action env steps), jitted.

    A second warm-up call runs before timing: a reset state's weak-typed leaves become strong-typed after
    one call, which retraces once (timing that call would count a compile as steady time)."""
    import jax

    env_only = jax.jit(window)

    t0 = time.perf_counter()
    carry = jax.block_until_ready(env_only(reset_carry))
    first = time.perf_counter() - t0
    carry = jax.block_until_ready(env_only(carry))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(env_only(carry))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def bench_thinkcraft(env_name: str, num_envs: int, updates: int, repeats: int, dtype: str,
                     unroll: str = "auto", env_floor: bool = True, policy: str = "mlp") -> list[dict]:
    import jax

    from thinkcraft.rl.ppo import init_runner_state, make_train_chunk
    from thinkcraft.train.ppo import PPOConfig, build, initial_memory

    cfg = PPOConfig(env_name=env_name, num_envs=num_envs, total_timesteps=1_000_000_000,
                    updates_per_chunk=updates, compute_dtype=dtype, unroll_env_scans=unroll, policy=policy)
    t_start = time.perf_counter()
    env, network, tx = build(cfg)
    init = jax.jit(lambda r: init_runner_state(env, network, tx, r, memory=initial_memory(cfg)))
    runner = init(jax.random.PRNGKey(0))
    jax.block_until_ready(runner)
    chunk = jax.jit(make_train_chunk(env, network.apply, cfg.num_steps, cfg.hyper(), updates), donate_argnums=0)
    t0 = time.perf_counter()
    runner, m = chunk(runner)
    jax.block_until_ready(m)
    first_call_s = time.perf_counter() - t_start
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner, m = chunk(runner)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    steps = updates * cfg.batch_size
    name = ("thinkcraft" + ("" if policy == "mlp" else f"-{policy}") + ("" if env.unroll_env_scans else "-looped")
            + ("" if dtype == "float32" else f"-{dtype}"))
    recs = [{"system": name, "env": env_name, "num_envs": num_envs, "sps_steady": steps / statistics.median(times),
             "first_call_s": first_call_s, "steps_per_call": steps, "unroll_env_scans": env.unroll_env_scans,
             "policy": policy}]
    if not env_floor:
        return recs

    # environment alone, same wrapper and reset ratio, random actions (observations carried, as Baselines')
    from thinkcraft.envs.scan import EnvCarry, make_env_scan, random_actions

    env_only = make_env_scan(env, random_actions(env), updates * cfg.num_steps)
    obs, state = jax.jit(env.reset)(jax.random.PRNGKey(1))
    first, steady = time_env_only(lambda c: env_only(c)[0], EnvCarry(state, obs, jax.random.PRNGKey(2)), repeats)
    recs.append({"system": name + "-env", "env": env_name, "num_envs": num_envs, "sps_steady": steps / steady,
                 "first_call_s": first, "steps_per_call": steps, "unroll_env_scans": env.unroll_env_scans})
    return recs


def _shim_baselines_imports() -> None:
    """Baselines imports distrax (broken under current JAX), chex (annotations), wandb, ICM models and logging
    helpers; the benchmarked code paths use only a Categorical from them."""
    from thinkcraft.rl.distributions import Categorical

    def mod(name: str, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules.setdefault(name, m)
        return m

    mod("distrax", Categorical=Categorical)
    try:
        import chex  # noqa: F401
    except ImportError:  # wrappers.py uses it for annotations only
        mod("chex", PRNGKey=Any, Array=Any)
    mod("wandb")
    mod("logz")
    mod("logz.batch_logging", batch_log=None, create_log_dict=None)
    try:
        import models.icm  # noqa: F401
    except Exception:
        mod("models.icm", ICMEncoder=None, ICMForward=None, ICMInverse=None)
    try:
        from flax.training import orbax_utils  # noqa: F401
        import orbax.checkpoint  # noqa: F401
    except Exception:
        mod("orbax")
        mod("orbax.checkpoint", PyTreeCheckpointer=None, CheckpointManagerOptions=None, CheckpointManager=None)
        import flax.training

        flax.training.orbax_utils = mod("flax.training.orbax_utils")


def bench_baselines(baselines_dir: str, env_name: str, num_envs: int, updates: int, repeats: int,
                    env_floor: bool = True, policy: str = "mlp") -> list[dict]:
    import importlib

    import jax

    sys.path.insert(0, str(Path(baselines_dir).resolve()))
    _shim_baselines_imports()
    # Craftax_Baselines/ppo.py or ppo_rnn.py: the same config keys, the same make_train(config)
    bppo = importlib.import_module("ppo" if policy == "mlp" else "ppo_rnn")
    from wrappers import LogWrapper, OptimisticResetVecEnvWrapper  # Craftax_Baselines/wrappers.py

    config = {
        "ENV_NAME": env_name, "NUM_ENVS": num_envs, "TOTAL_TIMESTEPS": updates * 64 * num_envs, "LR": 2e-4,
        "NUM_STEPS": 64, "UPDATE_EPOCHS": 4, "NUM_MINIBATCHES": 8, "GAMMA": 0.99, "GAE_LAMBDA": 0.8,
        "CLIP_EPS": 0.2, "ENT_COEF": 0.01, "VF_COEF": 0.5, "MAX_GRAD_NORM": 1.0, "ACTIVATION": "tanh",
        "ANNEAL_LR": True, "DEBUG": False, "USE_WANDB": False, "LAYER_SIZE": 512, "USE_OPTIMISTIC_RESETS": True,
        "OPTIMISTIC_RESET_RATIO": 16, "TRAIN_ICM": False, "USE_E3B": False, "SEED": 0, "NUM_REPEATS": 1,
    }
    train = jax.jit(bppo.make_train(config))
    steps = config["TOTAL_TIMESTEPS"]
    t0 = time.perf_counter()
    jax.block_until_ready(train(jax.random.PRNGKey(0)))
    first = time.perf_counter() - t0
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(train(jax.random.PRNGKey(i + 1)))
        times.append(time.perf_counter() - t0)
    recs = [{"system": "baselines" + ("" if policy == "mlp" else f"-{policy}"), "env": env_name, "num_envs": num_envs,
             "sps_steady": steps / statistics.median(times), "first_call_s": first, "steps_per_call": steps,
             "policy": policy}]
    if not env_floor:
        return recs

    from craftax.craftax_env import make_craftax_env_from_name

    base = make_craftax_env_from_name(env_name, False)
    params = base.default_params
    env = OptimisticResetVecEnvWrapper(LogWrapper(base), num_envs=num_envs, reset_ratio=min(16, num_envs))
    num_actions = base.action_space(params).n

    def env_step(carry, _):  # Baselines' wrappers take `params`: not thinkcraft's VecEnv, so its own scan
        state, obs, rng = carry
        rng, k_a, k = jax.random.split(rng, 3)
        a = jax.random.randint(k_a, (num_envs,), 0, num_actions)
        obs, state, r, d, info = env.step(k, state, a, params)
        return (state, obs, rng), None

    obs, state = env.reset(jax.random.PRNGKey(1), params)
    first, steady = time_env_only(lambda c: jax.lax.scan(env_step, c, None, updates * 64)[0],
                                  (state, obs, jax.random.PRNGKey(2)), repeats)
    recs.append({"system": "baselines-env", "env": env_name, "num_envs": num_envs,
                 "sps_steady": steps / steady, "first_call_s": first, "steps_per_call": steps})
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="Craftax-Symbolic-v1")
    ap.add_argument("--num-envs", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--updates", type=int, nargs="+", default=None,
                    help="PPO updates per timed call, one per --num-envs (default: 16 for <=256 envs, else 8)")
    ap.add_argument("--repeats", type=int, default=3, help="steady calls timed (median reported)")
    ap.add_argument("--baselines-dir", default=None, help="Craftax_Baselines checkout to measure alongside")
    ap.add_argument("--bf16", action="store_true", help="also measure thinkcraft with bfloat16 matmuls")
    ap.add_argument("--systems", nargs="+", default=["thinkcraft", "baselines"])
    ap.add_argument("--looped", action="store_true",
                    help="also measure thinkcraft with craftax's inner loops left rolled (unroll_env_scans=off)")
    ap.add_argument("--no-env-floor", action="store_true", help="skip the env-only floors (two compiles fewer per system)")
    ap.add_argument("--policy", nargs="+", default=["mlp"], choices=["mlp", "rnn"],
                    help="policies to measure: mlp (ppo.py) and/or rnn (ppo_rnn.py; GRU, `train ppo --policy rnn`)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ppo_sps.json"))
    args = ap.parse_args()

    from thinkcraft.utils.jaxcache import enable_compilation_cache

    enable_compilation_cache(os.environ.get("JAX_COMPILATION_CACHE_DIR", "/tmp/thinkcraft-jax-cache"))
    updates = args.updates or [16 if n <= 256 else 8 for n in args.num_envs]
    records: list[dict] = []

    def keep(new: list[dict]) -> None:
        """Record and save after every system (a device time limit keeps what was measured)."""
        for r in new:
            r.setdefault("card", card())
            r.setdefault("date", today())
            print({k: r[k] for k in ("system", "num_envs", "sps_steady", "first_call_s")}, flush=True)
        records.extend(new)
        _add_ratios(records)
        write_records(args.out, records, merge_keys=("system", "env", "num_envs", "card"))

    for n, u in zip(args.num_envs, updates):
        for i, policy in enumerate(args.policy):
            floor = not args.no_env_floor and i == 0  # the env floors do not depend on the policy
            if "thinkcraft" in args.systems:
                keep(bench_thinkcraft(args.env, n, u, args.repeats, "float32", env_floor=floor, policy=policy))
                if args.looped:
                    keep(bench_thinkcraft(args.env, n, u, args.repeats, "float32", unroll="off", env_floor=floor,
                                          policy=policy))
                if args.bf16:
                    keep(bench_thinkcraft(args.env, n, u, args.repeats, "bfloat16", env_floor=False, policy=policy))
            if args.baselines_dir and "baselines" in args.systems:
                keep(bench_baselines(args.baselines_dir, args.env, n, u, args.repeats, env_floor=floor, policy=policy))
    print()
    print_table(records, ["system", "env", "num_envs", "sps_steady", "first_call_s", "ratio_to_thinkcraft-env",
                          "ratio_to_baselines-env", "ratio_to_baselines", "card"])


def _add_ratios(records: list[dict]) -> None:
    """Each PPO system's SPS over the env-only floors measured in the same run, and over Baselines' script
    of the same policy (`ratio_to_baselines`)."""
    def same(x: dict, r: dict) -> bool:
        return x["num_envs"] == r["num_envs"] and x["env"] == r["env"]

    for r in records:
        if r["system"].endswith("-env"):
            continue
        for floor in ("thinkcraft-env", "baselines-env"):
            f = [x for x in records if x["system"] == floor and same(x, r)]
            if f:
                r[f"ratio_to_{floor}"] = r["sps_steady"] / f[0]["sps_steady"]
        policy = r.get("policy", "mlp")
        ref = "baselines" + ("" if policy == "mlp" else f"-{policy}")
        b = [x for x in records if x["system"] == ref and same(x, r)]
        if b and r["system"].startswith("thinkcraft"):
            r["ratio_to_baselines"] = r["sps_steady"] / b[0]["sps_steady"]


if __name__ == "__main__":
    main()
