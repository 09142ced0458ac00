"""Shared helpers for benchmark scripts: card/machine names, dates, JSON result files."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Iterable

if os.environ.get("THINKCRAFT_STACK_DUMP_S"):
    # bench/gpu_batch.sh sets it a little under a job's time limit: a job still running then (hung, or just slow)
    # leaves every thread's Python stack in its log before it is stopped - where it hung, not only that it did
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from thinkcraft.utils.watchdog import dump_stacks_later

    dump_stacks_later(float(os.environ["THINKCRAFT_STACK_DUMP_S"]))


def card() -> str:
    """GPU name if one is visible (JAX or torch: `thinkcraft.utils.hardware.gpu_name`), else 'cpu (<n> cores)'."""
    from thinkcraft.utils.hardware import gpu_name

    return gpu_name(load=True) or f"cpu ({os.cpu_count()} cores, {platform.machine()})"


def run_card(run_dir: str | Path) -> str:
    """The card a run computed on, from its config.json (`_derived.hardware`, written by `thinkcraft train`
    and bench/baselines_adapter.py; "A+B" for a run resumed on another card), else this machine's: results
    collected here from runs made on a GPU machine keep the GPU's name."""
    try:
        hw = json.loads((Path(run_dir) / "config.json").read_text()).get("_derived", {}).get("hardware")
    except (OSError, ValueError):
        hw = None
    return "+".join(hw) if hw else card()


def run_date(run_dir: str | Path) -> str:
    """The UTC date a run last wrote its metrics (the file's mtime, which tar keeps), else today."""
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        return today()
    return _dt.datetime.fromtimestamp(p.stat().st_mtime, _dt.timezone.utc).strftime("%Y-%m-%d")


def today() -> str:
    return _dt.date.today().isoformat()


def write_records(path: str | os.PathLike, records: Iterable[dict[str, Any]], merge_keys: tuple[str, ...] = ()) -> Path:
    """Write a JSON list. With merge_keys, keep old records whose key tuple is not re-measured now."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = list(records)
    if merge_keys and path.exists():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = []
        if not (isinstance(old, list) and all(isinstance(r, dict) for r in old)):
            print(f"{path}: not a list of records; overwriting it", file=sys.stderr)
            old = []
        new_keys = {tuple(r.get(k) for k in merge_keys) for r in records}
        records = [r for r in old if tuple(r.get(k) for k in merge_keys) not in new_keys] + records
    path.write_text(json.dumps(records, indent=2) + "\n")
    return path


def cuda_timed(fn: Any, n: int = 20, warmup: int = 3) -> float:
    """Median seconds of `fn()` on the current CUDA stream over `n` calls after `warmup` (CUDA events)."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return statistics.median(ts)


def replay_ms(fn: Any, repeats: int, cuda: bool) -> float:
    """Median ms of `fn`: on CUDA captured once in a CUDA graph (after three warm-up calls on a side stream) and
    replayed `repeats` times, each timed by CUDA events - how an engine's decode step runs it; else wall time."""
    import statistics

    if not cuda:
        fn()
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(1000 * (time.perf_counter() - t0))
        return statistics.median(out)
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def random_action_window(env: Any, steps: int) -> Any:
    """A jitted scan (`thinkcraft.envs.scan`) of `steps` random-action steps of a thinkcraft `VecEnv`:
    EnvCarry(env_state, None, rng) -> carry. Observations are not carried (as before: an env-only window
    whose observation rendering XLA drops). The env-only window the probes time."""
    import jax

    from thinkcraft.envs.scan import make_env_scan, random_actions

    scan = make_env_scan(env, random_actions(env), steps)
    return jax.jit(lambda c: scan(c)[0])


def random_action_carry(env: Any, seed_reset: int = 0, seed_actions: int = 1) -> Any:
    """The first carry of `random_action_window`: a reset batch (jitted reset) and an action key."""
    import jax

    from thinkcraft.envs.scan import EnvCarry

    _, st = jax.jit(env.reset)(jax.random.PRNGKey(seed_reset))
    return EnvCarry(st, None, jax.random.PRNGKey(seed_actions))


def print_table(records: list[dict[str, Any]], cols: list[str]) -> None:
    widths = [max([len(c), *(len(_fmt(r.get(c))) for r in records)]) for c in cols]  # no records: the header
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in records:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return "" if v is None else str(v)


def decode_means(recs: list[dict[str, Any]]) -> dict[str, float]:
    """decode_step_ms, decode_wait_ms, rows_per_decode_step over every decode step of the updates `recs`
    (metrics.jsonl records; each update's value weighted by its `engine/decode_steps`). Not medians of the
    per-update values: with one GPU and η = 1 the async loop alternates updates that generate two batches with
    updates that only train the buffered one, and a median of those says nothing."""
    keys = ("engine/decode_step_ms", "engine/decode_wait_ms", "engine/rows_per_decode_step")
    n = [r.get("engine/decode_steps", 0.0) for r in recs]
    if not recs or sum(n) <= 0:
        return {}
    return {k.split("/")[1]: sum(r.get(k, 0.0) * w for r, w in zip(recs, n)) / sum(n) for k in keys}


def decode_graphs_column(width: str = "static") -> str | None:
    """A row's `decode_graphs`: "manual" for the hand-captured decode graph (llm/hf/cache.py; the default since
    2026-11-27), None for torch.compile's graph trees (THINKCRAFT_DECODE_GRAPHS=trees; rows written before the
    column existed ran them), so the two never merge; "manual-dynamic" for the manual graph over one compile with
    a symbolic width (THINKCRAFT_DECODE_DYNAMIC=1, or unset with `width` "dynamic": `cache.decode_dynamic`)."""
    from thinkcraft.llm.hf.cache import decode_dynamic, decode_graphs

    if decode_graphs() != "manual":
        return None
    return "manual-dynamic" if decode_dynamic(width) is None else "manual"



def _kernel_timeline(prof: Any, base: Path) -> dict[str, Any]:
    """The profiled kernels in time order: `<base>_kernels.tsv.gz` (start_us, dur_us, name) and the device's idle
    gaps between them, summed by size (a gap is from one kernel's end to the next one's start, kernels on any
    stream merged: overlapping kernels leave no gap)."""
    import gzip

    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start)
    if not ks:
        return {}
    t0 = ks[0][0]
    with gzip.open(f"{base}_kernels.tsv.gz", "wt") as f:
        f.write("start_us\tdur_us\tname\n")
        for a, b, name in ks:
            f.write(f"{a - t0:.1f}\t{b - a:.1f}\t{name[:120]}\n")
    edges = (0.0, 10.0, 100.0, 1000.0, 10000.0, float("inf"))
    by_size = {f"{lo:g}-{hi:g}us": [0, 0.0] for lo, hi in zip(edges, edges[1:])}
    gaps, end = [], ks[0][1]
    for a, b, _ in ks[1:]:
        if a > end:
            g = a - end
            gaps.append((g, end - t0))
            for lo, hi in zip(edges, edges[1:]):
                if lo <= g < hi:
                    by_size[f"{lo:g}-{hi:g}us"][0] += 1
                    by_size[f"{lo:g}-{hi:g}us"][1] += g
        end = max(end, b)
    span = end - t0
    idle = sum(g for g, _ in gaps)
    return {"device_timeline": {"span_s": round(span / 1e6, 4), "idle_s": round(idle / 1e6, 4),
                                "kernels": len(ks), "kernels_file": f"{Path(base).name}_kernels.tsv.gz"},
            "device_gaps": {k: {"count": c, "s": round(t / 1e6, 4)} for k, (c, t) in by_size.items()},
            "device_gaps_largest": [{"at_s": round(at / 1e6, 4), "ms": round(g / 1e3, 3)}
                                    for g, at in sorted(gaps, reverse=True)[:40]]}


def torch_profile(fn: Any, cuda: bool, base: Path, label: str, top: int = 25, show_table: bool = False,
                  timeline: bool = False) -> tuple[Any, dict[str, Any]]:
    """(fn(), summary): fn run once under torch.profiler, wall-timed inside the profiler (its start and stop
    left out; the device synchronised). Writes `<base>.txt` (the top operators by the device's self time -
    CUDA's, or the CPU's on a CPU - then by host time) and `<base>.json` (the summary: wall_s, device_busy_s =
    summed self time of the device, device_busy_frac, device_kernels, top_device_ops, top_host_ops as
    (operator, ms, calls)) and `<base>_all.tsv` (every operator and kernel). Near-1 busy fraction:
    compute-bound; well below: the host's launches and Python leave the device idle. `timeline` (CUDA): also
    `<base>_kernels.tsv.gz` (every kernel's start and duration in us from the first, and its name) and, in the
    summary, the device's idle gaps (`device_gaps`, `device_timeline`): where a loop leaves the GPU waiting."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        result = fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ev = prof.key_averages()
    key = ("self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total") \
        if cuda else "self_cpu_time_total"
    busy = sum(getattr(e, key, 0.0) for e in ev) / 1e6
    kernels = sum(1 for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA"))
    ranked = lambda k: [(e.key, round(getattr(e, k, 0.0) / 1e3, 2), e.count)  # noqa: E731
                        for e in sorted(ev, key=lambda e: -getattr(e, k, 0.0))[:top]]
    summary = {"label": label, "wall_s": round(wall, 3), "device_busy_s": round(busy, 3),
               "device_busy_frac": round(busy / wall, 3) if wall > 0 else None, "device_kernels": kernels,
               "top_device_ops": ranked(key), "top_host_ops": ranked("self_cpu_time_total")}
    base.parent.mkdir(parents=True, exist_ok=True)
    if timeline and cuda:
        summary.update(_kernel_timeline(prof, base))
    table = ev.table(sort_by=key, row_limit=top)
    Path(f"{base}.txt").write_text(f"{label}: wall {wall:.3f} s, summed {key} {busy:.3f} s\n{table}\n"
                                   + ev.table(sort_by="self_cpu_time_total", row_limit=top) + "\n")
    Path(f"{base}.json").write_text(json.dumps(summary, indent=1) + "\n")  # labels hold dots: no with_suffix
    # every operator and kernel (the tables above stop at `top`): what a step's device time is made of
    Path(f"{base}_all.tsv").write_text("name\tcalls\tself_device_ms\tself_host_ms\n" + "".join(
        f"{e.key}\t{e.count}\t{getattr(e, key, 0.0) / 1e3:.3f}\t{e.self_cpu_time_total / 1e3:.3f}\n"
        for e in sorted(ev, key=lambda e: -getattr(e, key, 0.0))))
    if show_table:
        print(table, flush=True)
    print(f"  profile ({label}): wall {wall:.2f} s, device busy {busy:.2f} s, {kernels} kernels -> {base}.{{txt,json}}",
          flush=True)
    return result, summary


def host_profile(fn: Any, path: Path, label: str, top: int = 45) -> Any:
    """fn() once under cProfile (the host's Python, not the device: CUDA launches return at once, a wait shows as
    the synchronising call's own time). Writes `path`: the wall time, then the top functions by their own time and
    by their time with callees, and the raw stats beside it (`path` with `.prof`: `python -m pstats` reads every
    function's callers and callees there, where the text keeps the top few). cProfile slows Python-heavy code
    (~1.5-2x), so the shares matter, not the seconds; prints the top few by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        result = fn()
    finally:
        prof.disable()
    wall = time.perf_counter() - t0
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{label}: wall {wall:.3f} s under cProfile\n{out.getvalue()}")
    prof.dump_stats(str(path.with_suffix(".prof")))
    own = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:6]  # (file, line, name) -> (cc, nc, tt, ct, callers)
    print(f"  host profile ({label}): wall {wall:.2f} s; own time: "
          + ", ".join(f"{k[2]} {v[2]:.3f} s" for k, v in own) + f" -> {path}", flush=True)
    return result
