"""THINKCRAFT_DECODE_AHEAD (llm/hf/batcher.py `decode_ahead`, iteration.py `_launch_ahead`): a step launches up to N
decode iterations before the host reads a record. On the CPU's step-by-step path: the same greedy tokens and
log-probs as one iteration a step, with requests arriving while others run, different lengths, a shared prefix and a
3-turn episode whose KV is kept between turns; rows with stop strings turn it off while they run; a bad value is one
clear error."""

from __future__ import annotations

import pytest

from thinkcraft.llm.protocol import GenerationRequest, SamplingParams
from thinkcraft.utils.errors import UserError


def _engine(monkeypatch, ahead: int):
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.testing import tiny_llama

    monkeypatch.setenv("THINKCRAFT_DECODE_AHEAD", str(ahead))
    model, tok = tiny_llama(seed=7)
    return HFEngine.from_model(model, tok, max_slots=6), tok


def _drive(eng, plan):
    """plan: [(step at which to submit, request)]: submit each at its step, step until every result is back;
    the results in plan order."""
    out, handles, step = {}, {}, 0
    while len(out) < len(plan):
        for i, (at, req) in enumerate(plan):
            if at == step:
                handles[eng.submit(req)] = i
        eng.step()
        step += 1
        for r in eng.poll():
            out[handles[r.handle]] = r
        assert step < 500
    return [out[i] for i in range(len(plan))]


def _plan(tok, stop: bool = False):
    ids = lambda t: list(tok(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    prefix = ids("Rules: answer with one word, then stop.")
    g = lambda n, **kw: SamplingParams(max_new_tokens=n, temperature=0.0, logprobs=True, **kw)  # noqa: E731
    return [
        (0, GenerationRequest(prefix + ids(" Count the stones"), g(9), prefix_len=len(prefix))),
        (0, GenerationRequest(ids("Then the trees"), g(3))),
        (2, GenerationRequest(prefix + ids(" and the water"), g(12), prefix_len=len(prefix))),
        (5, GenerationRequest(ids("A fourth one"), g(7, stop=["e"]) if stop else g(7))),
    ]


@pytest.mark.parametrize("ahead", [3, 8])
def test_ahead_gives_the_same_greedy_tokens_and_logprobs(monkeypatch, ahead):
    eng1, tok = _engine(monkeypatch, 1)
    want = _drive(eng1, _plan(tok))
    eng, _ = _engine(monkeypatch, ahead)
    got = _drive(eng, _plan(tok))
    for g, w in zip(got, want):
        assert g.error is None and g.completion.token_ids == w.completion.token_ids
        assert g.completion.finish_reason == w.completion.finish_reason
        assert max(abs(a - b) for a, b in zip(g.completion.logprobs, w.completion.logprobs)) < 1e-5
    m = eng.decode_metrics()
    assert m["ahead_launches"] > 0 and eng1.decode_metrics()["ahead_launches"] == 0
    assert m["generated_tokens"] == eng1.decode_metrics()["generated_tokens"]  # idle iterations count nothing


def test_ahead_keeps_an_episodes_kv_between_turns(monkeypatch):
    """A 3-turn episode (its KV parked between turns, only the new tokens prefilled): the same tokens at 4 ahead."""

    def episode(eng, tok):
        ids = lambda t: list(tok(t, add_special_tokens=False)["input_ids"])  # noqa: E731
        sp = SamplingParams(max_new_tokens=5, temperature=0.0, logprobs=True)
        prompt, outs, reused = ids("You see a tree."), [], []
        for turn in range(3):
            (r,) = _drive(eng, [(0, GenerationRequest(prompt, sp, episode="ep"))])
            outs.append(r.completion.token_ids)
            reused.append(r.reused_tokens)
            prompt = prompt + r.completion.token_ids + ids(f" Turn {turn}: you see a stone.")
        return outs, reused

    want = episode(*_engine(monkeypatch, 1))
    got = episode(*_engine(monkeypatch, 4))
    assert got == want and want[1][1] > 0  # the later turns reused the kept KV, alike


def test_rows_with_stop_strings_turn_it_off_while_they_run(monkeypatch):
    eng, tok = _engine(monkeypatch, 4)
    plan = _plan(tok, stop=True)
    stop_only = [(0, plan[3][1])]
    _drive(eng, stop_only)
    assert eng.decode_metrics()["ahead_launches"] == 0  # the host cuts stop strings: one iteration a step
    got = _drive(eng, plan[:3])
    assert all(r.error is None for r in got) and eng.decode_metrics()["ahead_launches"] > 0


@pytest.mark.parametrize("bad", ["0", "9", "two", "-1"])
def test_a_bad_value_is_one_clear_error(monkeypatch, bad):
    from thinkcraft.llm.hf.batcher import decode_ahead

    monkeypatch.setenv("THINKCRAFT_DECODE_AHEAD", bad)
    with pytest.raises(UserError, match="THINKCRAFT_DECODE_AHEAD must be an integer from 1 to 8"):
        decode_ahead()
