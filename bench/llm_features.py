"""Do an LLM's hidden states help the policy? (issue 18, item 6). Three arms on Craftax-Classic-Symbolic and
Craftax-Symbolic, the same env steps, envs, rollout length and seeds:

    ppo         plain PPO (`train ppo`)
    llm         ppo-hidden with the bundled SmolLM2-135M-Instruct's real weights (`--engine hf:default`)
    random-llm  ppo-hidden with the same model re-initialised by its own initialiser (`--engine-random-weights
                SEED`, the run's first seed: one random model for the seeds of a vmapped run, one per seed
                with --seed-mode separate): same architecture, tokenizer and input width, no pretrained knowledge -
                the control that separates "an LLM's knowledge" from "more inputs"
    blank       (not run by default: `--arm blank`) ppo-hidden with zeros in place of the hidden states
                (`--hidden-input zeros`): the same network, reset pool and schedule with no text features - it
                splits what ppo and random-llm differ by into "an encoding of the text" and ppo-hidden's other
                differences (the projection layer, resets drawn from a pool of fresh worlds)

Every (env, arm) is an independent, resumable process (`thinkcraft train ... --resume --run-dir`), so runs cut
by a time limit continue where their last checkpoint left them. Subcommands:

    python bench/llm_features.py run --gpu 0 --env classic --arm llm --background   # detached, pinned to GPU 0
    python bench/llm_features.py run --gpu 1 --time-limit-min 9    # what is left, in turn; SIGINT at 9 min
    python bench/llm_features.py status                           # steps done per run
    python bench/llm_features.py collect                          # rows + `thinkcraft compare` per env
    python bench/llm_features.py estimate                         # GPU: measured prefill rate -> LLM time
    python bench/llm_features.py --quick                          # CPU: all of it on tiny Classic, minutes

`run` starts what has no run dir, resumes what has a checkpoint short of the total, restarts what died before
its first checkpoint, and skips what is finished or running (a lock file per run). `--time-limit-min M`: at M
minutes the running child gets SIGINT (it stops after its update or chunk and checkpoints; during the engine
load or the compile it stops at once) and no new one starts.
Seeds: `--seed-mode vmapped` = one `--num-seeds K` run per (env, arm) (once `train ppo`/`ppo-hidden` have it);
`separate` = K runs; `auto` picks vmapped where the configs have `num_seeds`.
`collect` writes bench/results/llm_features.json rows `{env, arm, seed, steps, final_return, ...}` (final =
compare's: mean over the last 10% of a seed's steps) and compare's PNG/JSON/tables under <runs-dir>/compare-<env>.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import card, print_table, run_card, run_date, write_records  # noqa: E402

ENVS = {"classic": "Craftax-Classic-Symbolic-v1", "craftax": "Craftax-Symbolic-v1"}
ARMS = ("ppo", "llm", "random-llm", "blank")
DEFAULT_ARMS = ARMS[:3]  # the three; blank is the follow-up ablation
CURVE_METRICS = ["episode/return", "achievements/mean_rate", "episode/length"]
# --quick: tiny Classic on the CPU (skip_n must divide num_steps; chunks of 2 so that a run can stop at 2)
QUICK = dict(envs=["classic"], seeds=2, num_envs=8, num_steps=16, skip_n=8, total_timesteps=8 * 16 * 8,
             extra=["--layer-width", "64", "--num-minibatches", "2", "--updates-per-chunk", "2"],
             hidden_extra=["--hidden-proj-dim", "16", "--layer", "2"])  # layer 2 of 30: a CPU-cheap LLM call


@dataclasses.dataclass(frozen=True)
class Job:
    """One process: an (env, arm) with one seed (separate) or K seeds (vmapped)."""

    env: str
    arm: str
    seeds: tuple[int, ...]
    vmapped: bool

    @property
    def name(self) -> str:
        return f"{self.env}-{self.arm}" + ("" if self.vmapped else f"-s{self.seeds[0]}")

    def argv(self, a: argparse.Namespace) -> list[str]:
        """`thinkcraft train ...` arguments of a fresh start."""
        cmd = ["train", "ppo" if self.arm == "ppo" else "ppo-hidden", "--env-name", ENVS[self.env],
               "--num-envs", str(a.num_envs), "--num-steps", str(a.num_steps),
               "--total-timesteps", str(a.total_timesteps), "--seed", str(self.seeds[0]), *a.extra]
        if self.vmapped:
            cmd += ["--num-seeds", str(len(self.seeds))]
        if self.arm != "ppo":
            cmd += ["--skip-n", str(a.skip_n), "--engine", a.engine, *a.hidden_extra]
        if self.arm == "random-llm":
            cmd += ["--engine-random-weights", str(self.seeds[0])]
        if self.arm == "blank":
            cmd += ["--hidden-input", "zeros"]
        return cmd


def supports_num_seeds() -> bool:
    from thinkcraft.train.ppo import PPOConfig
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig

    return all("num_seeds" in {f.name for f in dataclasses.fields(c)} for c in (PPOConfig, PPOHiddenConfig))


def make_jobs(a: argparse.Namespace) -> list[Job]:
    vmapped = a.seed_mode == "vmapped" or (a.seed_mode == "auto" and supports_num_seeds())
    if vmapped and not supports_num_seeds():
        raise SystemExit("--seed-mode vmapped: this checkout's `train ppo` / `ppo-hidden` have no --num-seeds yet; "
                         "use --seed-mode separate")
    seeds = tuple(range(a.first_seed, a.first_seed + a.seeds))
    groups = [seeds] if vmapped else [(s,) for s in seeds]
    return [Job(e, arm, g, vmapped) for e in a.envs for arm in a.arms for g in groups]


# --- run dirs --------------------------------------------------------------------------------------------

def job_state(run_dir: Path) -> tuple[str, int, int | None]:
    """(new | broken | partial | done, env steps checkpointed, total steps or None)."""
    from thinkcraft.train.checkpoint import has_checkpoint, latest_meta

    if not (run_dir / "config.json").exists():
        return "new", 0, None
    derived = json.loads((run_dir / "config.json").read_text()).get("_derived", {})
    total = derived["num_updates"] * derived["batch_size"] if {"num_updates", "batch_size"} <= derived.keys() else None
    if not has_checkpoint(run_dir):
        return "broken", 0, total  # died before its first checkpoint: start it again
    steps = int((latest_meta(run_dir) or {}).get("env_steps", 0))
    return ("done" if total is not None and steps >= total else "partial"), steps, total


def command_for(job: Job, a: argparse.Namespace, runs: Path) -> list[str] | None:
    state, _, total = job_state(runs / job.name)
    base = [sys.executable, "-m", "thinkcraft"]
    run_dir = ["--run-dir", str(runs / job.name)]
    if state in ("done", "partial") and total is not None and total != a.total_timesteps:
        # every arm must train the same steps: a run made for another total is started again
        print(f"{job.name}: its run was made for {total:,} steps per seed, not {a.total_timesteps:,}: started again")
        return base + [*job.argv(a), *run_dir, "--overwrite", *a.session_flags]
    if state == "done":
        return None
    if state == "partial":  # the saved config holds every shape field; these only change the checkpoint cadence
        # (--resume-fallback: a checkpoint torn by a hard kill falls back to the one before it)
        return base + [*job.argv(a)[:2], "--resume", *run_dir, "--resume-fallback", *a.session_flags]
    return base + [*job.argv(a), *run_dir, "--overwrite", *a.session_flags]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def take_lock(path: Path) -> bool:
    """Create `path` holding our pid; False if a live process holds it (a stale lock is taken over)."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(path.read_text() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _alive(pid):
                return False
            path.unlink(missing_ok=True)
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def child_env(gpu: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # several runs may share a GPU (and torch shares it with JAX in the LLM arms): no up-front grab
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def run_child(cmd: list[str], log_path: Path, gpu: str | None, deadline: float | None) -> int:
    """Run one training process (output appended to `log_path` and echoed); SIGINT at the deadline."""
    print("$", " ".join(cmd), flush=True)
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env(gpu))
        interrupted = False
        while proc.poll() is None:
            time.sleep(1.0)
            if deadline is not None and not interrupted and time.time() >= deadline:
                print("time limit: SIGINT (the run checkpoints after its current update)", flush=True)
                proc.send_signal(signal.SIGINT)
                interrupted = True
                try:
                    proc.wait(timeout=180)
                except subprocess.TimeoutExpired:
                    proc.kill()  # the previous checkpoint stays valid
        return proc.wait()


def cmd_run(a: argparse.Namespace) -> int:
    runs = Path(a.runs_dir)
    runs.mkdir(parents=True, exist_ok=True)
    if a.background:
        argv = [x for x in sys.argv[1:] if x != "--background"]
        log = runs / f"launcher-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        with open(log, "w") as f:
            p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv], stdout=f,
                                 stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, env=dict(os.environ))
        print(f"started in the background: pid {p.pid}, log {log} (runs: {runs}/<env>-<arm>[-s<seed>].log)")
        return 0
    deadline = time.time() + 60 * a.time_limit_min if a.time_limit_min else None
    failed = []
    for job in make_jobs(a):
        if deadline is not None and time.time() >= deadline - 30:
            print("time limit reached: the remaining runs start on the next call")
            break
        cmd = command_for(job, a, runs)
        if cmd is None:
            print(f"{job.name}: done")
            continue
        lock = runs / f"{job.name}.lock"
        if not take_lock(lock):
            print(f"{job.name}: running in another process (lock {lock}); skipped")
            continue
        try:
            rc = run_child(cmd, runs / f"{job.name}.log", a.gpu, deadline)
        finally:
            lock.unlink(missing_ok=True)
        state, steps, total = job_state(runs / job.name)
        print(f"{job.name}: exit {rc}, {state} at {steps:,} of {total or '?'} steps", flush=True)
        if rc not in (0, -signal.SIGINT, 130) and state != "done":
            failed.append(job.name)
    if failed:
        print(f"failed: {', '.join(failed)} (see their .log files)")
    return 1 if failed else 0


def cmd_status(a: argparse.Namespace) -> int:
    runs = Path(a.runs_dir)
    rows = []
    for job in make_jobs(a):
        state, steps, total = job_state(runs / job.name)
        lock = runs / f"{job.name}.lock"
        running = lock.exists() and _alive(int(lock.read_text() or 0))
        if not running and total is not None and total != a.total_timesteps and state in ("done", "partial"):
            state = f"{state}, for {total:,} steps: to run again"
        rows.append({"run": job.name, "state": "running" if running else state, "steps": steps, "total": total})
    print_table(rows, ["run", "state", "steps", "total"])
    return 0


# --- results -----------------------------------------------------------------------------------------------

def collect(a: argparse.Namespace) -> list[dict[str, Any]]:
    """`thinkcraft compare` per env (arms as labels), and one row per (env, arm, seed) from its finals."""
    try:
        from thinkcraft.analysis.compare import CompareConfig
        from thinkcraft.analysis.compare import run as compare_run
    except ImportError:
        raise SystemExit("collect needs `thinkcraft compare` (src/thinkcraft/analysis), not in this checkout yet") from None
    from thinkcraft.utils.metrics import run_metrics_path

    runs = Path(a.runs_dir)
    rows: list[dict[str, Any]] = []
    for env in a.envs:
        jobs = [j for j in make_jobs(a) if j.env == env and run_metrics_path(runs / j.name) is not None]
        if not jobs:
            print(f"{env}: no runs with metrics yet")
            continue
        out = runs / f"compare-{env}"
        labels = [f"{runs / j.name}={j.arm}" for j in jobs]
        compare_run(CompareConfig([str(runs / j.name) for j in jobs], metric=CURVE_METRICS, label=labels,
                                  out=str(out), bootstrap_samples=a.bootstrap_samples, seed=0))
        res = json.loads((out / "compare.json").read_text())
        for g in res["groups"]:
            for f in g["metrics"]["episode/return"]["finals"]:
                run_dir = Path(f["run"].split("[")[0])
                state, steps, total = job_state(run_dir)
                # steps: env steps the seed trained (checkpointed); final_return: compare's final, the mean of
                # the episode returns logged over the last 10% of its steps (the last one at final_step)
                rows.append({"env": env, "arm": g["label"], "seed": f["seed"], "steps": steps,
                             "final_return": f["final"], "final_step": int(f["steps"]), "finished": state == "done",
                             "total_steps": total,
                             "env_name": ENVS[env], "num_envs": a.num_envs, "num_steps": a.num_steps,
                             "skip_n": None if g["label"] == "ppo" else a.skip_n, "run": f["run"],
                             "mode": "quick" if a.quick else "full", "card": run_card(run_dir),
                             "date": run_date(run_dir),
                             "compare_dir": str(out)})
        achievement_table(env, [str(runs / j.name) for j in jobs], labels, out, a)
    return rows


def achievement_table(env: str, run_dirs: list[str], labels: list[str], out: Path, a: argparse.Namespace) -> None:
    """Each achievement's final rate per arm (mean over seeds, 95% bootstrap CI): knowledge, if any, should show
    in the rarer, deeper achievements before the mean. `<out>/achievements.json` (compare's JSON without the
    curves: `thinkcraft compare RUN... --metric 'achievements/*'` draws them) and a table."""
    from thinkcraft.analysis.compare import CompareConfig, compare_groups, load_groups
    from thinkcraft.analysis.report import comparison_dict
    from thinkcraft.utils.io import atomic_write_json

    cfg = CompareConfig(run_dirs, metric=["achievements/*"], label=labels, out=str(out),
                        bootstrap_samples=a.bootstrap_samples, seed=0, plot=False)
    res = comparison_dict(compare_groups(*load_groups(cfg)[:2], cfg), cfg)
    for g in res["groups"]:  # finals only: ~45 curves per arm made it 3 MB, carried by every device call
        for m in g["metrics"].values():
            m.pop("curve", None)
    path = out / "achievements.json"
    atomic_write_json(path, res)
    arms = [g["label"] for g in res["groups"]]
    names = sorted({m for g in res["groups"] for m in g["metrics"]} - {"achievements/mean_rate"})
    rows = []
    for name in names:
        row: dict[str, Any] = {"achievement": name.split("/", 1)[1]}
        for g in res["groups"]:
            m = g["metrics"].get(name)
            row[g["label"]] = "" if m is None else (f"{m['mean']['point']:.3f} [{m['mean']['low']:.3f}, "
                                                     f"{m['mean']['high']:.3f}]")
        rows.append(row)
    print(f"{env}: achievements, final rate per arm (mean [95% CI] over seeds); {path}")
    print_table(rows, ["achievement", *arms])


def cmd_collect(a: argparse.Namespace) -> int:
    rows = collect(a)
    print_table(rows, ["env", "arm", "seed", "steps", "final_return", "finished"])
    results = Path(a.results or (Path(a.runs_dir) / "llm_features.json" if a.quick else
                                 ROOT / "bench" / "results" / "llm_features.json"))
    write_records(results, rows, merge_keys=("env", "arm", "seed", "num_envs", "mode"))
    print(f"wrote {results}; curves and tables: {a.runs_dir}/compare-<env>/")
    return 0


def cmd_estimate(a: argparse.Namespace) -> int:
    """The LLM's share of each LLM arm's GPU time from a measured prefill rate (one GPU, minutes)."""
    from ppo_hidden_sps import prefill_rate

    from thinkcraft.llm import make_engine
    from thinkcraft.llm.protocol import Batch
    from thinkcraft.train.ppo_hidden.config import PPOHiddenConfig, make_prompt_prefix

    engine = make_engine(a.engine)
    prefix_ids, _ = engine.tokenize_batch(Batch([""], prefix=make_prompt_prefix(PPOHiddenConfig())))
    rows = []
    for env in a.envs:
        for n in a.estimate_num_envs:
            tokens, rate = prefill_rate(engine, ENVS[env], n, prefix_ids)
            pool = max(1, n // min(16, n))
            llm_s = a.total_timesteps / a.skip_n * (n + pool) / n * tokens / rate
            rows.append({"env": env, "num_envs": n, "suffix_tokens": round(tokens, 1), "prefill_tok_per_s": round(rate),
                         "llm_s_per_seed": round(llm_s), "llm_h_all_seeds": round(llm_s * a.seeds / 3600, 2)})
            print_table(rows[-1:], list(rows[-1]))
    print(f"\nLLM time of one LLM arm ({a.total_timesteps:,} steps, skip_n {a.skip_n}, reset pool num_envs/16, "
          f"{a.seeds} seeds, {card()}); add the env+policy time (about plain PPO's: bench/results/ppo_sps.json)")
    print_table(rows, list(rows[0]))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", nargs="?", choices=["run", "status", "collect", "estimate"], default=None)
    ap.add_argument("--quick", action="store_true", help="CPU: run (in two passes: stop, then resume) and collect, tiny Classic")
    ap.add_argument("--env", dest="envs", nargs="+", choices=sorted(ENVS), default=list(ENVS))
    ap.add_argument("--arm", dest="arms", nargs="+", choices=ARMS, default=None,
                    help="run: default the issue's three (ppo llm random-llm); status / collect: every arm with a run")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--seed-mode", choices=["auto", "separate", "vmapped"], default="auto")
    ap.add_argument("--total-timesteps", type=int, default=20_000_000,
                    help="env steps per seed (every arm), rounded up to a whole number of updates")
    ap.add_argument("--num-envs", type=int, default=1024)
    ap.add_argument("--num-steps", type=int, default=50, help="rollout length of every arm (skip_n must divide it)")
    ap.add_argument("--skip-n", type=int, default=25)
    ap.add_argument("--engine", default="hf:default")
    ap.add_argument("--layer", type=int, default=15,
                    help="LLM layer the LLM arms read (SmolLM2-135M has 30; the middle one costs half the last's "
                         "prefill: at 1024 envs x 3 seeds the last layer made each LLM arm LLM-bound at 78%% of "
                         "its time, ~25 min per 20M steps on an H200; -1 = the last, final-normed)")
    ap.add_argument("--gpu", default=None, help="CUDA_VISIBLE_DEVICES of the runs this call starts")
    ap.add_argument("--background", action="store_true", help="detach (new session; output to a launcher log)")
    ap.add_argument("--time-limit-min", type=float, default=0.0, help="SIGINT the running child at M minutes (0 = none)")
    ap.add_argument("--stop-after-updates", type=int, default=0, help="passed to each run: stop (checkpointed) after N updates")
    ap.add_argument("--checkpoint-every-minutes", type=float, default=3.0)
    ap.add_argument("--runs-dir", default=None, help="default runs/llm_features (--quick: runs/llm_features-quick)")
    ap.add_argument("--results", default=None, help="default bench/results/llm_features.json (--quick: <runs-dir>/llm_features.json)")
    ap.add_argument("--bootstrap-samples", type=int, default=2000)
    ap.add_argument("--estimate-num-envs", type=int, nargs="+", default=[128, 1024])
    a = ap.parse_args(argv)
    if a.arms is None:
        a.arms = list(ARMS if a.command in ("status", "collect") else DEFAULT_ARMS)
    a.extra, a.hidden_extra = [], ["--layer", str(a.layer)]
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    # env steps per seed: a whole number of updates, at least the total asked for (the ">= 20M"; `train`
    # itself floors: 20M at 1024 x 50 would be 390 updates, 19,968,000 steps)
    batch = a.num_envs * a.num_steps
    if a.total_timesteps % batch:
        a.total_timesteps = -(-a.total_timesteps // batch) * batch
        print(f"env steps per seed rounded up to whole updates: {a.total_timesteps:,} "
              f"({a.total_timesteps // batch} x {batch:,})")
    a.runs_dir = a.runs_dir or ("runs/llm_features-quick" if a.quick else "runs/llm_features")
    a.session_flags = ["--checkpoint-every-minutes", str(a.checkpoint_every_minutes)]
    if a.stop_after_updates:
        a.session_flags += ["--stop-after-updates", str(a.stop_after_updates)]
    if a.quick and a.command is None:  # the plumbing end to end: a first pass stops every run half way, the
        # second resumes them to the end, then the rows and compare
        for stop in (QUICK["total_timesteps"] // (QUICK["num_envs"] * QUICK["num_steps"]) // 2, 0):
            b = argparse.Namespace(**{**vars(a), "session_flags": a.session_flags + (
                ["--stop-after-updates", str(stop)] if stop else [])})
            if cmd_run(b):
                return 1
            cmd_status(b)
        return cmd_collect(a)
    if a.command is None:
        ap.error("give a command (run, status, collect, estimate) or --quick")
    return {"run": cmd_run, "status": cmd_status, "collect": cmd_collect, "estimate": cmd_estimate}[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
