"""Local batch labelling: one in-process engine, large batches, the shared prefix passed apart."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from thinkcraft.label.pipeline import LabelConfig, label, read_labels, resolve_engine_spec
from thinkcraft.llm.protocol import Completion
from thinkcraft.utils.errors import ConfigError


class FakeEngine:
    """Answers `{"action": <item>}` (or garbage for items containing 'bad'); records every batch."""

    def __init__(self):
        self.batches = []

    def generate(self, batch, sampling):
        self.batches.append(batch)
        out = []
        for it in batch.items:
            text = "garbage" if "bad" in it else json.dumps({"action": it})
            out.append(Completion(token_ids=[1] * 3, text=text, logprobs=None, finish_reason="stop",
                                  prompt_token_ids=[0] * 10))
        return out


def _input(tmp_path, texts):
    p = tmp_path / "items.parquet"
    pq.write_table(pa.table({"text": texts}), p)
    return str(p)


def test_local_batches_share_the_prefix_and_resume(tmp_path):
    texts = [f"s{i}" for i in range(10)] + ["bad one"]
    cfg = LabelConfig(input=_input(tmp_path, texts), out_dir=str(tmp_path / "o"), fields="action:string",
                      batch_size=4, schema_retries=1, prefix="P\n")
    eng = FakeEngine()
    rep = label(cfg, engine=eng, model_name="fake")
    assert [len(b) for b in eng.batches] == [4, 4, 3, 1]  # the invalid item asked once more, alone
    assert {b.prefix for b in eng.batches} == {'P\nAnswer with only a JSON object of the form {"action": <string>}.\n'}
    assert rep["labelled"] == 10 and rep["invalid"] == 1 and rep["reasked"] == 1
    assert rep["prompt_tokens"] == 100 and rep["completion_tokens"] == 30
    t = read_labels(tmp_path / "o")
    assert sorted(json.loads(p)["action"] for p in t.column("parsed_json").to_pylist()) == sorted(texts[:10])
    eng2 = FakeEngine()
    rep2 = label(cfg, engine=eng2, model_name="fake")
    assert rep2["already_done"] == 10 and [len(b) for b in eng2.batches] == [1, 1]  # only the invalid one
    # another model is another key: everything is labelled again
    rep3 = label(cfg, engine=FakeEngine(), model_name="other")
    assert rep3["already_done"] == 0 and rep3["labelled"] == 10


def test_config_rejects_packing_locally(tmp_path):
    with pytest.raises(ConfigError, match="pack-size"):
        LabelConfig(input=_input(tmp_path, ["a"]), pack_size=4)
    assert resolve_engine_spec("hf:x") == "hf:x"


@pytest.mark.slow
def test_local_hf_engine_tiny_model(tmp_path):
    """The real hf engine (a tiny random model in a folder), through the CLI."""
    from thinkcraft.cli import main
    from thinkcraft.llm.testing import save_tiny, tiny_llama

    path = save_tiny(tmp_path / "m", *tiny_llama())
    inp = _input(tmp_path, [f"state {i}" for i in range(6)])
    args = ["label", "--input", inp, "--out-dir", str(tmp_path / "o"), "--engine", f"hf:{path}",
            "--batch-size", "4", "--max-new-tokens", "5"]
    assert main(args) == 0
    t = read_labels(tmp_path / "o")
    assert t.num_rows == 6 and len(set(t.column("key").to_pylist())) == 6
    assert all(0 < n <= 5 for n in t.column("completion_tokens").to_pylist())
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rep["engine"] == f"hf:{path}" and rep["tokens_per_s"] > 0
    assert main(args) == 0
    assert json.loads((tmp_path / "o" / "report.json").read_text())["already_done"] == 6
