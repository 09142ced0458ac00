"""Pure parts of the labelling pipeline: schema validation, packing, keys, the result store, rate limiting."""

import json

import pytest

from thinkcraft.label.providers import TokenBucket
from thinkcraft.label.store import JOURNAL, ResultStore, read_results
from thinkcraft.label.template import (
    OutputSpec, Template, item_key, pack_prompt, parse_output, parse_packed, schema_from_fields, validate,
)
from thinkcraft.utils.errors import UserError

SCHEMA = schema_from_fields("action:string,confidence:number,move:left|right")


def test_validate_subset():
    assert validate({"action": "noop", "confidence": 0.5, "move": "left"}, SCHEMA) == []
    errs = validate({"action": 3, "move": "up"}, SCHEMA)
    assert any("missing field 'confidence'" in e for e in errs)
    assert any("expected string" in e for e in errs)
    assert any("not one of" in e for e in errs)
    # booleans are not numbers in JSON Schema
    assert validate(True, {"type": "number"}) != []
    assert validate([1, "a"], {"type": "array", "items": {"type": "integer"}}) == ["$[1]: expected integer, got str"]
    with pytest.raises(UserError):
        schema_from_fields("x:float")


def test_parse_output_finds_json_in_prose():
    spec = OutputSpec(SCHEMA)
    p = parse_output('Sure! ```json\n{"action": "noop", "confidence": 1, "move": "right"}\n```', spec)
    assert p.error is None and p.value["move"] == "right"
    assert parse_output("no json here", spec).error == "no JSON object in the answer"
    assert "missing field" in parse_output('{"action": "a"}', spec).error
    assert parse_output("  free text \n", OutputSpec()).value == "free text"


def test_pack_roundtrip_and_partial_answers():
    t = Template(prefix="P", item="{text}", output=OutputSpec(SCHEMA))
    prompt = pack_prompt(t, ["a", "b", "c"])
    assert "### Item 3" in prompt and "JSON list of 3" in prompt
    good = {"action": "x", "confidence": 0.1, "move": "left"}
    # item 2 missing, item 3 invalid, an out-of-range id ignored
    ans = json.dumps([{"id": 1, **good}, {"id": 3, "action": "y"}, {"id": 9, **good}])
    res = parse_packed("here you go " + ans, 3, t.output)
    assert res[0].error is None and res[0].value == good
    assert res[1].error == "missing from the packed answer"
    assert "missing field" in res[2].error
    assert all(r.error for r in parse_packed("garbage", 3, t.output))
    # free text packing, positional when ids are absent
    res = parse_packed('["one", "two"]', 2, OutputSpec())
    assert [r.value for r in res] == ["one", "two"]


def test_keys_depend_on_prompt_model_template():
    t1 = Template(prefix="A", item="{text}")
    t2 = Template(prefix="B", item="{text}")
    k = item_key("p", "m", t1.digest())
    assert k == item_key("p", "m", t1.digest())
    assert len({k, item_key("q", "m", t1.digest()), item_key("p", "n", t1.digest()), item_key("p", "m", t2.digest())}) == 4
    with pytest.raises(UserError):
        Template(prefix="x", item="no columns")
    with pytest.raises(UserError):
        t1.render_item({"other": 1})


def _row(key):
    return {"key": key, "row": 0, "output": "o", "model": "m", "endpoint": "e", "prompt_tokens": 1,
            "completion_tokens": 1, "cached_tokens": 0, "latency_s": 0.1, "pack_size": 1, "attempts": 1}


def test_store_journal_recovery_without_duplicates(tmp_path):
    with ResultStore(tmp_path, shard_items=2) as st:
        assert st.add(_row("a")) and st.add(_row("b"))  # -> one shard
        assert st.add(_row("c"))
        assert not st.add(_row("a"))  # already stored
    assert sorted(read_results(tmp_path).column("key").to_pylist()) == ["a", "b", "c"]
    # simulate a kill: journal lines not yet compacted, one torn line, one line duplicating a shard
    j = tmp_path / JOURNAL
    j.write_text(json.dumps(_row("d")) + "\n" + json.dumps(_row("a")) + "\n" + '{"key": "e", "ro')
    with ResultStore(tmp_path) as st:
        assert st.num_recovered == 1
        assert st.done_keys() == {"a", "b", "c", "d"}
    keys = read_results(tmp_path).column("key").to_pylist()
    assert sorted(keys) == ["a", "b", "c", "d"]
    assert not j.exists()


def test_store_lock_refuses_second_writer(tmp_path):
    with ResultStore(tmp_path):
        with pytest.raises(UserError, match="in use"):
            with ResultStore(tmp_path):
                pass


def test_token_bucket_rate():
    now = [0.0]
    b = TokenBucket(rate_per_s=2.0, capacity=2.0, clock=lambda: now[0])
    b.take(1), b.take(1)
    assert b.wait_s(1) == pytest.approx(0.5)
    now[0] = 0.5
    assert b.wait_s(1) == 0.0
    # a cost above the capacity waits for a full bucket, then goes into debt
    b.take(1)
    assert b.wait_s(10) == pytest.approx(1.0)
    now[0] = 1.5
    b.take(10)
    assert b.wait_s(1) == pytest.approx(4.5)
