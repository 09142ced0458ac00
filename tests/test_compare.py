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
    assert rc == 2 and "--metric episode/retrun: no run logged it; available: achievements/mean_rate, episode/return" in err
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
