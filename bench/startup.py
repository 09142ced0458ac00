"""Start-up of `thinkcraft train ppo`: seconds to the first update, on an empty JAX compilation cache and
again in an identical second run that reads the first run's programs back.

    python bench/startup.py                                   # Craftax-Symbolic-v1, 1024 envs (the GPU goal)
    python bench/startup.py --env-name Craftax-Classic-Symbolic-v1 --num-envs 8 --num-steps 16   # a CPU check
    python bench/startup.py --job ppo-hidden --num-envs 128 --num-steps 100 --skip-n 25       # ppo-hidden's kernels

Each run is the real CLI in a fresh process (`python -m thinkcraft train ppo ... --no-plot`, two chunks),
with JAX_COMPILATION_CACHE_DIR pointing at one cache directory that starts empty. Measured per run, from
the process start: `first_update_s` (the first line of metrics.jsonl), `compile_s` (what the command reports
for the chunk's compile: tracing, lowering and XLA, or what of them the caches served), `before_compile_s` (imports, env build, init, tracing and
lowering, unless the program cache served them), the cache entries the run wrote, and what the program
cache did for each traced program (`program_cache`: e.g. "ppo-init:hit ppo-chunk:hit", from the command's
"program cache: ..." lines; utils/program_cache.py). A second run that writes a new `jit_*` entry for the
chunk missed the XLA cache: its key changed between identical runs (the key is the lowered program without
debug info, the compile options, jaxlib and the device kind). `--no-program-cache` times the runs with
THINKCRAFT_PROGRAM_CACHE=0 (tracing and lowering every time, as before the program cache).

Goal (issue 17, item 8): on an H100 at 1024 envs the second run starts training in < 30 s (the first took
~140 s with the unrolled env loops). Writes bench/results/startup.json (one record per run).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, today, write_records  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMPILED_LINE = re.compile(r"compiled a chunk of .* in ([0-9.]+) s")
PROGRAM_CACHE_LINE = re.compile(r"program cache: (hit|miss|off) \(([\w-]+)")


def time_one_run(args: argparse.Namespace, cache: Path, runs_dir: Path, name: str) -> dict[str, Any]:
    """Run `train ppo` once; seconds (from the process start) to the compiled chunk and to the first update."""
    if args.job == "ppo":
        total = args.num_envs * args.num_steps * args.updates_per_chunk * 2  # two chunks: the first one is timed
        job = ["ppo", "--updates-per-chunk", str(args.updates_per_chunk)]
    else:  # two updates; the engine loads before anything compiles
        total = args.num_envs * args.num_steps * 2
        job = ["ppo-hidden", "--skip-n", str(args.skip_n), "--engine", args.engine]
    cmd = [sys.executable, "-m", "thinkcraft", "train", *job, "--env-name", args.env_name,
           "--num-envs", str(args.num_envs), "--num-steps", str(args.num_steps), "--total-timesteps", str(total),
           "--runs-dir", str(runs_dir), "--run-name", name, "--overwrite", "--no-plot", *args.extra]
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache))
    env.pop("THINKCRAFT_PROGRAM_CACHE_DIR", None)  # the program cache lives in the fresh cache dir too
    if args.no_program_cache:
        env["THINKCRAFT_PROGRAM_CACHE"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    before = {p.name for p in cache.iterdir()} if cache.exists() else set()
    metrics = runs_dir / name / "metrics.jsonl"
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)

    def read_stderr() -> None:  # timestamp each stderr line as it arrives
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    first_update_s = None
    while proc.poll() is None and time.perf_counter() - t0 < args.timeout_s:
        if first_update_s is None and metrics.exists() and metrics.stat().st_size > 0:
            first_update_s = time.perf_counter() - t0
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join(timeout=5)
    total_s = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(line for _, line in lines[-15:])
        raise SystemExit(f"{name}: train {args.job} exited with {proc.returncode} after {total_s:.0f} s:\n{tail}")
    if first_update_s is None:  # finished between two polls
        first_update_s = total_s
    compiled = [(t, float(m.group(1))) for t, line in lines if (m := COMPILED_LINE.search(line))]
    compiled_at_s, compile_s = compiled[0] if compiled else (float("nan"), float("nan"))
    written = sorted(n for n in {p.name for p in cache.iterdir()} - before if n.endswith("-cache"))
    programs = [f"{m.group(2)}:{m.group(1)}" for _, line in lines if (m := PROGRAM_CACHE_LINE.search(line))]
    return {
        "run": name,
        "first_update_s": first_update_s,
        "compile_s": compile_s,
        "before_compile_s": compiled_at_s - compile_s,
        "first_chunk_s": first_update_s - compiled_at_s,
        "process_s": total_s,
        "cache_entries_written": len(written),
        "jit_entries_written": [w.rsplit("-", 2)[0] for w in written if w.startswith("jit_")],
        "program_cache": " ".join(programs) or "none",
        "program_cache_lines": [line for _, line in lines if PROGRAM_CACHE_LINE.search(line)],
    }


def device_name() -> str:
    """The accelerator JAX sees, from a separate process (this one never imports JAX)."""
    code = "import jax; d = jax.devices()[0]; print(d.device_kind if d.platform != 'cpu' else f'cpu ({d.platform})')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=["ppo", "ppo-hidden"], default="ppo",
                    help="ppo-hidden: its kernels compile at their first call (no 'compiled a chunk' line: "
                         "compile_s is empty), the LLM engine loads first")
    ap.add_argument("--engine", default="hf:default", help="ppo-hidden: the feature engine")
    ap.add_argument("--skip-n", type=int, default=25, help="ppo-hidden: refresh interval (divides --num-steps)")
    ap.add_argument("--env-name", default="Craftax-Symbolic-v1")
    ap.add_argument("--num-envs", type=int, default=1024)
    ap.add_argument("--num-steps", type=int, default=64)
    ap.add_argument("--updates-per-chunk", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2, help="identical runs on one cache (the first on an empty one)")
    ap.add_argument("--cache-dir", default=None, help="cache directory (default: a fresh temporary one)")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--no-program-cache", action="store_true",
                    help="THINKCRAFT_PROGRAM_CACHE=0: trace every program again (the XLA cache only)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "startup.json"))
    ap.add_argument("extra", nargs="*", help="more `train ppo` flags, after --")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="thinkcraft-startup-") as tmp:
        cache = Path(args.cache_dir) if args.cache_dir else Path(tmp) / "jax-cache"
        cache.mkdir(parents=True, exist_ok=True)
        if any(cache.iterdir()):
            print(f"note: {cache} is not empty, so run 1 is not a cold start", file=sys.stderr)
        records = []
        for i in range(1, args.runs + 1):
            rec = time_one_run(args, cache, Path(tmp) / "runs", f"startup-{i}")
            records.append(rec)
            print(f"run {i}: first update at {rec['first_update_s']:.1f} s (compile {rec['compile_s']:.1f} s, "
                  f"before it {rec['before_compile_s']:.1f} s); wrote {rec['cache_entries_written']} cache entries "
                  f"{rec['jit_entries_written']}", *rec["program_cache_lines"], sep="\n  ", file=sys.stderr)
    card = device_name()
    command = "python bench/startup.py " + " ".join(sys.argv[1:])
    for rec in records:
        rec.update({"card": card, "date": today(), "job": args.job, "env_name": args.env_name, "num_envs": args.num_envs,
                    "program_cache_on": not args.no_program_cache,
                    "num_steps": args.num_steps, "updates_per_chunk": args.updates_per_chunk, "command": command})
    print_table(records, ["run", "card", "num_envs", "first_update_s", "compile_s", "before_compile_s",
                          "first_chunk_s", "cache_entries_written", "program_cache"])
    if len(records) > 1:
        misses = records[1]["jit_entries_written"]
        print(f"second run: {records[1]['first_update_s']:.1f} s to the first update "
              f"({records[0]['first_update_s'] / records[1]['first_update_s']:.1f}x faster than the first); "
              + (f"programs compiled again (cache misses): {misses}" if misses else "every program came from the cache")
              + f"; program cache: {records[1]['program_cache']}")
    path = write_records(args.out, records,
                         merge_keys=("card", "job", "env_name", "num_envs", "num_steps", "run", "program_cache_on"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
