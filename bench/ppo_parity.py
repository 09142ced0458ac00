"""PPO learning parity with Craftax_Baselines: the same env, steps, envs and seeds, ours and theirs run one
after the other on the same card, compared by `thinkcraft compare` (curves with 95% bands, final IQM and
mean with 95% stratified-bootstrap CIs, P(ours > Baselines)); one row per seed in bench/results/ppo_parity.json
`{system: thinkcraft|baselines, policy: mlp|rnn, seed, steps, final_return, ...}`.

    # GPU (source bench/gpu_env.sh first): 5 seeds x 20M steps x 1024 envs each, Craftax-Symbolic
    python bench/ppo_parity.py --policy mlp --baselines-dir .ref/Craftax_Baselines
    # the same in parts (run dirs accumulate under --runs-dir; each call compares all that match):
    python bench/ppo_parity.py --systems thinkcraft
    python bench/ppo_parity.py --systems baselines --seed 0 --seeds 3
    python bench/ppo_parity.py --systems baselines --seed 3 --seeds 2
    python bench/ppo_parity.py --policy rnn ...   # ours needs `train ppo --policy rnn` (issue 18 item 4)
    python bench/ppo_parity.py --quick   # CPU: Craftax-Classic, 16 envs, 2 seeds, tiny nets - the plumbing
    python bench/ppo_parity.py --dry     # no training: tiny fake run dirs through compare and the rows

Ours: `thinkcraft train ppo --num-seeds K` (K seeds vmapped in one program, like Baselines' NUM_REPEATS); on
a checkout whose `train ppo` has no --num-seeds yet, K runs with seeds seed..seed+K-1. Theirs:
bench/baselines_adapter.py runs their unmodified `ppo.py` / `ppo_rnn.py` with `--num_repeats K` and its own
logging. Both get the same env, num_envs, total steps, seed and (in --quick) the same small shapes; every
other hyperparameter is each side's default, and ours are Baselines' (train/ppo.py).

Definitions side by side (Baselines = their ppo.py and its logging; ours = `thinkcraft train ppo`):
* episode return - Baselines: per update, the mean of LogWrapper's `returned_episode_returns` over the
  (step, env) pairs of the update's rollout where an episode ended. Ours: per logged chunk
  (`updates_per_chunk`, default 8, cut to a divisor of the number of updates), the sum of the returns of the
  episodes ended in the chunk over their count: the same episode-weighted mean over a longer window (the
  curves are averaged over that window on both sides: compare --smooth-steps).
* achievement rate - Baselines: `Achievements/x` = 100 x unlocked x done, averaged over ended episodes (the
  adapter divides by 100). Ours: `achievements/x`, the fraction of ended episodes that unlocked x;
  `achievements/mean_rate` is the mean over x on both sides (the adapter computes it).
* step - Baselines: (update + 1) x num_envs x num_steps. Ours: the same count at the chunk's end.
* seeds - Baselines: NUM_REPEATS vmapped, keys split(PRNGKey(seed), K). Ours: --num-seeds K vmapped.
* resets - both optimistic, ratio 16 (num_envs / 16 fresh worlds per step). Baselines: random.choice(p=done)
  picks the done envs that get a unique world when >= num_envs / 16 are done, else an argsort; the other
  done envs share worlds. Ours: done envs ranked from a random offset, the k-th takes world k mod num_envs/16.
  Same distribution of starts.
* lr annealing - both linear to 0: lr x (1 - (count // (minibatches x epochs)) / num_updates).
* initialisation - both orthogonal(sqrt 2) hidden layers, 0.01 actor head, 1.0 critic head, zero biases, 3 x
  512 tanh; the PRNG key splits differ (same distribution).
Final performance = mean of a seed's values over the last 10% of its steps (compare --final-frac): at 20M
steps and 1024 envs (305 updates of 65,536 steps) that is Baselines' last ~30 updates and our last 6 chunks
of 5 updates (8 is cut to 5, a divisor of 305): the same steps, the same expectation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines_adapter import with_cpu_deadlock_flag  # noqa: E402
from common import print_table, run_card, run_date, write_records  # noqa: E402

from thinkcraft.analysis.stats import Interval  # noqa: E402

CURVE_METRICS = ["episode/return", "achievements/mean_rate", "episode/length"]
SCRIPT = {"mlp": "ppo.py", "rnn": "ppo_rnn.py"}
# --quick: both sides get these small shapes (their flag, our flag, value)
QUICK_SHAPES = [("--num_steps", "--num-steps", 16), ("--layer_size", "--layer-width", 64)]


def ours_supports(field: str) -> bool:
    from thinkcraft.train.ppo import PPOConfig

    return field in {f.name for f in dataclasses.fields(PPOConfig)}


def run_logged(cmd: list[str], log_path: Path) -> float:
    """Run `cmd` (output to the console and `log_path`); wall seconds. A failure stops the script."""
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        # both sides vmap an orthogonal init over seeds: on a CPU that needs the flag (baselines_adapter)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=with_cpu_deadlock_flag(dict(os.environ)))
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        if proc.wait():
            raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(cmd)}; log: {log_path}")
    return time.perf_counter() - t0


def seeds_tag(a: argparse.Namespace) -> str:
    return f"s{a.seed}-{a.seed + a.seeds - 1}"


def run_ours(a: argparse.Namespace, runs: Path) -> float:
    """`thinkcraft train ppo` for K seeds: one --num-seeds K run, or K runs where that flag does not exist yet."""
    base = [sys.executable, "-m", "thinkcraft", "train", "ppo", "--env-name", a.env, "--num-envs", str(a.num_envs),
            "--total-timesteps", str(a.steps), "--runs-dir", str(runs), "--overwrite", "--no-plot"]
    if a.policy != "mlp":
        if not ours_supports("policy"):
            raise SystemExit(f"--policy {a.policy}: this checkout's `train ppo` has no --policy yet")
        base += ["--policy", a.policy]
    if a.quick:
        base += [x for _, ours, v in QUICK_SHAPES for x in (ours, str(v))]
    if ours_supports("num_seeds"):
        name = f"thinkcraft-{a.policy}-{seeds_tag(a)}"
        cmd = base + ["--seed", str(a.seed), "--num-seeds", str(a.seeds), "--run-name", name]
        return run_logged(cmd, runs / f"{name}.log")
    print(f"note: `train ppo` has no --num-seeds here: {a.seeds} separate runs")
    wall = 0.0
    for i in range(a.seeds):
        name = f"thinkcraft-{a.policy}-s{a.seed + i}"
        wall += run_logged(base + ["--seed", str(a.seed + i), "--run-name", name], runs / f"{name}.log")
    return wall


def run_theirs(a: argparse.Namespace, runs: Path) -> float:
    name = f"baselines-{a.policy}-{seeds_tag(a)}"
    their = ["--env_name", a.env, "--num_envs", str(a.num_envs), "--total_timesteps", str(a.steps),
             "--num_repeats", str(a.seeds), "--seed", str(a.seed)]
    if a.quick:
        their += [x for theirs, _, v in QUICK_SHAPES for x in (theirs, str(v))]
    cmd = [sys.executable, str(ROOT / "bench" / "baselines_adapter.py"), "--baselines-dir", a.baselines_dir,
           "--script", SCRIPT[a.policy], "--out", str(runs / name), "--overwrite", "--", *their]
    return run_logged(cmd, runs / f"{name}.log")


def write_fake_runs(a: argparse.Namespace, runs: Path) -> None:
    """--dry: K-seed run dirs of both systems in the real layout, with made-up curves (analysis.testing)."""
    from thinkcraft.analysis.testing import write_fake_run

    shared = {"env_name": a.env, "num_envs": a.num_envs, "total_timesteps": a.steps}
    log_every = max(a.steps // 40, 1)
    write_fake_run(runs / f"thinkcraft-{a.policy}-{seeds_tag(a)}", {**shared, "policy": a.policy},
                   num_seeds=a.seeds, total_steps=a.steps, log_every=log_every, final_return=10.0, seed=a.seed)
    write_fake_run(runs / f"baselines-{a.policy}-{seeds_tag(a)}", {**shared, "system": "baselines", "policy": a.policy},
                   num_seeds=a.seeds, total_steps=a.steps, log_every=log_every, final_return=10.5, seed=a.seed,
                   noise_seed=a.seed + 1000)


def find_run_dirs(a: argparse.Namespace, runs: Path) -> list[Path]:
    """Every run dir of this policy under `runs` (from this call or earlier ones: seeds may come in batches)
    whose env, num_envs and steps are this call's; others are listed and left out."""
    found, other = [], []
    for d in sorted([*runs.glob(f"thinkcraft-{a.policy}-s*"), *runs.glob(f"baselines-{a.policy}-s*")]):
        if not (d / "metrics.jsonl").exists() or not (d / "config.json").exists():
            continue
        c = json.loads((d / "config.json").read_text())
        same = (c.get("env_name"), c.get("num_envs"), c.get("total_timesteps")) == (a.env, a.num_envs, a.steps)
        (found if same else other).append(d)
    if other:
        print(f"left out (other env / num_envs / steps): {', '.join(d.name for d in other)}")
    return found


def logging_window(run_dirs: list[Path]) -> float:
    """Steps per logged record of our run (a chunk of updates): the window the curves of both systems are
    averaged over (Baselines logs every update; its curve would look noisier by that alone)."""
    for d in run_dirs:
        cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
        derived = cfg.get("_derived", {})
        if cfg.get("system", "thinkcraft") == "thinkcraft" and "chunk_updates" in derived:
            return float(derived["chunk_updates"] * derived["batch_size"])
    return 0.0


def verdict(ours: Interval, theirs: Interval) -> str:
    """Where our IQM falls against Baselines' IQM interval (the issue's goal: inside or above)."""
    if ours.point > theirs.high:
        return "above"
    return "inside" if ours.point >= theirs.low else "below"


def summarise(a: argparse.Namespace, run_dirs: list[Path], out: Path) -> list[dict]:
    """compare: curves + tables (PNG/JSON in `out`), then per-achievement finals; returns the result rows."""
    from thinkcraft.analysis.compare import CompareConfig, compare_groups, load_groups
    from thinkcraft.analysis.compare import run as compare_run
    from thinkcraft.analysis.report import write_comparison_json

    dirs = [str(d) for d in run_dirs]
    common = dict(group_by="system", bootstrap_samples=a.bootstrap_samples, seed=0)
    compare_run(CompareConfig(dirs, metric=CURVE_METRICS, out=str(out), smooth_steps=logging_window(run_dirs), **common))
    cfg = CompareConfig(dirs, metric=["achievements/*"], out=str(out), plot=False, **common)
    groups, fields, _ = load_groups(cfg)
    ach = compare_groups(groups, fields, cfg)
    write_comparison_json(out / "achievements.json", ach, cfg)
    res = json.loads((out / "compare.json").read_text())
    by_system = {g["label"].split("=", 1)[1]: g for g in res["groups"]}
    if {"thinkcraft", "baselines"} <= set(by_system):
        p_better = {d["x"]: d for d in res["probability_of_improvement"]["episode/return"]}
        for m in ("episode/return", "achievements/mean_rate"):
            (o, no), (t, nt) = ((Interval(**by_system[s]["metrics"][m]["iqm"]), by_system[s]["metrics"][m]["n_seeds"])
                                for s in ("thinkcraft", "baselines"))
            print(f"{m}: ours IQM {o.point:.4g} ({no} seeds) is {verdict(o, t)} Baselines' IQM 95% CI "
                  f"[{t.low:.4g}, {t.high:.4g}] ({nt} seeds)")
        pb = p_better.get("system=thinkcraft") or p_better.get("system=baselines")
        if pb:
            print(f"P({pb['x']} > {pb['y']}) on the final return: {pb['p']:.2f} [{pb['low']:.2f}, {pb['high']:.2f}]")
        print_achievement_table(ach)
    rows = []
    for system, g in by_system.items():
        m = g["metrics"]["episode/return"]
        rates = {f["run"]: f["final"] for f in g["metrics"].get("achievements/mean_rate", {}).get("finals", [])}
        for f in m["finals"]:
            run_dir = f["run"].split("[")[0]
            rows.append({"system": system, "policy": a.policy, "seed": f["seed"], "steps": int(f["steps"]),
                         "final_return": f["final"], "final_achievement_mean_rate": rates.get(f["run"]),
                         "env": a.env, "num_envs": a.num_envs, "run": f["run"],
                         "mode": "dry" if a.dry else "quick" if a.quick else "full",
                         "card": run_card(run_dir), "date": run_date(run_dir),
                         "compare_dir": str(out)})
    return rows


def print_achievement_table(ach: Any) -> None:
    """Final achievement rates per system: mean [95% CI] over seeds, one row per achievement."""
    systems = [g for g in ach.groups]
    rows = []
    for metric, per_group in ach.results.items():
        if metric == "achievements/mean_rate":
            continue
        row = {"achievement": metric.split("/", 1)[1]}
        for g in systems:
            c = per_group.get(g)
            row[g.split("=", 1)[-1]] = "-" if c is None else f"{c.mean.point:.3f} [{c.mean.low:.3f}, {c.mean.high:.3f}]"
        rows.append(row)
    print_table(rows, ["achievement"] + [g.split("=", 1)[-1] for g in systems])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", choices=sorted(SCRIPT), default="mlp")
    ap.add_argument("--env", default="Craftax-Symbolic-v1")
    ap.add_argument("--steps", type=int, default=20_000_000, help="env steps per seed")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="first seed (ours: seed..seed+K-1; Baselines: split(PRNGKey(seed), K))")
    ap.add_argument("--num-envs", type=int, default=1024)
    ap.add_argument("--baselines-dir", default=str(ROOT / ".ref" / "Craftax_Baselines"))
    ap.add_argument("--systems", nargs="*", choices=["thinkcraft", "baselines"], default=["thinkcraft", "baselines"],
                    help="which to run now (none: only compare); every matching run dir under --runs-dir is compared, "
                         "so seeds can come in batches (--seed 0 --seeds 3, then --seed 3 --seeds 2)")
    ap.add_argument("--runs-dir", default=None, help="default: runs/parity (--quick, --dry: runs/parity-quick, -dry)")
    ap.add_argument("--results", default=None, help="default: bench/results/ppo_parity.json "
                    "(--quick / --dry: <runs-dir>/ppo_parity.json)")
    ap.add_argument("--bootstrap-samples", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="CPU plumbing check: Classic, 16 envs, 2 seeds, tiny nets")
    ap.add_argument("--dry", action="store_true", help="no training: fake run dirs through compare and the rows")
    a = ap.parse_args(argv)
    if a.quick or a.dry:
        a.env, a.num_envs, a.seeds = "Craftax-Classic-Symbolic-v1", 16, 2
        a.steps = 16 * 16 * 32  # 32 updates of 16 envs x 16 steps
    runs = Path(a.runs_dir or ("runs/parity-dry" if a.dry else "runs/parity-quick" if a.quick else "runs/parity"))
    runs.mkdir(parents=True, exist_ok=True)
    results = Path(a.results or (runs / "ppo_parity.json" if a.dry or a.quick else
                                 ROOT / "bench" / "results" / "ppo_parity.json"))

    if a.dry:
        write_fake_runs(a, runs)
    for system, fn in (("thinkcraft", run_ours), ("baselines", run_theirs)):
        if system in a.systems and not a.dry:
            print(f"{system}: {a.seeds} seeds x {a.steps:,} steps in {fn(a, runs):.0f} s (compile included)")
    dirs = find_run_dirs(a, runs)
    if not dirs:
        raise SystemExit(f"no run dirs for policy {a.policy} under {runs}")
    rows = summarise(a, dirs, runs / f"compare-{a.policy}")
    print_table(rows, ["system", "policy", "seed", "steps", "final_return", "final_achievement_mean_rate"])
    write_records(results, rows, merge_keys=("system", "policy", "env", "num_envs", "seed", "mode"))
    print(f"wrote {results} and {runs / f'compare-{a.policy}'}/ (compare.png, compare.json, achievements.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
