"""Where does the continuous rollout's host time go, outside the model's forwards? (issue 19: ~50 ms a turn of
host-only gaps at 256 envs on an H200 - the env step's host side, the prompts, submit, the prefill's set-up).

    python bench/probes/rollout_host_probe.py                      # CPU: tiny random model, Craftax, 256 envs
    python bench/probes/rollout_host_probe.py --timers             # wall-clock timers (TIMED), no cProfile
    python bench/probes/rollout_host_probe.py --env craftax-classic --num-envs 64 --turns 4

Builds the policy as the Craftax bench does (`bench/llm_policy_craftax.py`'s config, `loop.build_policy`), runs
one rollout to compile, then one under cProfile, and prints the cumulative time of the rollout's host functions
per turn (the model's own forwards listed too, to be left out on a GPU, where they are the device's work).
With --timers, one more rollout to warm the wrappers and one timed: each TIMED function's wall time a turn, without
cProfile's per-call overhead. Writes the top functions (or the timers) to --out (JSON).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


TIMED = (
    "thinkcraft.train.llm_policy.rollout:ChatPrompts.next",
    "thinkcraft.train.llm_policy.rollout:ChatPrompts._encode",
    "thinkcraft.train.llm_policy.rollout:_reply_texts",
    "thinkcraft.train.llm_policy.rollout:_Continuous._submit",
    "thinkcraft.train.llm_policy.rollout:_Continuous._records",
    "thinkcraft.envs.textenvs.craftax:CraftaxTextEnv.step",
    "thinkcraft.envs.textenvs.craftax:CraftaxTextEnv._render",
    "thinkcraft.llm.hf.batcher:Batcher.submit",
    "thinkcraft.llm.hf.iteration:IterationMixin._finish",
    "thinkcraft.llm.hf.iteration:IterationMixin._admit",
    "thinkcraft.llm.hf.iteration:IterationMixin._prefill_eager",
    "thinkcraft.llm.hf.iteration:IterationMixin._start_rows",
)
"""The host functions timed by --timers (module:qualified name); `_admit` includes `_prefill_eager` (the forward)."""


def _install_timers() -> dict[str, list[float]]:
    """Wrap every TIMED function with a wall-clock accumulator: {name: [seconds, calls]}."""
    import functools
    import importlib

    spent: dict[str, list[float]] = {}
    for name in TIMED:
        mod, qual = name.split(":")
        owner: object = importlib.import_module(mod)
        *path, attr = qual.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, attr)

        def timed(*args, __fn=fn, __name=qual, **kw):
            t = time.perf_counter()
            try:
                return __fn(*args, **kw)
            finally:
                acc = spent.setdefault(__name, [0.0, 0])
                acc[0] += time.perf_counter() - t
                acc[1] += 1

        setattr(owner, attr, functools.wraps(fn)(timed))
    return spent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="craftax", choices=["craftax", "craftax-classic"])
    ap.add_argument("--num-envs", type=int, default=256)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--grep", nargs="*", default=["rollout.py", "batcher.py", "render.py", "protocol.py", "iteration.py", "slot_table.py", "chat", "actions.py", "craftax.py", "prompts"],
                    help="also list every function of files whose name holds one of these")
    ap.add_argument("--timers", action="store_true",
                    help="no cProfile: wall-clock timers around the gap's host functions (TIMED) instead, per turn")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rollout_host_probe.json"))
    a = ap.parse_args()
    import llm_policy_craftax as bench

    from thinkcraft.train.llm_policy import loop

    args = bench._args(["--shapes", a.shape, "--num-envs", str(a.num_envs), "--max-turns", str(a.turns),
                        "--env", a.env, "--device", "cpu", "--micro-batch-tokens", "512", "--steps", "1"])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench._config(args, a.shape, a.num_envs, 0, tmp)
        policy = loop.build_policy(cfg)
        seeds = list(range(cfg.prompts_per_step))

        def one() -> float:
            t = time.perf_counter()
            loop.rollout(policy.env, policy.engine, policy.tokenizer, seeds, cfg.group_size, policy.sampling,
                         cfg.history_turns)
            return time.perf_counter() - t

        print(f"first rollout (compiles) {one():.1f} s", flush=True)
        if a.timers:
            spent = _install_timers()
            one()
            spent.clear()
            wall = one()
            print(f"timed rollout {wall:.2f} s, {a.turns} turns, {a.num_envs} envs: host ms a turn (calls a turn)")
            for name, (s_, n) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
                print(f"{s_ * 1e3 / a.turns:9.2f} ({n / a.turns:6.1f})  {name}")
            Path(a.out).write_text(json.dumps({"env": a.env, "num_envs": a.num_envs, "turns": a.turns,
                                               "wall_s": wall, "timers_ms_per_turn": {
                                                   k: v[0] * 1e3 / a.turns for k, v in spent.items()}}, indent=1))
            return 0
        prof = cProfile.Profile()
        prof.enable()
        wall = one()
        prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({"fn": f"{Path(file).name}:{line}:{fn}", "calls": nc, "self_ms_per_turn": tt * 1e3 / a.turns,
                     "cum_ms_per_turn": ct * 1e3 / a.turns})
    rows.sort(key=lambda r: -r["cum_ms_per_turn"])
    print(f"profiled rollout {wall:.2f} s, {a.turns} turns, {a.num_envs} envs: per turn, cumulative / self ms")
    for r in rows[: a.top]:
        print(f"{r['cum_ms_per_turn']:9.2f} {r['self_ms_per_turn']:8.2f} {r['calls']:7d}  {r['fn']}")
    by_self = sorted(rows, key=lambda r: -r["self_ms_per_turn"])[: a.top]
    print("by self time:")
    for r in by_self:
        print(f"{r['cum_ms_per_turn']:9.2f} {r['self_ms_per_turn']:8.2f} {r['calls']:7d}  {r['fn']}")
    picked = [r for r in rows if any(g in r["fn"] for g in a.grep)]
    print("the host's own functions (--grep):")
    for r in picked[: 3 * a.top]:
        print(f"{r['cum_ms_per_turn']:9.2f} {r['self_ms_per_turn']:8.2f} {r['calls']:7d}  {r['fn']}")
    Path(a.out).write_text(json.dumps({"env": a.env, "num_envs": a.num_envs, "turns": a.turns, "wall_s": wall,
                                       "by_cum": rows[: a.top], "by_self": by_self, "picked": picked}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
