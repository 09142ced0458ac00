"""Structured outputs: JSON-schema-constrained decoding (llm/constrained.py) in the hf engine.

A random-weight model never writes JSON by itself, so whatever parses here parses because of the
constraint; the log-prob tests replay the grammar and recompute both distributions independently."""

import json

import pytest
import torch

from thinkcraft.label.template import validate
from thinkcraft.llm.constrained import (
    StructuredOutput, check_schema, compile_guide, constrained_log_softmax,
)
from thinkcraft.llm.protocol import Batch, SamplingParams
from thinkcraft.utils.errors import UserError

xgr = pytest.importorskip("xgrammar")

# a finite language (enum, boolean, bounded string): a random model cannot run past the token budget
SCHEMA = {"type": "object", "properties": {"move": {"type": "string", "enum": ["left", "right", "noop"]},
                                           "sure": {"type": "boolean"},
                                           "why": {"type": "string", "maxLength": 6}},
          "required": ["move", "sure", "why"]}


@pytest.fixture(scope="module")
def engine():
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.testing import tiny_llama

    model, tok = tiny_llama(seed=3)
    return HFEngine.from_model(model, tok)


PROMPTS = [f"state {i}: tree at ({i}, {i + 1})" for i in range(6)]


def _sampling(**kw):
    return SamplingParams(max_new_tokens=48, temperature=1.0, seed=0, **kw)


def test_random_model_only_parses_under_the_constraint(engine):
    free = engine.generate(Batch(items=PROMPTS, prefix="Answer in JSON.\n"), _sampling(logprobs=False))
    assert not any(c.text.lstrip().startswith("{") for c in free)
    spec = StructuredOutput.from_schema(SCHEMA)
    out = engine.generate(Batch(items=PROMPTS, prefix="Answer in JSON.\n"), _sampling(logprobs=False, structured=spec))
    for c in out:
        value = json.loads(c.text)  # parses every time
        assert validate(value, SCHEMA) == []
        # ends at the closing brace: the stop token right after it, compact separators
        assert c.finish_reason == "stop" and c.token_ids[-1] in engine.eos_ids and c.text.endswith("}")
        assert c.text == json.dumps(value, ensure_ascii=False)
    # the same with greedy decoding and without a shared prefix (plain rows)
    greedy = engine.generate(Batch(items=PROMPTS), SamplingParams(max_new_tokens=48, temperature=0.0, logprobs=False,
                                                                  structured=spec))
    assert all(validate(json.loads(c.text), SCHEMA) == [] for c in greedy)
    # decoding stops one step after the last answer's stop token (not at the next 16-step check)
    assert engine.last_generate_timing["decode_steps"] == max(len(c.token_ids) for c in greedy) < 48


def _replay(engine, prompt_ids, gen_ids, spec):
    """Per generated token: (model log-softmax, constrained log-softmax) recomputed from scratch: one full
    forward over prompt + answer, and a fresh matcher fed the answer token by token."""
    guide = compile_guide(engine.tokenizer, engine._lm.config.vocab_size, engine.eos_ids, spec)
    matcher = xgr.GrammarMatcher(guide.compiled)
    ids = torch.tensor([prompt_ids + gen_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float()
    model_lp, cons_lp = [], []
    for t, tok in enumerate(gen_ids):
        mask = xgr.allocate_token_bitmask(1, logits.shape[-1])
        matcher.fill_next_token_bitmask(mask)
        model_lp.append(torch.log_softmax(logits[t], -1)[tok].item())
        cons_lp.append(constrained_log_softmax(logits[t:t + 1], mask)[0, tok].item())
        assert matcher.accept_token(tok)
    assert matcher.is_terminated()
    return model_lp, cons_lp


@pytest.mark.parametrize("mode", ["model", "constrained"])
def test_logprobs_of_the_constrained_distribution(engine, mode):
    spec = StructuredOutput.from_schema(SCHEMA, logprobs=mode)
    comps = engine.generate(Batch(items=PROMPTS[:3]), _sampling(structured=spec))
    for c in comps:
        model_lp, cons_lp = _replay(engine, c.prompt_token_ids, c.token_ids, spec)
        want = model_lp if mode == "model" else cons_lp
        assert c.logprobs == pytest.approx(want, abs=2e-4)
        # hand-checkable: after "}" the stop token is the only one allowed, so under the constrained
        # distribution it has probability 1 (log 0), while the model itself gives it far less
        assert cons_lp[-1] == pytest.approx(0.0, abs=1e-6) and model_lp[-1] < -1.0
        # every constrained log-prob is >= the model's (renormalising over fewer tokens)
        assert all(cl >= ml - 1e-5 for cl, ml in zip(cons_lp, model_lp))


def test_guide_state_by_hand(engine):
    spec = StructuredOutput.from_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    guide = compile_guide(engine.tokenizer, engine._lm.config.vocab_size, engine.eos_ids, spec)
    state = guide.start(2, "cpu")
    answer = engine.tokenizer('{"a": 12}', add_special_tokens=False)["input_ids"]
    eos = min(engine.eos_ids)
    bad = engine.tokenizer("hello", add_special_tokens=False)["input_ids"][0]
    logits = torch.zeros(2, engine._lm.config.vocab_size)
    for t, tok in enumerate(answer + [eos]):
        masked = state.apply(logits.clone())
        assert torch.isfinite(masked[0, tok])  # the next token of a valid answer is allowed
        if t == 0:
            assert torch.isinf(masked[1, bad])  # prose is not
        state.advance(torch.tensor([tok, bad if t == 0 else eos]))
    state.fill_mask()  # accepts the last step's tokens
    assert state.is_done(0) and not state.is_done(1)
    assert state.rejected == 1 and state.all_done()  # row 1 left the constraint at its first token


def test_bad_schema_is_one_line():
    check_schema(SCHEMA)
    with pytest.raises(UserError, match="cannot be turned into a grammar"):
        check_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}})


def test_padded_lm_head_ids_are_never_allowed_and_the_grammar_spans_the_tokenizer(engine):
    """Logits wider than the tokenizer (a padded LM head): the grammar is built over the tokenizer's own ids
    (xgrammar filled masks ~60x slower over the padding), the padded ids are -inf in every row under the
    grammar and untouched in rows out of it, and the allowed set over the real ids is the unpadded guide's."""
    from thinkcraft.llm.constrained import replay_masks

    spec = StructuredOutput.from_schema(SCHEMA)
    V = len(engine.tokenizer)
    wide, exact = (compile_guide(engine.tokenizer, v, engine.eos_ids, spec) for v in (V + 100, V))
    assert (wide.grammar_vocab, wide.vocab_size, exact.grammar_vocab) == (V, V + 100, V)
    answer = engine.tokenizer('{"move": "left", "sure": true', add_special_tokens=False)["input_ids"]
    states = [g.start(3, "cpu") for g in (wide, exact)]
    for st in states:
        st.close_row(2)  # row 2 out of the constraint: every id allowed, the padding too
    for tok in answer:
        w = states[0].apply(torch.zeros(3, V + 100))
        e = states[1].apply(torch.zeros(3, V))
        assert torch.equal(torch.isfinite(w[:2, :V]), torch.isfinite(e[:2]))
        assert torch.isinf(w[:2, V:]).all() and torch.isfinite(w[2]).all()
        for st in states:
            st.advance(torch.tensor([tok, tok, tok]))
    # the learner's replayed masks span the logits, the padding disallowed
    masks = replay_masks(wide, [answer], [0])
    assert masks.bitmask.shape[1] == wide.mask_words
    from thinkcraft.llm.constrained import bitmask_to_bool
    allowed = bitmask_to_bool(masks.bitmask, V + 100)
    assert allowed[:, :V].any(1).all() and not allowed[:, V:].any()
