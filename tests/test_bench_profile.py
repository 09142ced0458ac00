"""bench/steady_profile.py: the summary of a py-spy raw file, and the steady-state trigger (without py-spy)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("steady_profile", ROOT / "bench" / "steady_profile.py")
sp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sp)


def _async_bench():
    """bench/async_llm_policy.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("async_llm_policy", ROOT / "bench" / "async_llm_policy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_summarize_groups_threads_and_separates_compilation(tmp_path: Path) -> None:
    raw = tmp_path / "p.raw"
    raw.write_text(
        "thread (0x1): engine-engine0-shared;run (engine.py:10);step (batcher.py:150);synchronize (streams.py:3) 60\n"
        "thread (0x1): engine-engine0-shared;run (engine.py:10);step (batcher.py:150);_launch (iteration.py:9) 30\n"
        "thread (0x1): engine-engine0-shared;run (engine.py:10);_compile (convert_frame.py:1) 10\n"
        "thread (0x2): rollout-3;work (rollout.py:5) 4\n"
        "thread (0x3): rollout-17;work (rollout.py:5) 6\n"
        "not a sample line\n")
    s = sp.summarize(raw, rate_hz=100)
    eng = s["engine-engine0-shared"]
    assert eng["samples"] == 100 and abs(eng["compiling_share"] - 0.1) < 1e-9 and eng["active_s"] == 1.0
    frames = {f: share for f, _, share in eng["top_frames"]}
    assert abs(frames["step (batcher.py)"] - 1.0) < 1e-9  # 90 of the 90 steady samples, line numbers merged
    assert abs(frames["synchronize (streams.py)"] - 60 / 90) < 1e-3
    assert s["rollout-N"]["samples"] == 10  # pool workers are one entry
    assert list(s)[0] == "engine-engine0-shared"  # busiest first


def test_metrics_reached_and_no_py_spy(tmp_path: Path, monkeypatch, capsys) -> None:
    ready = sp.metrics_reached(tmp_path, 1)
    assert not ready()  # no metrics.jsonl yet
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n{partial")
    assert not ready()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("\n" + json.dumps({"step": 1}) + "\n")
    assert ready()
    monkeypatch.setattr(sp, "py_spy", lambda: None)
    with sp.SteadyProfile(ready, tmp_path / "prof.json", "k", seconds=1):
        pass
    assert "py-spy not found" in capsys.readouterr().out and not (tmp_path / "prof.json").exists()


def test_async_bench_steady_window_is_whole_cycles(capsys) -> None:
    """bench/async_llm_policy.py: the steady window drops the compiling step, then whole η + 1 cycles from the
    end (a partial cycle over-weighted train-only updates: gsm8k, 4 steps, read 1.93x sync on 2026-11-27)."""
    bench = _async_bench()
    recs = [{"step": i} for i in range(1, 6)]
    assert [r["step"] for r in bench._steady(recs, 0)] == [2, 3, 4, 5]  # sync: every step after the first
    assert [r["step"] for r in bench._steady(recs, 1)] == [2, 3, 4, 5]  # two whole cycles
    assert [r["step"] for r in bench._steady(recs[:4], 1)] == [3, 4]  # 3 steady steps: the front one dropped
    assert [r["step"] for r in bench._steady(recs, 2)] == [3, 4, 5]
    assert [r["step"] for r in bench._steady(recs[:2], 1)] == [2]  # less than a cycle: kept, with a warning
    assert "less than one async cycle" in capsys.readouterr().err


def test_async_bench_steady_window_starts_after_the_last_graph_capture(tmp_path, capsys) -> None:
    """A decode graph compiled mid-run (a new width or prefix: ~40 s) ends the warm-up there: the 2-GPU Ray row of
    2026-11-28 read 4.43 samples/s with its step-3 capture in the window, 17.3 without; `--rederive` recomputes
    kept rows with the window."""
    import gzip
    import json

    bench = _async_bench()
    step_s = {1: 97.2, 2: 0.9, 3: 49.6, 4: 0.74, 5: 3.71, 6: 3.69}
    recs = [{"step": i, "timing/step": t, "reward/mean": 0.1, "gpu/idle_share": 0.4,
             "engine/graph_captures": 2.0 if i == 1 else 1.0 if i == 3 else 0.0} for i, t in step_s.items()]
    assert [r["step"] for r in bench._steady(recs, 1)] == [5, 6]  # after step 3's capture, whole cycles
    assert "after the last decode-graph capture (step 3)" in capsys.readouterr().err
    assert [r["step"] for r in bench._steady(recs[:3], 1)] == [2, 3]  # no capture-free step: warned, kept
    assert "still compiled a decode graph" in capsys.readouterr().err
    out = tmp_path / "rows.json"
    out.write_text(json.dumps([{"task": "arith", "mode": "async", "gpus": 2, "env_latency_ms": 0.0, "max_staleness": 1,
                                "batch": 64, "samples_per_s": 4.43}]))
    (tmp_path / "rows.metrics").mkdir()
    with gzip.open(tmp_path / "rows.metrics" / "arith-async-0-2.jsonl.gz", "wt") as g:
        g.write("".join(json.dumps(r) + "\n" for r in recs))
    rows = bench.rederive(out)
    assert rows[0]["samples_per_s"] == pytest.approx(128 / (3.71 + 3.69)) and rows[0]["steady_steps"] == [5, 6]
    assert json.loads(out.read_text())[0]["samples_per_s"] == rows[0]["samples_per_s"]
    assert rows[0]["steady"] is True and bench._is_steady(recs[:4], 1) is False  # step 4 alone: not a whole cycle
    assert bench._is_steady(recs[:3], 0) is False and bench._is_steady(recs[:4], 0) is True


def test_scale_llm_rows_leave_out_rows_without_a_steady_window(tmp_path, capsys) -> None:
    """bench/scale.py --llm-rows: a row whose window still held a decode-graph capture (`steady: false`, 4 x H200
    2026-11-29: a 3-rollout-GPU row capturing at step 10 of 10) is not a rate: left out, said; rows carry the
    learner's rows a pass (16 where the bench's row has no column)."""
    import json

    spec = importlib.util.spec_from_file_location("scale_bench", ROOT / "bench" / "scale.py")
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    row = {"mode": "async", "placement": "dedicated", "env_latency_ms": 0.0, "batch": 64}
    src = tmp_path / "rows.json"
    src.write_text(json.dumps([{**row, "gpus": 2, "samples_per_s": 30.0, "steady": True},
                               {**row, "gpus": 3, "samples_per_s": 54.0, "micro_batch_size": 0},
                               {**row, "gpus": 4, "samples_per_s": 20.0, "steady": False, "steady_steps": [3]}]))
    rows = scale.llm_policy_rows(str(src))
    assert [(r["gpus"], r["micro_batch_size"]) for r in rows] == [(2, 16), (3, 0)]
    assert rows[1]["of_linear"] == pytest.approx(0.9) and "4-GPU row has no capture-free" in capsys.readouterr().out


def test_async_bench_plan_keeps_the_sync_reference_unless_told() -> None:
    """bench/async_llm_policy.py: every base case measures the sync loop first (its rows' reference);
    --no-sync-reference (a diagnosis run) leaves only the async rows."""
    bench = _async_bench()
    base = ["--tasks", "arith", "--cases", "base", "--gpus", "2"]
    assert bench._plan(bench._args(base)) == [("arith", "sync", 0.0, 1), ("arith", "async", 0.0, 2)]
    assert bench._plan(bench._args(base + ["--no-sync-reference"])) == [("arith", "async", 0.0, 2)]


def test_async_bench_ray_backend_places_one_engine_actor_per_rollout_gpu(tmp_path) -> None:
    """--pool-backend ray: G - 1 engine actors (the learner keeps cuda:0), no in-process rollout devices; only
    with --placement dedicated."""
    import pytest

    pytest.importorskip("ray")
    bench = _async_bench()
    a = bench._args(["--tasks", "arith", "--cases", "base", "--gpus", "3", "--placement", "dedicated",
                     "--pool-backend", "ray"])
    cfg = bench._config(a, "arith", "async", 0.0, 3, tmp_path / "r", None)
    assert cfg.pool_backend == "ray" and cfg.ray_engines == 2 and cfg.rollout_devices == ""
    local = bench._config(bench._args(["--gpus", "3", "--placement", "dedicated"]), "arith", "async", 0.0, 3,
                          tmp_path / "l", None)
    assert local.pool_backend == "local" and local.rollout_devices == "cuda:1,cuda:2"
    with pytest.raises(SystemExit, match="needs --placement dedicated"):
        bench.main(["--gpus", "2", "--pool-backend", "ray"])


def test_async_bench_places_copies_and_names_the_learners_gpu(tmp_path, monkeypatch) -> None:
    """--placement copies: every engine a copy (weight_sync copy), one per GPU including the learner's; every row's
    learner on cuda:0 by name (2026-11-29: "auto" had followed a current GPU that JAX's start left on cuda:1)."""
    import torch

    bench = _async_bench()
    cpu = bench._config(bench._args(["--gpus", "2", "--placement", "copies"]), "arith", "async", 0.0, 2,
                        tmp_path / "c", None)
    assert cpu.weight_sync == "copy" and cpu.rollout_devices == "cpu" and cpu.device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    two = bench._config(bench._args(["--gpus", "2", "--placement", "copies"]), "arith", "async", 0.0, 2,
                        tmp_path / "g", None)
    assert two.weight_sync == "copy" and two.rollout_devices == "cuda:0,cuda:1" and two.device == "cuda:0"
    one = bench._config(bench._args(["--gpus", "1", "--placement", "copies"]), "arith", "async", 0.0, 1,
                        tmp_path / "o", None)
    assert one.rollout_devices == "cuda:0" and one.weight_sync == "copy"
    ded = bench._config(bench._args(["--gpus", "2", "--placement", "dedicated"]), "arith", "async", 0.0, 2,
                        tmp_path / "d", None)
    assert ded.device == "cuda:0" and ded.rollout_devices == "cuda:1" and ded.weight_sync == "shared"
    sync = bench._config(bench._args(["--gpus", "2"]), "arith", "sync", 0.0, 1, tmp_path / "s", None)
    assert sync.device == "cuda:0" and sync.rollout_devices == ""


def test_craftax_bench_leaves_the_profiled_step_out_of_its_rates() -> None:
    spec = importlib.util.spec_from_file_location("llm_policy_craftax", ROOT / "bench" / "llm_policy_craftax.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.steady_steps([0, 1, 2, 3], 3) == [1, 2]
    assert bench.steady_steps([0, 1, 2, 3], None) == [1, 2, 3]
    assert bench.steady_steps([0, 1], 1) == [1]  # nothing else after the first: the profiled step
    assert bench.steady_steps([0], None) == [0]
    assert bench.steady_steps([0, 1, 2, 3], 2, 3) == [1]  # the learner-profiled and the rollout-profiled steps
    # the settled steps: those that captured no decode or prefill graph (a capture's one-time cost left out)
    steps = [{"engine/graph_captures": 1.0}, {"engine/prefill_graph_captures": 2.0}, {"engine/graph_captures": 0.0},
             {}]
    assert bench.settled_steps(steps) == steps[2:]
    assert bench.settled_steps(steps[:2]) == []
    # the env's cumulative host-time counters: each steady step's own share, the median over the steady steps
    recs = [{"env_time/render_s": 5.0, "env_time/fetch_s": 1.0}, {"env_time/render_s": 5.5, "env_time/fetch_s": 1.25},
            {"env_time/render_s": 6.5, "env_time/fetch_s": 1.5}, {"env_time/render_s": 7.0, "env_time/fetch_s": 1.75}]
    assert bench.env_phases(recs, recs[1:]) == {"env_fetch_s": 0.25, "env_render_s": 0.5}
    assert bench.env_phases(recs, recs[2:3]) == {"env_fetch_s": 0.25, "env_render_s": 1.0}
    assert bench.env_phases([{}, {}], [{}]) == {}


def test_craftax_bench_patches_the_rollout_module_and_undoes_it() -> None:
    """--submit-chunk and --profile-rollout reach the code the train step runs (the rollout *module*'s constant,
    the loop module's `rollout`), and are undone after the block, also after an error. (A first version set the
    constant on the package's `rollout` function: no error, no effect.)"""
    import importlib

    spec = importlib.util.spec_from_file_location("llm_policy_craftax", ROOT / "bench" / "llm_policy_craftax.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    loop = importlib.import_module("thinkcraft.train.llm_policy.loop")
    module = importlib.import_module("thinkcraft.train.llm_policy.rollout")
    plain, chunk = loop.rollout, module.SUBMIT_CHUNK
    seen = []
    wrap = lambda f: (lambda *a, **k: seen.append(f) or f(*a, **k))  # noqa: E731
    with bench.rollout_patches(chunk + 7, wrap):
        assert module.SUBMIT_CHUNK == chunk + 7 and loop.rollout is not plain
        assert module._Continuous.__init__.__globals__["SUBMIT_CHUNK"] == chunk + 7  # what the rollout reads
    assert (loop.rollout, module.SUBMIT_CHUNK) == (plain, chunk)
    with pytest.raises(RuntimeError), bench.rollout_patches(None, wrap):
        assert module.SUBMIT_CHUNK == chunk  # None keeps the library's
        raise RuntimeError
    assert (loop.rollout, module.SUBMIT_CHUNK) == (plain, chunk)


def test_craftax_bench_variants_take_turns_and_are_summed_apart(monkeypatch) -> None:
    """--variants: step 0 takes the first setting, then each in turn; a setting is in effect for its rollout only
    (SUBMIT_CHUNK, THINKCRAFT_ENV_CHUNKED put back, also after an error); each setting's rates leave out its first
    step and the profiled ones; bad specs are one clear error each."""
    import importlib
    import os

    spec = importlib.util.spec_from_file_location("llm_policy_craftax", ROOT / "bench" / "llm_policy_craftax.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.parse_variant("chunk=128,env_chunked=1") == {"chunk": 128, "env_chunked": 1}
    assert bench.parse_variant("prefill_pad=1") == {"prefill_pad": 1}
    assert bench.parse_variant("first=16,chunk=128") == {"first": 16, "chunk": 128}
    for bad, says in (("chunk=0", "chunk must be >= 1"), ("env_chunked=2", "env_chunked must be 0 or 1"),
                      ("prefill_pad=3", "prefill_pad must be 0 or 1"), ("first=-1", "first must be >= 0"),
                      ("chunk", "not KEY=VALUE"), ("chunks=1", "not KEY=VALUE"), ("chunk=1,chunk=2", "given twice")):
        with pytest.raises(ValueError, match=says):
            bench.parse_variant(bad)
    assert [bench.variant_of_step(3, i) for i in range(8)] == [0, 0, 1, 2, 0, 1, 2, 0]
    module = importlib.import_module("thinkcraft.train.llm_policy.rollout")
    chunk = module.SUBMIT_CHUNK
    monkeypatch.delenv("THINKCRAFT_ENV_CHUNKED", raising=False)
    with bench.variant_applied({"chunk": 64, "env_chunked": 1, "first": 8}, module):
        assert module.SUBMIT_CHUNK == 64 and module._Continuous.__init__.__globals__["SUBMIT_CHUNK"] == 64
        assert module.submit_bounds(100) == [(0, 8), (8, 72), (72, 100)]  # what the rollout's boundary reads
        assert os.environ["THINKCRAFT_ENV_CHUNKED"] == "1"
    assert module.SUBMIT_CHUNK == chunk and module.SUBMIT_FIRST == 0 and "THINKCRAFT_ENV_CHUNKED" not in os.environ
    monkeypatch.setenv("THINKCRAFT_ENV_CHUNKED", "0")
    monkeypatch.delenv("THINKCRAFT_PREFILL_PAD", raising=False)
    with pytest.raises(RuntimeError), bench.variant_applied({"env_chunked": 1, "prefill_pad": 1}, module):
        from thinkcraft.llm.hf.prefill_graphs import prefill_pad_on

        assert prefill_pad_on()  # what each eager prefill reads
        raise RuntimeError
    assert "THINKCRAFT_PREFILL_PAD" not in os.environ
    assert os.environ["THINKCRAFT_ENV_CHUNKED"] == "0" and module.SUBMIT_CHUNK == chunk
    # steps 0..6 with 2 settings: 0 -> A (compiles), then A B A B A B; step 5 profiled
    recs = [{"episode/turns": 2.0, "timing/step": 2.0, "timing/rollout": 1.0 + i, "engine/prefill_calls": float(i)}
            for i in range(7)]
    rows = bench.variant_rows(recs, ["chunk=256", "chunk=128"], 4, {5})
    assert [r["steps"] for r in rows] == [[3], [4, 6]]  # A: 1 (its first), 3, 5 (profiled); B: 2 (first), 4, 6
    assert rows[0]["rollout_decisions_per_s"] == round(8 / 4.0, 1) and rows[1]["rollout_s"] == 6.0
    assert rows[1]["prefill_calls"] == 5.0
    with pytest.raises(SystemExit):
        bench._args(["--variants", "chunk=64", "chunk=128", "--steps", "4"])  # needs 5 steps
    assert bench._args(["--quick", "--variants", "chunk=1", "chunk=2"]).steps == 5


def test_async_bench_weak_scaling_gives_each_rollout_engine_the_same_prompts(tmp_path) -> None:
    """--prompts-per-engine N: sync N prompts, async N per rollout engine (dedicated: the learner's GPU has
    none), its workers (η + 1) x its prompts; the rollout scaling reads each row against the fewest rollout
    GPUs, per GPU added."""
    bench = _async_bench()
    a = bench._args(["--tasks", "arith", "--cases", "base", "--gpus", "2", "3", "--placement", "dedicated",
                     "--prompts-per-engine", "8"])
    sync = bench._config(a, "arith", "sync", 0.0, 1, tmp_path / "s", None)
    three = bench._config(a, "arith", "async", 0.0, 3, tmp_path / "a", None)
    assert sync.prompts_per_step == 8 and three.prompts_per_step == 16 and three.rollout_workers == 32
    fixed = bench._config(bench._args(["--gpus", "3", "--placement", "dedicated"]), "arith", "async", 0.0, 3,
                          tmp_path / "f", None)
    assert fixed.prompts_per_step == 16 and fixed.rollout_workers == 32
    rows = [{"task": "arith", "mode": "async", "placement": "dedicated", "env_latency_ms": 0.0, "gpus": g,
             "samples_per_s": s, "batch": b} for g, s, b in [(2, 20.0, 32), (3, 36.0, 64), (4, 30.0, 96)]]
    lines = bench.rollout_scaling(rows)
    assert len(lines) == 2 and "0.90 of linear" in lines[0] and "0.50 of linear" in lines[1]
    import pytest

    with pytest.raises(SystemExit):
        bench._args(["--prompts-per-engine", "0"])


def _scale_bench():
    spec = importlib.util.spec_from_file_location("scale_bench", ROOT / "bench" / "scale.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_scale_bench_rows_carry_their_reference_and_the_llm_rows_come_from_the_async_bench(tmp_path) -> None:
    """bench/scale.py: each row's reference is its job's row on one GPU (llm-policy: one rollout GPU + the
    learner) at the same skip_n, the rate read from the job's own column; llm-policy rows are read from an
    async bench file (its dedicated async rows only), with their fraction of linear scaling per rollout GPU."""
    import pytest

    bench = _scale_bench()
    rows = bench.with_references([
        {"job": "ppo", "gpus": 1, "skip_n": None, "sps": 100.0}, {"job": "ppo", "gpus": 2, "skip_n": None, "sps": 190.0},
        {"job": "ppo-hidden", "gpus": 1, "skip_n": 25, "sps": 10.0}, {"job": "ppo-hidden", "gpus": 4, "skip_n": 25, "sps": 30.0},
        {"job": "refresh", "gpus": 1, "skip_n": None, "refreshes_per_s": 4.0},
        {"job": "refresh", "gpus": 4, "skip_n": None, "refreshes_per_s": 10.0}])
    assert [r["speedup"] for r in rows] == [1.0, 1.9, 1.0, 3.0, 1.0, 2.5]
    assert rows[1]["goal"] == "speedup >= 1.9" and rows[3]["goal"] == "sps >= 30000"
    src = tmp_path / "async.json"
    src.write_text(json.dumps([
        {"task": "arith", "mode": "sync", "gpus": 1, "samples_per_s": 16.0, "env_latency_ms": 0.0},
        {"task": "arith", "mode": "async", "gpus": 2, "placement": "dedicated", "samples_per_s": 20.0,
         "env_latency_ms": 0.0, "batch": 64, "card": "H", "date": "d"},
        {"task": "arith", "mode": "async", "gpus": 3, "placement": "dedicated", "samples_per_s": 36.0,
         "env_latency_ms": 0.0, "batch": 128, "card": "H", "date": "d"},
        {"task": "arith", "mode": "async", "gpus": 4, "placement": "dedicated", "error": "OOM", "env_latency_ms": 0.0}]))
    llm = bench.with_references(bench.llm_policy_rows(str(src)))
    assert [(r["gpus"], r["samples_per_s"], r["one_gpu_reference"]) for r in llm] == [(2, 20.0, 20.0), (3, 36.0, 20.0)]
    assert llm[1]["of_linear"] == pytest.approx(0.9) and llm[1]["goal"] == "of_linear >= 0.8" and llm[1]["card"] == "H"
    assert bench.llm_policy_rows(None) == []
    src.write_text(json.dumps([{"mode": "async", "gpus": 3, "placement": "dedicated", "samples_per_s": 1.0}]))
    with pytest.raises(SystemExit, match="no reference"):
        bench.llm_policy_rows(str(src))
