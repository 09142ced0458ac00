"""`thinkcraft demo` end to end on tiny settings: the files the README promises, with sane content."""

from __future__ import annotations

import json
import math

import pytest

from thinkcraft.cli import main
from thinkcraft.utils.errors import UserError


@pytest.mark.slow
def test_demo_leaves_metrics_checkpoint_and_curve(tmp_path):
    from thinkcraft.llm.models import resolve_model

    try:
        resolve_model("default")
    except UserError as e:
        pytest.skip(f"bundled model not available: {e}")
    # 2 envs x 64 steps a update, 2 updates; the LLM read at layer 2 (cheap) every 32 steps
    args = ["demo", "--num-envs", "2", "--total-timesteps", "256", "--skip-n", "32", "--layer", "2",
            "--runs-dir", str(tmp_path), "--run-name", "demo"]
    assert main(args) == 0
    run = tmp_path / "demo"

    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [128, 256] and [r["update"] for r in recs] == [1, 2]
    for r in recs:
        assert r["sps"] > 0 and math.isfinite(r["losses/total"]) and 0 < r["losses/entropy"] <= math.log(17) + 1e-3
        assert 0 <= r["llm/share"] <= 1

    meta = json.loads((run / "checkpoint" / "latest.json").read_text())
    assert meta["update"] == 2 and meta["env_steps"] == 256
    ck = run / "checkpoint" / meta["checkpoint"]  # checkpoint/<update>/, verified by its manifest
    assert meta["checkpoint"] == "00000002" and set(meta["files"]) == {"state.msgpack", "params.msgpack"}
    for name, rec in meta["files"].items():
        assert (ck / name).stat().st_size == rec["bytes"] > 10_000

    png = (run / "curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5_000

    # a second demo into the same runs dir replaces the run (the demo is re-runnable)
    assert main(args) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
