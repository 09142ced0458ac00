"""What does one step call of the Craftax text env (the llm-policy env) cost, and where? (issue 19: the env
phase took ~1.0 s of each 2,048-decision step on an H100, ~25 calls of ~40 ms).

    python bench/probes/textenv_step_probe.py --env craftax-classic --num-envs 256
    python bench/probes/textenv_step_probe.py --module-file /tmp/craftax_old.py   # another implementation
        (e.g. `git show 7ede62e:src/thinkcraft/envs/textenvs/craftax.py > /tmp/craftax_old.py`)

Times `step(indices=...)` over random subsets of 64 / 128 / all episodes (the continuous rollout steps the
episodes whose turn came back) and, for the current implementation, its parts: the compiled masked step, the
semantic extraction + device_get, the host renderer, the action parser. Writes
bench/results/textenv_step_probe.json.
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

    env = mod.CraftaxTextEnv(mod.CraftaxTextConfig(env_kind=a.env, max_steps=1 << 30))
    n = a.num_envs
    env.reset(list(range(n)))
    rng = np.random.default_rng(0)

    def step(k: int) -> None:
        idx = sorted(rng.choice(n, k, replace=False).tolist())
        env.step(["Action: noop"] * k, indices=idx)

    row = {"env": a.env, "num_envs": n, "implementation": a.module_file or "package",
           "device": jax.devices()[0].device_kind, "card": card(), "date": today()}
    for k in (n // 4, n // 2, n):
        row[f"step_{k}_ms"] = round(_ms(lambda: step(k)), 2)
    if hasattr(env, "_advance"):
        acts, keep = jnp.zeros(n, jnp.int32), jnp.zeros(n, bool)
        row["masked_step_ms"] = round(_ms(lambda: jax.block_until_ready(
            env._advance(env._keys, env._state, acts, keep))), 2)
        row["extract_get_ms"] = round(_ms(lambda: jax.device_get(env._text.extract(env._state, batched=True))), 2)
        sem = jax.device_get(env._text.extract(env._state, batched=True))
        row["render_all_ms"] = round(_ms(lambda: env._text.render(sem, fmt="compact", env_kind=a.env)), 2)
    row["parse_all_ms"] = round(_ms(lambda: [env._text.parse_action("Action: noop", a.env) for _ in range(n)]), 2)
    print(json.dumps(row, indent=1))
    write_records(a.out, [row], merge_keys=("env", "num_envs", "implementation", "card"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
