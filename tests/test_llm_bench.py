"""bench/engine.py --quick runs end to end on CPU and writes the documented JSON (so it is not debugged on
the GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_engine_bench_quick_writes_rows(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "bench" / "engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "engine.json"
    assert mod.main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    kinds = {r["kind"] for r in rows}
    assert {"raw", "no_reuse", "reuse", "reuse_first", "repeat_kv", "hf_generate", "engine_dynamic", "engine_static"} <= kinds
    for r in rows:
        assert {"kind", "batch", "prefix_tokens", "suffix_tokens", "seconds", "suffix_tok_per_s", "decode_tok_per_s", "card", "date"} <= set(r)
        assert r["seconds"] and r["seconds"] > 0, r
    for r in rows:
        if r["kind"] == "reuse":  # the cascade path agrees with the plain one on the bench model too
            assert r["max_abs_diff_vs_no_reuse"] < 1e-3 * max(1.0, r["max_abs_ref"])
    assert any(k.startswith("reuse_vs_raw_prefill@") for k in data["summary"])
    assert any(k.startswith("decode_vs_hf_generate@") for k in data["summary"])
    assert data["complete"] is True
