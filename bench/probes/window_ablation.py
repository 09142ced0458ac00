"""Where ppo-hidden's env+policy window loses time against plain PPO's rollout (no LLM involved).

The same `rl.ppo.make_rollout` scan of `--num-steps` env+policy steps, timed alone (jit, compile excluded,
median of `--repeats` calls), for:

  * plain     ActorCritic on the symbolic observation (what `train ppo` scans)
  * aug       ActorCriticAug + HiddenAux of width `--hidden` (what `train ppo-hidden` scans per window)
  * aug-h8    the same with an 8-wide hidden state: isolates the cost of the hidden state's width
              (its projection, and storing it in the trajectory at every step)

    python bench/probes/window_ablation.py --num-envs 128 --num-steps 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ (common.py)
from common import card, print_table, today, write_records  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="Craftax-Symbolic-v1")
    ap.add_argument("--num-envs", type=int, default=128)
    ap.add_argument("--num-steps", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=2560, help="hidden size of the aug variant (Qwen3-4B: 2560)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=["plain", "aug", "aug-h8"])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "window_ablation.json"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from thinkcraft.envs.craftax import make_env
    from thinkcraft.rl.hidden import AugInput, HiddenAux, aux_after_step, make_policy_input
    from thinkcraft.rl.networks import ActorCritic, ActorCriticAug
    from thinkcraft.rl.ppo import RolloutState, make_rollout
    from thinkcraft.utils.jaxcache import enable_compilation_cache

    enable_compilation_cache(os.environ.get("JAX_COMPILATION_CACHE_DIR", "/tmp/thinkcraft-jax-cache"))
    n, t = args.num_envs, args.num_steps
    env = make_env(args.env, n, min(16, n))
    obs, env_state = jax.jit(env.reset)(jax.random.PRNGKey(0))
    records = []
    for name in args.variants:
        if name == "plain":
            net = ActorCritic(env.num_actions)
            params = net.init(jax.random.PRNGKey(1), obs[:1])
            rollout = make_rollout(env, net.apply, t)
            aux = None
        else:
            h = 8 if name == "aug-h8" else args.hidden
            net = ActorCriticAug(env.num_actions)
            sample = AugInput(obs[:1], jnp.zeros((1, h)), jnp.zeros((1,)), jnp.zeros((1,)))
            params = net.init(jax.random.PRNGKey(1), sample)
            rollout = make_rollout(env, net.apply, t, make_policy_input(float(t)), aux_after_step)
            aux = HiddenAux(jax.random.normal(jax.random.PRNGKey(2), (n, h)), jnp.zeros((n,), jnp.int32),
                            jnp.ones((n,), bool))
        rs = jax.device_put(RolloutState(env_state, obs, aux, jax.random.PRNGKey(3)), jax.devices()[0])
        fn = jax.jit(rollout)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, rs))
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            rs, _, _ = fn(params, rs)
            jax.block_until_ready(rs.obs)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        records.append({"variant": name, "env": args.env, "num_envs": n, "num_steps": t,
                        "window_ms": 1e3 * med, "ms_per_step": 1e3 * med / t, "sps": n * t / med,
                        "window_ms_all": [round(1e3 * x, 2) for x in times], "compile_s": compile_s,
                        "card": card(), "date": today()})
        print_table(records[-1:], ["variant", "num_envs", "num_steps", "window_ms", "ms_per_step", "sps", "compile_s"])
    write_records(args.out, records, merge_keys=("variant", "env", "num_envs", "num_steps", "card", "date"))
    print_table(records, ["variant", "num_envs", "num_steps", "window_ms", "ms_per_step", "sps"])


if __name__ == "__main__":
    main()
