"""Chat-templated prompts with the shared prefix split off as token ids (label/prompts.py)."""

import copy

import pytest

from thinkcraft.label.prompts import ChatPrompts, RawPrompts, make_prompts, resolved_format
from thinkcraft.utils.errors import UserError


@pytest.fixture(scope="module")
def tok():
    from thinkcraft.llm.testing import bundled_tokenizer

    return bundled_tokenizer()


ITEMS = ["day, facing north: grass\ntree x5 (+1,-2)", " leading space", "\nleading newline", "ünïcödé 🌲 x3", "{json?}"]


def _template_ids(tok, messages):
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_shared_prefix_plus_suffix_is_the_full_template(tok):
    p = ChatPrompts(tok, "You label states.\nAnswer with JSON.\n")
    assert p.system_turn and p.prefix_text.endswith("<|im_start|>user\n")
    [pb] = p.batches(ITEMS)
    assert pb.positions == list(range(len(ITEMS))) and pb.batch.prefix == p.prefix_ids
    for item, suffix in zip(ITEMS, pb.batch.items):
        want = _template_ids(tok, [{"role": "system", "content": p.instructions}, {"role": "user", "content": item}])
        assert list(pb.batch.prefix) + list(suffix) == want  # token-for-token what the full template gives
        assert tok.decode(suffix).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert p.boundary_mismatches == 0


def test_items_whose_tokens_cross_the_boundary_go_whole(tok):
    t = copy.deepcopy(tok)
    # no special token between the instructions and the item: " U" + "sers" merges into " Users"
    t.chat_template = "{{ messages[0]['content'] }} U{{ messages[1]['content'] }} A:"
    p = ChatPrompts(t, "Say")
    assert p.prefix_text == "Say U"
    out = p.batches(["sers here", "-ser"])
    shared = [b for b in out if b.batch.prefix is not None]
    whole = [b for b in out if b.batch.prefix is None]
    assert [b.positions for b in whole] == [[0]] and [b.positions for b in shared] == [[1]]
    assert list(whole[0].batch.items[0]) == t("Say Users here A:", add_special_tokens=False)["input_ids"]
    assert p.boundary_mismatches == 1


def test_template_without_a_system_turn(tok):
    t = copy.deepcopy(tok)
    t.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                       "supported') }}{% endif %}<u>{{ m['content'] }}</u>{% endfor %}<a>")
    p = ChatPrompts(t, "Instr.\n")
    assert not p.system_turn and p.messages("x") == [{"role": "user", "content": "Instr.\nx"}]
    [pb] = p.batches(["item"])
    assert t.decode(list(pb.batch.prefix) + list(pb.batch.items[0])) == "<u>Instr.\nitem</u><a>"


def test_format_choice(tok):
    t = copy.deepcopy(tok)
    t.chat_template = None
    assert resolved_format("auto", tok) == "chat" and resolved_format("auto", t) == "raw"
    assert isinstance(make_prompts("auto", t, "P"), RawPrompts) and isinstance(make_prompts("auto", tok, "P"), ChatPrompts)
    assert resolved_format("raw", tok) == "raw" and resolved_format("auto", None) == "raw"
    with pytest.raises(UserError, match="no chat template"):
        make_prompts("chat", t, "P")
    with pytest.raises(UserError, match="tokenizer"):
        make_prompts("chat", None, "P")
    [pb] = RawPrompts("P\n").batches(["a", "b"])
    assert pb.batch.prefix == "P\n" and list(pb.batch.items) == ["a", "b"]
