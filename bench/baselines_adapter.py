"""Run Craftax_Baselines' `ppo.py` / `ppo_rnn.py` unmodified, with its own logging, and write its per-update
metrics as a thinkcraft run directory (config.json + metrics.jsonl, one `seed_index` per repeat) that
`thinkcraft compare` reads.

    python bench/baselines_adapter.py --baselines-dir .ref/Craftax_Baselines --script ppo.py \
        --out runs/parity/baselines-mlp -- --env_name Craftax-Symbolic-v1 --num_envs 1024 \
        --total_timesteps 2e7 --num_repeats 5 --seed 0

Everything after `--` goes to their argparse unchanged (their defaults for the rest). `--use_wandb` and
`--debug` must stay on (their defaults): that is what makes every update call their logging.

How their metrics are captured (their files are never modified):
* The script runs as `__main__` in this process (runpy), so their argparse, `run_ppo`, `make_train`, vmap over
  NUM_REPEATS and logging callback all run as written: per update, `jax.debug.callback` ->
  `create_log_dict(metric)` -> `batch_log(update_step, log)` -> `wandb.log`.
* `wandb` is a local stand-in that records calls (nothing leaves the machine, no account). `distrax` (which
  no longer imports under current JAX) is thinkcraft's `Categorical` (the same maths: `jax.random.categorical`
  over the logits, log_softmax log-probs and entropy). `chex` (annotations only) and `orbax` (policy saving,
  off) get stand-ins only where they are not installed.
* `logz.batch_logging.batch_log` is wrapped before their script imports it: the wrapper keeps each seed's
  dict (their `create_log_dict` output) and then calls their `batch_log` unchanged. The wrapper is needed:
  their `batch_log` averages the return over the seeds before `wandb.log`, and drops a seed's achievement
  values when they are NaN, so per-seed values exist only before it.
* Seed identity: under `jax.vmap`, JAX unrolls a debug callback into one callback per mapped element, in
  index order (`jax._src.debugging.debug_batching_rule`); their arrival order inside one update is the seed
  index. The order is fixed by the compiled program, so index i follows one seed for the whole run. Each
  update must arrive exactly NUM_REPEATS times or the adapter fails. Baselines seeds its repeats with
  `jax.random.split(PRNGKey(seed), NUM_REPEATS)`: seed_index i is the i-th key (config `seed` + i, which
  `compare` shows, is a label, not that key).

Their definitions -> the fields written (the same names `thinkcraft train ppo` logs):
* `episode/return`  <- `episode_return`: per update, the mean of `returned_episode_returns` over the
  (step, env) pairs of that update's NUM_STEPS x NUM_ENVS rollout where an episode ended (LogWrapper;
  NaN - here: absent - when none ended). Return = sum of rewards of the episode.
* `episode/length`  <- `episode_length`, the same mean of episode lengths.
* `achievements/<x>` <- `Achievements/<x>` / 100: craftax puts 100 x unlocked x done into info; averaged over
  the ended episodes it is the percentage of them that unlocked x; divided by 100, a fraction as ours.
* `achievements/mean_rate` = the mean of those fractions, as ours (their own `achievements` is the sum of
  the fractions: achievements per episode).
* `episode/return_pct_max` = 100 x return / the sum of achievement rewards (as ours).
* `step` = (update_step + 1) x NUM_ENVS x NUM_STEPS (their update_step counts from 0 before the update);
  `update` = update_step + 1; `time_s` = seconds since the script started (compile included).
"""

from __future__ import annotations

import argparse
import math
import os
import runpy
import subprocess
import sys
import time
import types
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import card  # noqa: E402

CPU_VMAP_DEADLOCK_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
"""jaxlib 0.10's CPU runtime can deadlock a vmapped init: each batched QR of an orthogonal initialiser
(lapack orgqr, ParallelBatchMap) runs on the intra-op pool and waits for sub-tasks queued on the same pool;
two of them at once wedge a 2-thread pool (seen here: Baselines' `make_train` with NUM_REPEATS=2 hung right
after compiling, every worker parked). This scheduler flag avoids it; it only touches CPU compiles."""


def with_cpu_deadlock_flag(env: dict[str, str]) -> dict[str, str]:
    """`env` with CPU_VMAP_DEADLOCK_FLAG added to XLA_FLAGS (set before JAX starts)."""
    flags = env.get("XLA_FLAGS", "")
    return env if CPU_VMAP_DEADLOCK_FLAG in flags else {**env, "XLA_FLAGS": f"{flags} {CPU_VMAP_DEADLOCK_FLAG}".strip()}


SCRIPTS = {"ppo.py": "mlp", "ppo_rnn.py": "rnn"}


def convert_log(log: dict[str, Any], update_step: int, num_envs: int, num_steps: int,
                max_return: float) -> dict[str, Any]:
    """One seed's `create_log_dict` output at `update_step` -> a thinkcraft metrics record (NaN dropped)."""

    def finite(v: Any) -> float | None:
        f = float(v)
        return f if math.isfinite(f) else None

    rec: dict[str, Any] = {"step": (int(update_step) + 1) * num_envs * num_steps, "update": int(update_step) + 1}
    ret = finite(log["episode_return"])
    if ret is not None:
        rec["episode/return"] = ret
        rec["episode/return_pct_max"] = 100.0 * ret / max_return
    length = finite(log["episode_length"])
    if length is not None:
        rec["episode/length"] = length
    rates = {k.split("/", 1)[1]: finite(v) / 100.0 for k, v in log.items()
             if k.startswith("Achievements/") and finite(v) is not None}
    for name, r in rates.items():
        rec[f"achievements/{name}"] = r
    if rates:
        rec["achievements/mean_rate"] = sum(rates.values()) / len(rates)
    return rec


class SeedRecorder:
    """Receives their per-seed log dicts in callback order and writes one record per (update, seed).

    Configured from their config dict when their `run_ppo` calls `wandb.init(config=...)` (before any update)."""

    def __init__(self, write: Callable[[dict[str, Any]], None]) -> None:
        self.write = write
        self.config: dict[str, Any] | None = None
        self.arrivals: dict[int, int] = defaultdict(int)
        self.max_return = float("nan")

    def configure(self, config: dict[str, Any]) -> None:
        from thinkcraft.envs.craftax import achievement_weights

        self.config = config
        self.max_return = float(sum(achievement_weights(config["ENV_NAME"])))

    def __call__(self, update_step: Any, log: dict[str, Any]) -> None:
        assert self.config is not None, "their logging ran before wandb.init"
        u, k = int(update_step), int(self.config["NUM_REPEATS"])
        seed_index = self.arrivals[u]
        if seed_index >= k:
            raise RuntimeError(f"update {u} logged more than NUM_REPEATS={k} times; cannot tell the seeds apart")
        self.arrivals[u] += 1
        rec = convert_log(log, u, int(self.config["NUM_ENVS"]), int(self.config["NUM_STEPS"]), self.max_return)
        rec["seed_index"] = seed_index
        self.write(rec)

    def check_complete(self) -> None:
        assert self.config is not None
        k, n = int(self.config["NUM_REPEATS"]), int(self.config["NUM_UPDATES"])
        bad = {u: c for u, c in self.arrivals.items() if c != k}
        if bad or len(self.arrivals) != n:
            raise RuntimeError(f"Baselines logged {len(self.arrivals)} of {n} updates; updates not logged "
                               f"once per seed ({k}): {dict(list(bad.items())[:5])}")


class WandbStandIn(types.ModuleType):
    """`wandb` for their script: hands `init`'s config to the recorder, counts `log` calls; contacts nothing."""

    def __init__(self, run_dir: Path, on_init: Callable[[dict[str, Any]], None]) -> None:
        super().__init__("wandb")
        self.run = types.SimpleNamespace(dir=str(run_dir / "wandb-standin"))
        self.on_init = on_init
        self.logged = 0

    def init(self, config: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        self.on_init(config or {})
        return self.run

    def log(self, data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        self.logged += 1


def install_import_shims(baselines_dir: Path, recorder: SeedRecorder, wandb: WandbStandIn) -> None:
    """Make their imports resolve here (see the module doc), then wrap their batch_log."""
    from thinkcraft.rl.distributions import Categorical

    def stand_in(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    sys.path.insert(0, str(baselines_dir))
    sys.modules["wandb"] = wandb
    stand_in("distrax", Categorical=Categorical)
    try:
        import chex  # noqa: F401
    except ImportError:
        stand_in("chex", PRNGKey=Any, Array=Any)
    try:
        import orbax.checkpoint  # noqa: F401
        from flax.training import orbax_utils  # noqa: F401
    except ImportError:
        stand_in("orbax")
        stand_in("orbax.checkpoint", PyTreeCheckpointer=None, CheckpointManagerOptions=None, CheckpointManager=None)
        import flax.training

        flax.training.orbax_utils = stand_in("flax.training.orbax_utils")
    import logz.batch_logging as bl  # Craftax_Baselines/logz/batch_logging.py

    their_batch_log = bl.batch_log

    def batch_log(update_step: Any, log: dict[str, Any], config: dict[str, Any]) -> None:
        recorder(update_step, log)
        their_batch_log(update_step, log, config)

    bl.batch_log = batch_log


def git_commit(d: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(d), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def run_config(their: dict[str, Any], script: str, baselines_dir: Path, argv: list[str]) -> dict[str, Any]:
    """config.json of the run dir: their config (lower-cased keys, as their CLI flags) + who and how."""
    cfg = {k.lower(): v for k, v in their.items() if isinstance(v, (int, float, str, bool, type(None)))}
    cfg.update(system="baselines", policy=SCRIPTS[script], script=script, num_seeds=int(their["NUM_REPEATS"]),
               baselines_dir=str(baselines_dir), baselines_commit=git_commit(baselines_dir), their_argv=argv)
    return cfg


def run_baselines(baselines_dir: str | Path, script: str, out: str | Path, their_args: list[str],
                  overwrite: bool = False) -> Path:
    """Run their script with `their_args` in this process; write `out`/config.json and metrics.jsonl."""
    from thinkcraft.train.checkpoint import prepare_run_dir
    from thinkcraft.utils.io import atomic_write_json
    from thinkcraft.utils.metrics import MetricsWriter

    baselines_dir = Path(baselines_dir).resolve()
    if script not in SCRIPTS:
        raise SystemExit(f"--script must be one of {', '.join(SCRIPTS)}, got {script!r}")
    if not (baselines_dir / script).exists():
        raise SystemExit(f"{baselines_dir / script} not found: --baselines-dir must be a Craftax_Baselines checkout")
    for flag in ("--no-debug", "--no-use_wandb"):
        if flag in their_args:
            raise SystemExit(f"{flag}: their logging runs only with --debug and --use_wandb (their defaults)")
    out = Path(out)
    run_dir = prepare_run_dir(out, overwrite)
    writer = MetricsWriter(run_dir)
    recorder = SeedRecorder(lambda rec: writer.write(rec.pop("step"), rec))
    argv = [script, *their_args]

    def on_init(config: dict[str, Any]) -> None:
        recorder.configure(config)
        atomic_write_json(run_dir / "config.json", run_config(config, script, baselines_dir, argv[1:]))

    install_import_shims(baselines_dir, recorder, WandbStandIn(run_dir, on_init))
    saved_argv = sys.argv
    sys.argv = argv
    t0 = time.perf_counter()
    try:
        runpy.run_path(str(baselines_dir / script), run_name="__main__")
    finally:
        sys.argv = saved_argv
        writer.close()
    wall_s = time.perf_counter() - t0
    recorder.check_complete()
    assert recorder.config is not None
    c = recorder.config
    cfg = run_config(c, script, baselines_dir, argv[1:])
    total = int(c["NUM_UPDATES"]) * int(c["NUM_ENVS"]) * int(c["NUM_STEPS"]) * int(c["NUM_REPEATS"])
    cfg["_derived"] = {"num_updates": int(c["NUM_UPDATES"]), "wall_s": wall_s, "sps_all_seeds_incl_compile": total / wall_s,
                       "hardware": [card()]}  # as `thinkcraft train` records it (bench/common.run_card)
    atomic_write_json(run_dir / "config.json", cfg)
    print(f"wrote {run_dir} ({int(c['NUM_REPEATS'])} seeds x {int(c['NUM_UPDATES'])} updates, {wall_s:.0f} s)")
    return run_dir


def main(argv: list[str] | None = None) -> None:
    os.environ.update(with_cpu_deadlock_flag(dict(os.environ)))  # before their script imports JAX
    argv = sys.argv[1:] if argv is None else argv
    ours, their = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baselines-dir", default=str(ROOT / ".ref" / "Craftax_Baselines"))
    ap.add_argument("--script", default="ppo.py", choices=sorted(SCRIPTS))
    ap.add_argument("--out", required=True, help="run directory to write (config.json, metrics.jsonl)")
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = ap.parse_args(ours)
    from thinkcraft.utils.errors import UserError

    try:
        run_baselines(args.baselines_dir, args.script, args.out, their, overwrite=args.overwrite)
    except UserError as e:
        raise SystemExit(f"baselines_adapter: error: {e}") from None


if __name__ == "__main__":
    main()
