"""Sample this process with py-spy once a training run is in its steady state, and summarise where each thread
spent it: which part of a decode step is host work, GIL or device wait, learner, env or reward.

A whole-run profile is mostly compilation (the first update compiles the decode step: ~1-2 min on an H100),
and a profiler started from the outside at a guessed time misses the steady updates (2026-11-27: a 45 s window
that began 200 s into the run caught 95% compilation). So the benchmark itself starts py-spy on its own pid
when the run's metrics.jsonl shows the first update done, for a fixed number of seconds:

    with SteadyProfile(metrics_reached(run_dir, 1), out_json, key="arith-async", seconds=30):
        run(cfg)

py-spy (`pip install py-spy`; on the GPU machine carried as a wheel in .whl/, installed by bench/gpu_env.sh)
samples without pausing the process (`--nonblocking`). Absent py-spy: one line, no profile. The summary (per
thread: samples, share of the window, the share spent compiling, the top frames by inclusive samples) is merged
into `out_json` under `key`; the raw samples are kept beside it, gzipped.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

_COMPILING = ("convert_frame", "compile_fx")  # dynamo tracing, inductor codegen: not steady-state work


def py_spy() -> str | None:
    """py-spy on PATH, beside this interpreter (a venv's bin/), or where bench/gpu_env.sh installs wheels."""
    near = [str(Path(sys.executable).parent / "py-spy"), "/tmp/site/bin/py-spy"]
    return shutil.which("py-spy") or next((p for p in near if os.access(p, os.X_OK)), None)


def summarize(raw: str | Path, top: int = 25, rate_hz: float | None = None) -> dict[str, Any]:
    """Per-thread summary of a py-spy raw file (lines "thread (tid): name;frame;frame... count")."""
    threads: dict[str, dict[str, Any]] = {}
    for line in Path(raw).read_text(errors="replace").splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        name = re.sub(r"^thread\s*(\(\w+\))?\s*:\s*", "", frames[0]).strip() or "?"  # "thread (tid): name"
        name = re.sub(r"-\d+$", "-N", name)  # pool workers rollout-0..31 -> one entry
        t = threads.setdefault(name, {"samples": 0, "compiling": 0, "frames": collections.Counter(),
                                      "leaves": collections.Counter()})
        count = int(n)
        t["samples"] += count
        body = [re.sub(r":\d+\)", ")", f) for f in frames[1:]]
        if any(k in f for f in body for k in _COMPILING):
            t["compiling"] += count
            continue
        for f in set(body):
            t["frames"][f] += count
        if body:
            t["leaves"][body[-1]] += count
    total = sum(t["samples"] for t in threads.values()) or 1
    out = {}
    for name, t in sorted(threads.items(), key=lambda kv: -kv[1]["samples"]):
        steady = max(t["samples"] - t["compiling"], 1)
        out[name] = {"samples": t["samples"], "share_of_samples": t["samples"] / total,
                     "compiling_share": t["compiling"] / max(t["samples"], 1),
                     "top_frames": [(f, c, round(c / steady, 3)) for f, c in t["frames"].most_common(top)],
                     "top_leaves": [(f, c, round(c / steady, 3)) for f, c in t["leaves"].most_common(10)]}
        if rate_hz:
            out[name]["active_s"] = t["samples"] / rate_hz
    return out


def metrics_reached(run_dir: str | Path, step: int) -> Callable[[], bool]:
    """A `ready` test: run_dir/metrics.jsonl has a record of step >= `step` (the first update done: step 1)."""
    path = Path(run_dir) / "metrics.jsonl"

    def ready() -> bool:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return False
        for line in reversed(lines):
            try:
                if json.loads(line).get("step", 0) >= step:
                    return True
            except json.JSONDecodeError:
                continue
        return False

    return ready


class SteadyProfile:
    """Start py-spy on this process once `ready()` (polled every second) is true - e.g. `metrics_reached(run_dir,
    1)`; stop after `seconds` (or when the block ends); merge the summary into `out_json[key]`."""

    def __init__(self, ready: Callable[[], bool], out_json: str | Path, key: str, seconds: float = 30.0,
                 rate_hz: int = 100) -> None:
        self.ready = ready
        self.out_json, self.key = Path(out_json), key
        self.seconds, self.rate_hz = seconds, rate_hz
        self.raw = self.out_json.with_name(f"{self.out_json.stem}-{key}.raw")
        self._stop = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self.exe = py_spy()

    def __enter__(self) -> SteadyProfile:
        if self.exe is None:
            print("steady profile: py-spy not found (pip install py-spy); no profile", flush=True)
            return self
        self._thread = threading.Thread(target=self._watch, name="steady-profile", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            if self.ready():
                break
        if self._stop.is_set():
            return
        cmd = [self.exe, "record", "--pid", str(os.getpid()), "--threads", "--nonblocking", "-r", str(self.rate_hz),
               "-d", str(int(self.seconds)), "-f", "raw", "-o", str(self.raw)]
        print(f"steady profile ({self.key}): {' '.join(cmd)}", flush=True)
        self._t0 = time.perf_counter()
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def __exit__(self, *exc: Any) -> None:
        if self.exe is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._proc is None:
            print(f"steady profile ({self.key}): the run ended before its steady state; no profile", flush=True)
            return
        try:  # py-spy writes its file when its duration ends or on SIGINT
            self._proc.wait(timeout=max(1.0, self.seconds - (time.perf_counter() - self._t0) + 10.0))
        except subprocess.TimeoutExpired:
            self._proc.send_signal(2)
            self._proc.wait(timeout=30)
        if not self.raw.is_file():
            print(f"steady profile ({self.key}): py-spy wrote nothing ({(self._proc.stderr.read() or '').strip()[-300:]})",
                  flush=True)
            return
        summary = {"seconds": self.seconds, "rate_hz": self.rate_hz,
                   "threads": summarize(self.raw, rate_hz=self.rate_hz)}
        old = json.loads(self.out_json.read_text()) if self.out_json.is_file() else {}
        old[self.key] = summary
        self.out_json.write_text(json.dumps(old, indent=1))
        with open(self.raw, "rb") as f, gzip.open(str(self.raw) + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        self.raw.unlink()
        busiest = next(iter(summary["threads"].items()), None)
        if busiest:
            name, t = busiest
            print(f"steady profile ({self.key}): busiest thread {name}: {t['samples']} samples, "
                  f"{100 * t['compiling_share']:.0f}% compiling; top: "
                  + "; ".join(f"{f} {s:.0%}" for f, _, s in t["top_leaves"][:4]), flush=True)
