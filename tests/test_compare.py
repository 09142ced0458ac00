"""`thinkcraft compare` end to end on tiny synthetic run directories: seeds split by seed_index, groups from
differing config fields / --group-by / --label, the JSON's numbers against a direct computation, and the
one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import trim_mean

from thinkcraft.analysis.runs import assign_groups, differing_fields, load_seed_runs
from thinkcraft.analysis.testing import write_fake_run
from thinkcraft.cli import main

BASE = {"env_name": "Craftax-Classic-Symbolic-v1", "num_envs": 64, "lr": 2e-4, "total_timesteps": 1_000_000}


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """runs/: three single-seed lr=2e-4 dirs (differing only in name and seed), one 4-seed lr=5e-4 dir."""
    root = tmp_path / "runs"
    for s in range(3):
        write_fake_run(root / f"ppo-a-s{s}", {**BASE, "run_name": f"ppo-a-s{s}", "overwrite": s == 1}, seed=s,
                       final_return=10.0)
    write_fake_run(root / "ppo-b", {**BASE, "lr": 5e-4, "run_name": "ppo-b"}, num_seeds=4, seed=10, final_return=14.0)
    return root


def _compare(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(["compare", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_compare_end_to_end(runs: Path, tmp_path: Path, capsys):
    out_dir = tmp_path / "cmp"
    rc, out, err = _compare([str(runs / "ppo-*"), "--metric", "episode/return", "achievements/mean_rate",
                             "--out", str(out_dir), "--bootstrap-samples", "300"], capsys)
    assert rc == 0, err
    assert (out_dir / "compare.png").stat().st_size > 10_000
    assert f"wrote {out_dir / 'compare.json'}" in " ".join(err.split())
    res = json.loads((out_dir / "compare.json").read_text())
    assert res["group_fields"] == ["lr"]
    labels = [g["label"] for g in res["groups"]]
    assert labels == ["lr=0.0002", "lr=0.0005"]
    a, b = res["groups"]
    assert [r["seed"] for r in a["runs"]] == [0, 1, 2]
    assert [(r["seed_index"], r["seed"]) for r in b["runs"]] == [(0, 10), (1, 11), (2, 12), (3, 13)]
    for g in (a, b):
        m = g["metrics"]["episode/return"]
        assert m["n_seeds"] == len(g["runs"])
        assert m["iqm"]["low"] <= m["iqm"]["point"] <= m["iqm"]["high"]
        curve = m["curve"]
        assert len(curve["step"]) == 100 and curve["step"][-1] == 1_000_000
        assert all(lo <= mu <= hi for lo, mu, hi in zip(curve["low"], curve["mean"], curve["high"]))
    # finals recomputed from the raw records: mean of the records with step > 0.9 × the last step
    recs = [json.loads(x) for x in (runs / "ppo-b" / "metrics.jsonl").read_text().splitlines()]
    finals = [np.mean([r["episode/return"] for r in recs if r["seed_index"] == i and r["step"] > 900_000])
              for i in range(4)]
    got = [f["final"] for f in b["metrics"]["episode/return"]["finals"]]
    np.testing.assert_allclose(got, finals)
    assert b["metrics"]["episode/return"]["iqm"]["point"] == pytest.approx(trim_mean(finals, 0.25))
    assert b["metrics"]["episode/return"]["mean"]["point"] == pytest.approx(np.mean(finals))
    pi = res["probability_of_improvement"]["episode/return"]
    assert [(d["x"], d["y"]) for d in pi] == [("lr=0.0002", "lr=0.0005")]
    assert pi[0]["p"] == 0.0  # every lr=5e-4 seed ends near 14, every lr=2e-4 seed near 10
    assert "IQM [95% CI]" in out and "lr=0.0005" in out and "P(lr=0.0002 > lr=0.0005) = 0.00" in out


def test_compare_is_deterministic(runs: Path, tmp_path: Path, capsys):
    for name in ("x", "y"):
        assert _compare([str(runs / "ppo-*"), "--out", str(tmp_path / name), "--bootstrap-samples", "200"], capsys)[0] == 0
    assert (tmp_path / "x" / "compare.json").read_text() == (tmp_path / "y" / "compare.json").read_text()


def test_archived_runs_with_gzipped_metrics_compare_the_same(runs: Path, tmp_path: Path, capsys):
    """Runs kept in the repository store metrics.jsonl.gz (utils.metrics.run_metrics_path): compare gives the
    same JSON, and a resume gets one plain metrics.jsonl back (unpack_metrics) before it appends."""
    import gzip
    import shutil

    from thinkcraft.utils.metrics import read_metrics, run_metrics_path, unpack_metrics

    assert _compare([str(runs / "ppo-*"), "--out", str(tmp_path / "plain"), "--bootstrap-samples", "200"], capsys)[0] == 0
    packed = tmp_path / "packed"
    shutil.copytree(runs, packed)
    for d in packed.iterdir():
        m = d / "metrics.jsonl"
        (d / "metrics.jsonl.gz").write_bytes(gzip.compress(m.read_bytes()))
        m.unlink()
    assert _compare([str(packed / "ppo-*"), "--out", str(tmp_path / "gz"), "--bootstrap-samples", "200"], capsys)[0] == 0
    a = json.loads((tmp_path / "plain" / "compare.json").read_text())
    b = json.loads((tmp_path / "gz" / "compare.json").read_text().replace(str(packed), str(runs)))
    assert a["groups"] == b["groups"]
    d = packed / "ppo-b"
    want = read_metrics(d / "metrics.jsonl.gz")
    assert run_metrics_path(d) == d / "metrics.jsonl.gz"
    unpack_metrics(d)
    assert run_metrics_path(d) == d / "metrics.jsonl" and not (d / "metrics.jsonl.gz").exists()
    assert read_metrics(d / "metrics.jsonl") == want


def test_group_by_and_labels(runs: Path, tmp_path: Path, capsys):
    dirs = [str(runs / f"ppo-a-s{s}") for s in range(3)] + [str(runs / "ppo-b")]
    rc, _, err = _compare([*dirs, "--group-by", "env_name", "--out", str(tmp_path / "g")], capsys)
    assert rc == 0, err
    res = json.loads((tmp_path / "g" / "compare.json").read_text())
    assert [(g["label"], len(g["runs"])) for g in res["groups"]] == [("env_name=Craftax-Classic-Symbolic-v1", 7)]
    rc, _, err = _compare([*dirs, "--label", f"{dirs[0]}=first", "--label", f"{dirs[3]}=first",
                           "--out", str(tmp_path / "l")], capsys)
    assert rc == 0, err
    res = json.loads((tmp_path / "l" / "compare.json").read_text())
    # two labelled dirs pool into `first` (1 + 4 seeds); the other two group by their own differing fields
    assert [(g["label"], len(g["runs"])) for g in res["groups"]] == [("first", 5), ("Craftax-Classic-Symbolic-v1", 2)]


def test_groups_ignore_names_seeds_and_logging(runs: Path):
    seeds = [s for d in sorted(runs.iterdir()) for s in load_seed_runs(d)[0]]
    assert differing_fields([s.config for s in seeds]) == ["lr"]
    groups, fields = assign_groups(seeds)
    assert fields == ["lr"] and [len(v) for v in groups.values()] == [3, 4]


def test_labels_name_the_fewest_separating_fields():
    from thinkcraft.analysis.runs import label_fields

    mlp = {"policy": "mlp", "lr": 2e-4, "icm_lr": 3e-4, "train_icm": False}  # fields only one script has
    rnn = {"policy": "rnn", "lr": 2e-4}
    configs = [mlp, rnn, {**rnn, "lr": 1e-3}]
    assert label_fields(configs, differing_fields(configs)) == ["lr", "policy"]
    assert label_fields(configs[:2], differing_fields(configs[:2])) == ["policy"]


def test_system_defaults_to_thinkcraft(tmp_path: Path, capsys):
    write_fake_run(tmp_path / "ours", BASE, num_seeds=2)
    write_fake_run(tmp_path / "theirs", {**BASE, "system": "baselines"}, num_seeds=2, seed=5)
    rc, _, err = _compare([str(tmp_path / "ours"), str(tmp_path / "theirs"), "--out", str(tmp_path / "o")], capsys)
    assert rc == 0, err
    res = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert [g["label"] for g in res["groups"]] == ["system=thinkcraft", "system=baselines"]


def test_errors_are_one_line(runs: Path, tmp_path: Path, capsys):
    rc, _, err = _compare([str(tmp_path / "nothing-*")], capsys)
    assert rc == 2 and "no run directories (with a metrics.jsonl) matched" in err
    rc, _, err = _compare([str(tmp_path / "missing")], capsys)
    assert rc == 2 and "no such run directory" in err
    (tmp_path / "empty").mkdir()
    rc, _, err = _compare([str(tmp_path / "empty")], capsys)
    assert rc == 2 and "has no metrics.jsonl" in err
    rc, _, err = _compare([str(runs / "ppo-b"), "--metric", "episode/retrun"], capsys)
    assert rc == 2 and "--metric episode/retrun: no run logged it; available: achievements/mean_rate, episode/length, episode/return" in err
    assert "achievements/<name> (2 names" in err and "Traceback" not in err
    rc, _, err = _compare([str(runs / "ppo-b"), "--group-by", "nope"], capsys)
    assert rc == 2 and "--group-by nope: no run's config has that field" in err
    rc, _, err = _compare([str(runs / "ppo-b"), "--label", "ppo-b"], capsys)
    assert rc == 2 and "expected DIR=name" in err
    rc, _, err = _compare([str(runs / "ppo-b"), "--final-frac", "2"], capsys)
    assert rc == 2 and "--final-frac" in err


def test_single_seed_warns_and_glob_skips_non_runs(runs: Path, tmp_path: Path, capsys):
    (runs / "compare-old").mkdir()  # a previous compare's output dir matched by the glob
    rc, out, err = _compare([str(runs / "*-s0"), str(runs / "compare-*"), "--out", str(tmp_path / "o")], capsys)
    assert rc == 0, err
    err = " ".join(err.split())
    assert "has a single seed: its confidence intervals need several seeds" in err
    assert "skipped 1 matched directory without metrics.jsonl" in err
    assert "IQM" in out


def test_mixed_seed_index_is_an_error(tmp_path: Path, capsys):
    d = write_fake_run(tmp_path / "r", BASE, num_seeds=2)
    with open(d / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "episode/return": 1.0}) + "\n")
    rc, _, err = _compare([str(d)], capsys)
    assert rc == 2 and "some records carry seed_index and some do not" in err


def test_metric_glob_patterns(runs: Path, tmp_path: Path, capsys):
    rc, out, err = _compare([str(runs / "ppo-b"), "--metric", "achievements/*", "--no-plot", "--out", str(tmp_path / "o")],
                            capsys)
    assert rc == 0, err
    res = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert sorted(res["groups"][0]["metrics"]) == ["achievements/collect_wood", "achievements/mean_rate",
                                                   "achievements/place_table"]
    assert not (tmp_path / "o" / "compare.png").exists()
    rc, _, err = _compare([str(runs / "ppo-b"), "--metric", "losses/*"], capsys)
    assert rc == 2 and "--metric losses/*: no run logged it" in err


# --- bench/baselines_adapter.py and bench/ppo_parity.py (the logic; the real runs are GPU work) -------------

ROOT = Path(__file__).resolve().parents[1]


def _bench_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_baselines_log_conversion():
    adapter = _bench_module("baselines_adapter")
    log = {"episode_return": np.float32(3.0), "episode_length": np.float32(150.0),
           "Achievements/collect_wood": np.float32(80.0), "Achievements/place_table": np.float32(20.0),
           "achievements": np.float32(1.0)}
    rec = adapter.convert_log(log, update_step=0, num_envs=16, num_steps=8, max_return=22.0)
    assert rec["step"] == 128 and rec["update"] == 1
    assert rec["episode/return"] == 3.0 and rec["episode/length"] == 150.0
    assert rec["achievements/collect_wood"] == pytest.approx(0.8) and rec["achievements/place_table"] == pytest.approx(0.2)
    assert rec["achievements/mean_rate"] == pytest.approx(0.5)
    assert rec["episode/return_pct_max"] == pytest.approx(100 * 3 / 22)
    # an update in which no episode ended: their means are 0/0 = NaN -> absent, as in our metrics
    nan = {k: np.float32("nan") for k in log}
    assert adapter.convert_log(nan, 4, 16, 8, 22.0) == {"step": 640, "update": 5}


def test_baselines_seed_recorder_orders_and_checks_seeds():
    adapter = _bench_module("baselines_adapter")
    recs: list[dict] = []
    r = adapter.SeedRecorder(recs.append)
    r.configure({"ENV_NAME": "Craftax-Classic-Symbolic-v1", "NUM_REPEATS": 2, "NUM_ENVS": 4, "NUM_STEPS": 2,
                 "NUM_UPDATES": 2})
    log = {"episode_return": 1.0, "episode_length": 2.0, "Achievements/collect_wood": 100.0}
    for u in (0, 0, 1):
        r(np.int32(u), log)
    assert [(x["step"], x["seed_index"]) for x in recs] == [(8, 0), (8, 1), (16, 0)]
    with pytest.raises(RuntimeError, match="logged 2 of 2 updates; updates not logged once per seed"):
        r.check_complete()
    r(1, log)
    r.check_complete()
    with pytest.raises(RuntimeError, match="more than NUM_REPEATS=2"):
        r(1, log)


def test_ppo_parity_dry_mode(tmp_path: Path, capsys):
    """The parity script's whole path after training: run dirs of both systems -> compare (curves, tables,
    achievements) -> verdict -> result rows."""
    parity = _bench_module("ppo_parity")
    assert parity.main(["--dry", "--runs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ours IQM" in out and "Baselines' IQM 95% CI" in out and "collect_wood" in out
    rows = json.loads((tmp_path / "ppo_parity.json").read_text())
    assert {(r["system"], r["seed"]) for r in rows} == {("thinkcraft", 0), ("thinkcraft", 1), ("baselines", 0),
                                                        ("baselines", 1)}
    for r in rows:
        assert {"system", "policy", "seed", "steps", "final_return"} <= set(r) and r["policy"] == "mlp"
        assert r["steps"] > 0 and np.isfinite(r["final_return"])
    cmp_dir = tmp_path / "compare-mlp"
    assert (cmp_dir / "compare.png").exists() and (cmp_dir / "achievements.json").exists()
    res = json.loads((cmp_dir / "compare.json").read_text())
    finals = {g["label"]: [f["final"] for f in g["metrics"]["episode/return"]["finals"]] for g in res["groups"]}
    assert sorted(r["final_return"] for r in rows if r["system"] == "baselines") == sorted(finals["system=baselines"])
    assert parity.verdict(*(parity.Interval(*x) for x in [(5, 4, 6), (3, 2, 4)])) == "above"


@pytest.mark.slow
def test_baselines_adapter_runs_their_ppo(tmp_path: Path):
    """Their unmodified ppo.py (Classic, 2 seeds, tiny) through the adapter: one record per update and seed,
    in our field names; compare reads the result. Needs a Craftax_Baselines checkout (.ref/ or
    $CRAFTAX_BASELINES_DIR)."""
    import os
    import subprocess
    import sys

    bdir = Path(os.environ.get("CRAFTAX_BASELINES_DIR", ROOT / ".ref" / "Craftax_Baselines"))
    if not (bdir / "ppo.py").exists():
        pytest.skip(f"no Craftax_Baselines checkout at {bdir}")
    out = tmp_path / "bl"
    cmd = [sys.executable, str(ROOT / "bench" / "baselines_adapter.py"), "--baselines-dir", str(bdir), "--out", str(out),
           "--", "--env_name", "Craftax-Classic-Symbolic-v1", "--num_envs", "16", "--num_steps", "16",
           "--total_timesteps", "1024", "--num_repeats", "2", "--seed", "0", "--layer_size", "64",
           "--num_minibatches", "2", "--update_epochs", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["system"] == "baselines" and cfg["policy"] == "mlp" and cfg["num_seeds"] == 2
    assert cfg["_derived"]["num_updates"] == 4
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["seed_index"]) for r in recs] == [(s * 256, i) for s in range(1, 5) for i in range(2)]
    for r in recs:
        for k, v in r.items():
            if k.startswith("achievements/"):
                assert 0.0 <= v <= 1.0
    seeds, _ = load_seed_runs(out)
    assert [(s.seed_index, s.seed) for s in seeds] == [(0, 0), (1, 1)]
