"""What does one step call of the Craftax text env (the llm-policy env) cost, and where? (issue 19: the env
phase took ~1.0 s of each 2,048-decision step on an H100, ~25 calls of ~40 ms).

    python bench/probes/textenv_step_probe.py --env craftax-classic --num-envs 256
    python bench/probes/textenv_step_probe.py --module-file /tmp/craftax_old.py   # another implementation
        (e.g. `git show 7ede62e:src/thinkcraft/envs/textenvs/craftax.py > /tmp/craftax_old.py`)

Times `step(indices=...)` over random subsets of 64 / 128 / all episodes (the continuous rollout steps the
episodes whose turn came back) and, for the current implementation, its parts: the compiled masked step, the
semantic extraction + device_get, the host renderer, the action parser. Writes
bench/results/textenv_step_probe.json.

    XLA_FLAGS=... python bench/probes/textenv_step_probe.py --env craftax --device-profile   # on a GPU

On a GPU, --device-profile also runs the full-batch step under torch.profiler (CUPTI sees JAX's kernels too):
kernels and their device time a step, the host's driver/runtime calls a step by name (launches, graph launches,
synchronisations, copies) - whether the step's wall is its kernels, their launches or the host's waits. The
row records XLA_FLAGS and the unroll setting, so runs with other flags are rows of their own.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
from common import card, today, write_records  # noqa: E402


def _ms(f, k: int = 10) -> float:
    for _ in range(3):  # the second step call compiles again (the reset state's weak types differ)
        f()
    t = time.perf_counter()
    for _ in range(k):
        f()
    return (time.perf_counter() - t) / k * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="craftax-classic", choices=["craftax", "craftax-classic"])
    ap.add_argument("--num-envs", type=int, default=256)
    ap.add_argument("--module-file", default=None, help="time this file's CraftaxTextEnv instead of the package's")
    ap.add_argument("--unroll-env-scans", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--device-profile", action="store_true",
                    help="GPU: the full-batch step under torch.profiler (kernels, device time, host API calls a step)")
    ap.add_argument("--dispatch-breakdown", action="store_true",
                    help="the full-batch compiled call fed the ways step() could feed it (its inputs' transfers, "
                         "chained outputs, the old state's release, donation): where a step's 'dispatch' goes")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "textenv_step_probe.json"))
    a = ap.parse_args()
    if a.module_file:
        spec = importlib.util.spec_from_file_location("thinkcraft.envs.textenvs.craftax_probe", a.module_file)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    else:
        import thinkcraft.envs.textenvs.craftax as mod
    import jax
    import jax.numpy as jnp

    import os

    cfg = mod.CraftaxTextConfig(env_kind=a.env, max_steps=1 << 30)
    if hasattr(cfg, "unroll_env_scans"):
        import dataclasses

        cfg = dataclasses.replace(cfg, unroll_env_scans=a.unroll_env_scans)
    t0 = time.perf_counter()
    env = mod.CraftaxTextEnv(cfg)
    n = a.num_envs
    env.reset(list(range(n)))
    env.step(["Action: noop"] * n)  # compiles the step
    compile_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)

    def step(k: int) -> None:
        idx = sorted(rng.choice(n, k, replace=False).tolist())
        env.step(["Action: noop"] * k, indices=idx)

    row = {"env": a.env, "num_envs": n, "implementation": a.module_file or "package",
           "device": jax.devices()[0].device_kind, "card": card(), "date": today(),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "unrolled": bool(getattr(env, "unrolled", False)),
           "first_reset_and_step_s": round(compile_s, 1), "donates_state": getattr(env, "donates_state", None),
           "numpy_inputs": getattr(env, "numpy_inputs", None)}
    for k in (n // 4, n // 2, n):
        before = env.counters()
        row[f"step_{k}_ms"] = round(_ms(lambda: step(k)), 2)
        if k == n and "env_time/steps" in before:  # where the full step's wall goes, by the env's own phases
            after = env.counters()
            steps = after["env_time/steps"] - before["env_time/steps"]
            row["step_phases_ms"] = {key.split("/")[1][:-2]: round((after[key] - before[key]) / steps * 1e3, 2)
                                     for key in after if key.startswith("env_time/") and key.endswith("_s")}
    if hasattr(env, "_advance"):
        acts, keep = jnp.zeros(n, jnp.int32), jnp.zeros(n, bool)
        def advance():  # chained: the env's call may donate its keys and state
            env._keys, env._state, *rest = env._advance(env._keys, env._state, acts, keep)
            return rest

        row["masked_step_ms"] = round(_ms(lambda: jax.block_until_ready(advance())), 2)
        row["extract_get_ms"] = round(_ms(lambda: jax.device_get(env._text.extract(env._state, batched=True))), 2)
        sem = jax.device_get(env._text.extract(env._state, batched=True))
        row["render_all_ms"] = round(_ms(lambda: env._text.render(sem, fmt="compact", env_kind=a.env)), 2)
        # the call's return (the host's enqueueing) apart from its completion
        def dispatch() -> float:
            t = time.perf_counter()
            out = advance()
            d = time.perf_counter() - t
            jax.block_until_ready(out)
            return d

        for _ in range(3):
            dispatch()
        row["masked_step_dispatch_ms"] = round(float(np.median([dispatch() for _ in range(10)])) * 1e3, 2)
    if a.dispatch_breakdown and hasattr(env, "_advance"):
        row["dispatch_breakdown"] = _dispatch_breakdown(env, n)
    row["parse_all_ms"] = round(_ms(lambda: [env._text.parse_action("Action: noop", a.env) for _ in range(n)]), 2)
    if a.device_profile:
        row.update(_device_profile(lambda: env.step(["Action: noop"] * n)))
    print(json.dumps(row, indent=1))
    write_records(a.out, [row], merge_keys=("env", "num_envs", "implementation", "card", "xla_flags", "unrolled",
                                                          "donates_state", "numpy_inputs"))
    return 0


def _dispatch_breakdown(env, n: int, k: int = 10) -> dict:
    """Each way of feeding the compiled full-batch call, `k` times after 3 warm-ups: median ms from the call to its
    return (`call`), for the assignment that drops the previous outputs (`release`), and to the host holding
    reward, done and semantics (`total`). The variants differ from step() in one thing each."""
    import jax
    import jax.numpy as jnp

    acts_np, keep_np = np.zeros(n, np.int32), np.zeros(n, bool)
    acts_dev, keep_dev = jnp.asarray(acts_np), jnp.asarray(keep_np)
    jax.block_until_ready((acts_dev, keep_dev))
    # the env's own call where it matches, one more compile for the other kind
    donates = getattr(env, "donates_state", False)
    pure = env._advance.__wrapped__  # the function jax.jit wrapped
    fn = jax.jit(pure) if donates else env._advance
    donating = env._advance if donates else jax.jit(pure, donate_argnums=(0, 1))
    carry = {"keys": env._keys, "state": env._state}

    def run(feed: str, chained: bool, f=fn) -> dict:  # noqa: ANN001
        times = {"inputs": [], "call": [], "release": [], "fetch": []}
        for i in range(3 + k):
            t0 = time.perf_counter()
            if feed == "asarray":
                acts, keep = jnp.asarray(acts_np), jnp.asarray(keep_np)
            elif feed == "device_put":
                acts, keep = jax.device_put((acts_np, keep_np))
            elif feed == "numpy":
                acts, keep = acts_np, keep_np
            else:
                acts, keep = acts_dev, keep_dev
            t1 = time.perf_counter()
            out = f(carry["keys"], carry["state"], acts, keep)
            t2 = time.perf_counter()
            if chained:
                carry["keys"], carry["state"] = out[0], out[1]  # drops the previous state (its buffers freed)
                out = out[2:]
            t3 = time.perf_counter()
            jax.device_get(out[-3:])
            t4 = time.perf_counter()
            if i >= 3:
                for key, d in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    times[key].append(d)
        med = {key: round(float(np.median(v)) * 1e3, 3) for key, v in times.items()}
        med["total"] = round(sum(med.values()), 3)
        return med

    out = {"same_inputs_device": run("device", chained=False),
           "chained_device": run("device", chained=True),
           "chained_asarray": run("asarray", chained=True),  # step() before 2026-12-07
           "chained_device_put": run("device_put", chained=True),
           "chained_numpy": run("numpy", chained=True)}
    for feed in ("asarray", "numpy"):  # numpy inputs and a donated state: the env's step since 2026-12-07
        try:
            out[f"chained_{feed}_donated"] = run(feed, chained=True, f=donating)
        except Exception as e:  # noqa: BLE001 - a probe: record why
            out[f"chained_{feed}_donated"] = f"{type(e).__name__}: {e}"[:200]
    env._keys, env._state = carry["keys"], carry["state"]
    # step() itself, one call at a time: its dispatch phase's spread (a mean over steps hides a rare long stall)
    per = []
    for i in range(3 + k):
        before = env.counters()["env_time/dispatch_s"]
        idx = env.active_indices()  # episodes end (max_steps is unbounded, deaths are not)
        env.step(["Action: noop"] * len(idx), indices=idx)
        if i >= 3:
            per.append((env.counters()["env_time/dispatch_s"] - before) * 1e3)
    out["step_dispatch_ms_sorted"] = [round(v, 3) for v in sorted(per)]
    return out


def _device_profile(step, steps: int = 5) -> dict:
    """`step` run `steps` times under torch.profiler (CPU and CUDA activities): per step, the kernels' count and
    device time, the wall, and the host's CUDA driver/runtime calls by name (count, host ms)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {"device_profile": "torch not installed"}
    if not torch.cuda.is_available():
        return {"device_profile": "no CUDA device"}
    torch.cuda.init()
    step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - t
    kernels, kernel_us, api = 0, 0.0, {}
    for ev in prof.events():
        dev = str(getattr(ev, "device_type", ""))
        if "CUDA" in dev and "Memcpy" not in ev.name and "Memset" not in ev.name:
            kernels += 1
            kernel_us += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        elif ev.name.startswith(("cu", "cuda")):
            c = api.setdefault(ev.name, [0, 0.0])
            c[0] += 1
            c[1] += ev.cpu_time_total
    top = sorted(api.items(), key=lambda kv: -kv[1][1])[:12]
    return {"profile_steps": steps, "profile_wall_ms_per_step": round(wall / steps * 1e3, 2),
            "kernels_per_step": round(kernels / steps, 1), "kernel_ms_per_step": round(kernel_us / steps / 1e3, 3),
            "host_api_per_step": {k: [round(c / steps, 1), round(us / steps / 1e3, 3)] for k, (c, us) in top}}


if __name__ == "__main__":
    raise SystemExit(main())
