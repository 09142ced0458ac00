"""`thinkcraft data inspect` / `data export` on a small store, and their bad-input messages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from thinkcraft.cli import main
from thinkcraft.data import TrajectoryMetadata, TrajectoryRecord, TrajectoryWriter, Turn

ROOT = Path(__file__).resolve().parents[1]


def small_store(root: Path) -> list[Path]:
    with TrajectoryWriter(root, run="demo", max_per_file=4) as w:
        for i in range(10):
            turns = [
                Turn(think="hmm", act=["up", "do"][j % 2], obs=f"tree {i}", reward=float(i % 2 and j == 0),
                     prompt_token_ids=list(range(30)), response_token_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3],
                     loss_mask=[1, 1, 0])
                for j in range(3 + i % 3)
            ]
            md = TrajectoryMetadata(env_version="craftax-1.6.1", wall_time=2.0, truncated=i == 3, env_errors=int(i == 7),
                                    policy_version=i // 4)
            w.add(TrajectoryRecord.build(f"task-{i}", turns, md, trajectory_id=f"t{i}"), learner_step=i // 4 + 1)
    return w.files_written


def test_inspect_small_store(tmp_path, capsys):
    small_store(tmp_path)
    assert main(["data", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "trajectories" in out and "10" in out and "demo: 10" in out
    assert "10.0%" in out  # truncation rate and env-error rate: 1 of 10 each
    assert "prompt_token_ids stored" in out
    # steps as the run's metrics.jsonl numbers them (the writer's learner_step), lag 1 = on-policy
    assert "learner steps (metrics.jsonl steps)" in out and "1 .. 3" in out

    assert main(["data", "inspect", str(tmp_path), "--json", "--plot"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["num_trajectories"] == 10 and d["num_files"] == 3
    assert d["truncation_rate"] == 0.1 and d["env_error_rate"] == 0.1 and d["env_errors_total"] == 1
    assert d["frac_positive"] == 0.5
    assert d["turns"]["min"] == 3 and d["turns"]["max"] == 5
    assert d["token_values_stored"]["prompt_token_ids"] == 30 * d["turns"]["total"]
    assert d["token_values_stored"]["loss_mask"] == 3 * d["turns"]["total"]
    assert d["policy_versions"]["max"] == 2 and d["num_policy_versions"] == 3
    assert d["policy_lag"]["min"] == 1 and d["policy_lag"]["max"] == 1
    png = Path(d["plot"])
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_bad_inputs_give_one_line(tmp_path, capsys):
    assert main(["data", "inspect", str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "x.txt").write_text("not a store")
    assert main(["data", "inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a trajectory store" in err and len(err.strip().splitlines()) == 1

    store = tmp_path / "store"
    files = small_store(store)
    # one file of another schema version, one corrupt: both named, neither fatal
    t = pq.read_table(files[0])
    meta = dict(t.schema.metadata)
    meta[b"thinkcraft.schema_version"] = b"9"
    pq.write_table(t.replace_schema_metadata(meta), files[0])
    files[1].write_bytes(b"PAR1 garbage")
    assert main(["data", "inspect", str(store), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["num_trajectories"] == 2
    assert d["other_version"] == [[str(files[0]), "9"]]
    assert d["corrupt"][0][0] == str(files[1])
    assert main(["data", "inspect", str(store)]) == 0
    out = capsys.readouterr().out
    assert "schema version 9, skipped" in out and files[1].name[:20] in out
    # reading records from that store is refused with a message that names the version
    assert main(["data", "export", str(store)]) == 2
    assert "schema version 9" in capsys.readouterr().err
    # config validation runs while tyro parses (it reports the ConfigError and exits 2)
    try:
        code = main(["data", "inspect", str(store), "--max-files-shown", "-1"])
    except SystemExit as e:
        code = e.code
    assert code == 2 and "--max-files-shown: must be >= 0" in capsys.readouterr().err


def test_export_jsonl(tmp_path, capsys):
    small_store(tmp_path / "s")
    out = tmp_path / "episodes.jsonl"
    assert main(["data", "export", str(tmp_path / "s"), "--format", "jsonl", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 10
    first = json.loads(lines[0])
    assert first["trajectory_id"] == "t0" and first["turns"][0]["act"] == "up" and "prompt_token_ids" not in first["turns"][0]
    assert first["metadata"]["env_version"] == "craftax-1.6.1"
    assert main(["data", "export", str(tmp_path / "s"), "--include-tokens", "--limit", "2"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert len(lines) == 2 and json.loads(lines[1])["turns"][0]["loss_mask"] == [1, 1, 0]


def test_cli_subprocess_entry_point(tmp_path):
    small_store(tmp_path)
    exe = Path(sys.executable).parent / "thinkcraft"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "thinkcraft"]
    r = subprocess.run(cmd + ["data", "inspect", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "trajectory store" in r.stdout
