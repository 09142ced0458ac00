"""Why is the env window slower while the LLM runs beside it? And is the env at 128 envs host-bound?

    python bench/probes/env_host_probe.py                     # GPU: Craftax-Symbolic, 128 envs, 100 steps
    python bench/probes/env_host_probe.py --loads             # + the env window beside synthetic loads (below)
    python bench/probes/env_host_probe.py --quick             # CPU smoke run (Classic, 4 envs, 8 steps)

Part 1, for craftax's inner scans traced as loops (as craftax writes them) and fully unrolled
(`VecEnv.unroll_env_scans`): compile time, the compiled program's while / conditional / fusion counts,
the time for the jitted call to return (dispatch) vs to finish, the window's median time, and whether the
two variants give the same states (they must).

Part 2 (--loads), each load in a worker thread started with the env window, the window's median time:
  * gemm_graph_green: ~`--load-ms` of bf16 GEMMs replayed as one CUDA graph on a green context of all but 16
    SMs -> GPU work with no host work (SM / power / memory contention only);
  * gemm_graph_side: the same graph on a plain side stream (no SM partition);
  * tiny_launches_green: thousands of 1-element kernel launches on the green stream -> host / driver work
    with almost no GPU work;
  * python_spin: a pure-Python busy loop -> the GIL and a CPU core, no CUDA at all;
and, while the GEMM loads run, the SM clock and power (nvidia-smi sampled every 20 ms).
Writes bench/results/env_host_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ (common.py)
from common import card, random_action_carry, random_action_window, today, write_records  # noqa: E402


def hlo_counts(text: str) -> dict[str, int]:
    return {k: len(re.findall(rf"= [^=]*? {k}\(", text)) for k in ("while", "conditional", "fusion", "custom-call")}


def measure_env(env, steps: int, repeats: int) -> tuple[dict, object, object]:
    import jax

    window = random_action_window(env, steps)
    carry = random_action_carry(env)
    t0 = time.perf_counter()
    compiled = window.lower(carry).compile()
    compile_s = time.perf_counter() - t0
    counts = hlo_counts(compiled.as_text())
    first = jax.block_until_ready(window(carry))  # the states after one window, for the equality check
    c = first
    disp, full = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        c = window(c)
        t1 = time.perf_counter()
        c = jax.block_until_ready(c)
        disp.append(t1 - t0)
        full.append(time.perf_counter() - t0)
    rec = {"compile_s": round(compile_s, 2), **{f"hlo_{k}": v for k, v in counts.items()},
           "dispatch_return_s": statistics.median(disp[1:]), "window_s": statistics.median(full[1:]),
           "window_all_s": [round(x, 4) for x in full[1:]]}
    rec["env_sps"] = env.num_envs * steps / rec["window_s"]
    return rec, window, first


class Smi:
    """nvidia-smi sampling of the SM clock (MHz) and power (W) in the background."""

    def __init__(self) -> None:
        self.p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                   "-lms", "20"], stdout=subprocess.PIPE, text=True)
        self.rows: list[tuple[float, float]] = []
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            try:
                a, b = line.split(",")
                self.rows.append((float(a), float(b)))
            except ValueError:
                pass

    def stop(self) -> dict:
        self.p.terminate()
        clocks = [r[0] for r in self.rows] or [float("nan")]
        power = [r[1] for r in self.rows] or [float("nan")]
        return {"sm_mhz_min": min(clocks), "sm_mhz_median": statistics.median(clocks), "power_w_max": max(power),
                "power_w_median": statistics.median(power), "samples": len(self.rows)}


def loads_part(window, carry, repeats: int, load_ms: float) -> dict:
    import jax
    import torch
    from torch.cuda import green_contexts

    dev = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(dev).multi_processor_count
    green = green_contexts.GreenContext.create(num_sms=total - 16, device_id=dev)
    gs = green.Stream()
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def gemm_ms(stream) -> float:
        with torch.cuda.stream(stream):
            for _ in range(3):
                a @ b
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(10):
                a @ b
            e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) / 10

    def graph_of(stream, n: int):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            a @ b  # warm the cuBLAS handle of this stream
            torch.cuda.current_stream().synchronize()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(n):
                    a @ b
        return g

    out: dict = {"sms_total": total, "green_sms": total - 16}
    per = gemm_ms(gs)
    n = max(1, int(load_ms / per))
    out.update({"gemm_ms_green": per, "gemm_ms_side": gemm_ms(side), "gemms_per_load": n})
    g_green, g_side = graph_of(gs, n), graph_of(side, n)
    small = torch.zeros(1, device="cuda")

    def run_graph(g, stream):
        with torch.cuda.stream(stream):
            g.replay()
        stream.synchronize()

    n_tiny = 4000

    def tiny():
        with torch.cuda.stream(gs):
            for _ in range(n_tiny):
                small.add_(1.0)
        gs.synchronize()

    def spin():
        t_end = time.perf_counter() + load_ms / 1000
        x = 0
        while time.perf_counter() < t_end:
            x += 1

    loads = {"gemm_graph_green": lambda: run_graph(g_green, gs), "gemm_graph_side": lambda: run_graph(g_side, side),
             "tiny_launches_green": tiny, "python_spin": spin}
    holder = {"c": carry}
    for name, load in loads.items():
        load()
        t0 = time.perf_counter()
        load()
        out[f"{name}_alone_s"] = time.perf_counter() - t0
        smi = Smi() if name.startswith("gemm") else None
        envs, lts = [], []
        for _ in range(repeats + 1):
            res = {}

            def work():
                t = time.perf_counter()
                load()  # noqa: B023
                res["t"] = time.perf_counter() - t  # noqa: B023

            th = threading.Thread(target=work)
            th.start()
            t0 = time.perf_counter()
            holder["c"] = jax.block_until_ready(window(holder["c"]))
            envs.append(time.perf_counter() - t0)
            th.join()
            lts.append(res["t"])
        out[f"{name}_env_s"] = statistics.median(envs[1:])
        out[f"{name}_load_s"] = statistics.median(lts[1:])
        if smi:
            out[f"{name}_smi"] = smi.stop()
        print(f"{name:22s} load alone {out[f'{name}_alone_s']:.3f} s | env beside it {out[f'{name}_env_s']:.3f} s "
              f"(load {out[f'{name}_load_s']:.3f} s) {out.get(f'{name}_smi', '')}", flush=True)
    smi = Smi()
    time.sleep(0.3)
    out["idle_smi"] = smi.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-envs", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--loads", action="store_true")
    ap.add_argument("--load-ms", type=float, default=200.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--env", default="Craftax-Symbolic-v1")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "env_host_probe.json"))
    a = ap.parse_args()
    if a.quick:
        a.env, a.num_envs, a.steps, a.repeats = "Craftax-Classic-Symbolic-v1", 4, 8, 2
    import jax
    import numpy as np

    from thinkcraft.envs.craftax import make_env
    from thinkcraft.utils.jaxcache import enable_compilation_cache

    enable_compilation_cache(os.environ.get("JAX_COMPILATION_CACHE_DIR", "/tmp/thinkcraft-jax-cache"))
    base = {"env": a.env, "num_envs": a.num_envs, "steps": a.steps, "card": card(), "date": today(),
            "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    recs, firsts, windows = [], {}, {}
    for unroll in (False, True):
        env = make_env(a.env, a.num_envs, min(16, a.num_envs), unroll_env_scans=unroll)
        rec, windows[unroll], firsts[unroll] = measure_env(env, a.steps, a.repeats)
        rec = {**base, "unroll_env_scans": unroll, **rec}
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    same = all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(jax.device_get(firsts[False])),
                                                    jax.tree.leaves(jax.device_get(firsts[True])), strict=True))
    print("unrolled == looped states after one window:", same, flush=True)
    for r in recs:
        r["same_states_as_looped"] = same
    if a.loads and not a.quick:
        for unroll in (False, True):
            print(f"-- loads beside the env window (unroll_env_scans={unroll})", flush=True)
            recs[int(unroll)].update(loads_part(windows[unroll], firsts[unroll], a.repeats, a.load_ms))
    write_records(a.out, recs, merge_keys=("env", "num_envs", "steps", "card", "unroll_env_scans", "xla_flags"))
    print(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
