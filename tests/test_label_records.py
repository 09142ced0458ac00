"""Errors and records of `thinkcraft label`: one-line errors before any model loads, failures with the raw
answer, a cumulative report.json, the exit code, re-asks with a larger budget, CPU thread choice."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from thinkcraft.cli import main
from thinkcraft.label.pipeline import LabelConfig, label
from thinkcraft.label.threads import ThreadPolicy, auto_threads, busy_cpus
from thinkcraft.llm.protocol import Completion
from thinkcraft.utils.errors import UserError


def _input(tmp_path, texts):
    p = tmp_path / "items.parquet"
    pq.write_table(pa.table({"text": texts}), p)
    return str(p)


class ScriptedEngine:
    """Answers by item: `bad*` -> prose; `long*` -> cut at the budget unless it is >= 16; else valid JSON."""

    def __init__(self):
        self.calls = []

    def generate(self, batch, sampling):
        self.calls.append((list(batch.items), sampling.max_new_tokens))
        out = []
        for it in batch.items:
            if it.startswith("bad"):
                text, fin = "Sure! The action is to move.", "stop"
            elif it.startswith("long") and sampling.max_new_tokens < 16:
                text, fin = '{"action": "a very long', "length"
            else:
                text, fin = json.dumps({"action": it}), "stop"
            out.append(Completion(token_ids=[1] * 4, text=text, logprobs=None, finish_reason=fin, prompt_token_ids=[0] * 5))
        return out


@pytest.mark.parametrize("item, match", [
    ("{text", "not a valid format string"), ("{}", "positional field"), ("{0}", "positional field"),
    ("no column", "uses no input column"),
])
def test_malformed_item_is_one_line(tmp_path, item, match, capsys):
    with pytest.raises(UserError, match=match):
        LabelConfig(input=_input(tmp_path, ["a"]), item=item)
    assert main(["label", "--input", _input(tmp_path, ["a"]), "--item", item, "--engine", "hf:/no/such/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and match in err


def test_item_that_cannot_be_filled_is_one_line(tmp_path):
    cfg = LabelConfig(input=_input(tmp_path, ["a"]), item="{text:d}", out_dir=str(tmp_path / "o"))
    with pytest.raises(UserError, match="cannot be filled"):
        label(cfg, engine=ScriptedEngine(), model_name="m")


@pytest.mark.parametrize("body, suffix, match", [
    ('prefix = "x\nitem = "{text}"', ".toml", "not valid TOML"),
    ('{"prefix": "x", "item": ', ".json", "not valid JSON"),
    ('["x"]', ".json", "expected a table"),
    ('prefix = 3\nitem = "{text}"', ".toml", "prefix must be a string"),
    ('item = "{text"', ".toml", "not a valid format string"),
    ('item = "{text}"\nschema = {type = "object", properties = {a = {type = "float"}}}', ".toml", "unsupported type"),
])
def test_malformed_template_file_is_one_line(tmp_path, body, suffix, match, capsys):
    tpl = tmp_path / f"t{suffix}"
    tpl.write_text(body)
    with pytest.raises(UserError, match=match):
        LabelConfig(input=_input(tmp_path, ["a"]), template=str(tpl))
    assert main(["label", "--input", _input(tmp_path, ["a"]), "--template", str(tpl)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and match in err


@pytest.mark.parametrize("schema, match", [
    ("{not json", "cannot read"), ('["a"]', "must be a JSON object"), ('{"type": "string"}', "must be an object"),
    ('{"type": "object", "properties": {"a": {"type": "str"}}}', "unsupported type 'str'"),
    ('{"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}', "grammar"),
])
def test_bad_schema_fails_before_the_model_loads(tmp_path, schema, match, capsys):
    s = tmp_path / "s.json"
    s.write_text(schema)
    # the engine names a model that does not exist: the schema error must come first
    args = ["label", "--input", _input(tmp_path, ["a"]), "--schema", str(s), "--engine", "hf:/no/such/model"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert match in err and "no/such/model" not in err and "Traceback" not in err


def test_failures_keep_the_raw_answer_and_the_report_is_cumulative(tmp_path):
    cfg = LabelConfig(input=_input(tmp_path, ["a", "b", "bad1", "long1"]), out_dir=str(tmp_path / "o"),
                      fields="action:string", max_new_tokens=8, schema_retries=1)
    eng = ScriptedEngine()
    rep = label(cfg, engine=eng, model_name="m")
    assert rep["labelled"] == 3 and rep["invalid"] == 1 and rep["first_pass_valid"] == 2
    assert rep["first_pass_valid_frac"] == 0.5 and rep["remaining"] == 1
    # the cut answer was asked again with twice the budget; the prose one with the same budget
    assert eng.calls[1:] == [(["bad1"], 8), (["long1"], 16)]
    fails = [json.loads(x) for x in (tmp_path / "o" / "failures.jsonl").read_text().splitlines()]
    assert len(fails) == 1 and fails[0]["answer"] == "Sure! The action is to move." and fails[0]["attempts"] == 2
    saved = json.loads((tmp_path / "o" / "report.json").read_text())
    assert saved["labelled"] == 3 and saved["unlabelled"] == 1 and saved["invalid"] == 1 and len(saved["runs"]) == 1
    # a re-run retries only the failed item; the report adds up, never resets
    rep2 = label(cfg, engine=ScriptedEngine(), model_name="m")
    assert rep2["to_label"] == 1 and rep2["labelled"] == 0
    saved2 = json.loads((tmp_path / "o" / "report.json").read_text())
    assert saved2["labelled"] == 3 and len(saved2["runs"]) == 2 and saved2["reasked"] == saved["reasked"] + 1
    assert saved2["completion_tokens"] == saved["completion_tokens"]
    # a retried item's first pass was in the first run: the first-pass rate stays 2 of the 4 first asked
    assert rep2["first_asked"] == 0 and saved2["first_pass_valid_frac"] == 0.5
    # once labelled, the item leaves failures.jsonl; a no-op run keeps every number
    inp2 = _input(tmp_path, ["a", "b", "fixed", "long1"])
    cfg2 = LabelConfig(input=inp2, out_dir=str(tmp_path / "o"), fields="action:string", max_new_tokens=8)
    label(cfg2, engine=ScriptedEngine(), model_name="m")
    before = json.loads((tmp_path / "o" / "report.json").read_text())
    assert before["labelled"] == 4 and before["unlabelled"] == 0
    assert (tmp_path / "o" / "failures.jsonl").read_text() == ""
    noop = label(cfg2, engine=ScriptedEngine(), model_name="m")
    after = json.loads((tmp_path / "o" / "report.json").read_text())
    assert noop["to_label"] == 0 and noop["labelled"] == 0
    for k in ("labelled", "completion_tokens", "prompt_tokens", "elapsed_s", "items_per_s", "runs", "last_run"):
        assert after[k] == before[k], k


def test_exit_code_when_items_stay_unlabelled(tmp_path):
    """Through the CLI with a real (tiny, random) model: unconstrained it writes no JSON -> exit 1;
    constrained, the same items all parse -> exit 0."""
    from thinkcraft.llm.testing import save_tiny, tiny_llama

    path = save_tiny(tmp_path / "m", *tiny_llama())
    base = ["label", "--input", _input(tmp_path, ["s1", "s2", "s3"]), "--engine", f"hf:{path}",
            "--fields", "move:left|right", "--max-new-tokens", "12", "--schema-retries", "0", "--threads", "1"]
    assert main(base + ["--out-dir", str(tmp_path / "free"), "--no-constrain"]) == 1
    assert main(base + ["--out-dir", str(tmp_path / "con")]) == 0
    saved = json.loads((tmp_path / "con" / "report.json").read_text())
    assert saved["labelled"] == 3 and saved["prompt_format"] == "chat" and saved["constrained"] is True
    assert saved["first_pass_valid_frac"] == 1.0


def test_thread_choice(monkeypatch):
    import torch

    assert auto_threads(cpus=8, busy=0) == 8 and auto_threads(cpus=2, busy=1) == 1 and auto_threads(cpus=2, busy=5) == 1
    assert busy_cpus(samples=1) >= 0
    old = torch.get_num_threads()
    try:
        pol = ThreadPolicy(1)
        assert pol.apply() == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr("thinkcraft.label.threads.busy_cpus", lambda: 10)
        auto = ThreadPolicy(0)
        assert auto.apply() == 1 and auto.summary().startswith("1 (auto")
    finally:
        torch.set_num_threads(old)
