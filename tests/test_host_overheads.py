"""Host work the Craftax rollout paid per turn (py-spy and torch.profiler on an H200, 2026-12-01) and what replaced it:
a finished row's completion hands back the request's own prompt list (no array -> list per turn), its record keeps
it (no copy), the shared-prefix check compares lists; ending rows never synchronises the host with the decode step in
flight (GPU test); Python's garbage collector is timed (`utils/gc_clock.py`, a step's `host/gc_s`). Then (CPU profile
of the rollout, 2026-12-01): a first turn's prompts tokenized after the shared prefix (checked against one whole
tokenization a call, off after a mismatch), equal texts tokenized once, the tokenizer's Rust backend called directly
(`compat.rust_encoder` / `rust_decoder`), the replies decoded in one call - every prompt's ids as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from thinkcraft.llm.protocol import Completion, GenerationRequest, SamplingParams
from thinkcraft.pools.contract import TurnRecord
from thinkcraft.utils.errors import UserError


def _engine(device: str = "cpu"):
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.testing import tiny_llama

    model, tok = tiny_llama(seed=3)
    return HFEngine.from_model(model.to(device), tok, max_slots=4), tok


def _run(eng, reqs):
    handles = [eng.submit(r) for r in reqs]
    out = {}
    for _ in range(200):
        eng.step()
        out.update({r.handle: r for r in eng.poll()})
        if len(out) == len(handles):
            return [out[h] for h in handles]
    raise AssertionError("generation did not finish")


def test_a_completion_hands_back_the_requests_own_prompt_list():
    eng, tok = _engine()
    ids = list(tok("count the trees near the river", add_special_tokens=False)["input_ids"])
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=True)
    as_list, as_array = _run(eng, [GenerationRequest(ids, sp), GenerationRequest(np.asarray(ids), sp)])
    assert as_list.error is None and as_array.error is None
    assert as_list.completion.prompt_token_ids is ids  # the list given, not a copy
    got = as_array.completion.prompt_token_ids  # an array given: a list of plain ints equal to it
    assert type(got) is list and got == ids and all(type(x) is int for x in got)
    assert as_list.completion.token_ids == as_array.completion.token_ids


def test_a_turn_record_keeps_a_list_and_copies_anything_else():
    prompt = [5, 6, 7]
    c = Completion(token_ids=[1, 2], text="ab", logprobs=[-0.1, -0.2], finish_reason="length", prompt_token_ids=prompt)
    rec = TurnRecord.of_completion("obs", [], c, 1.0, False, {})
    assert rec.prompt_ids is prompt and rec.train_mask == [1, 1]
    c2 = Completion(token_ids=[1], text="a", logprobs=None, finish_reason="stop", prompt_token_ids=[])
    rec2 = TurnRecord.of_completion("obs", (8, 9), c2, 0.0, False, {})  # no ids from the engine: the caller's, listed
    assert rec2.prompt_ids == [8, 9] and type(rec2.prompt_ids) is list


def test_the_shared_prefix_check_agrees_for_lists_and_arrays():
    from thinkcraft.llm.testing import bundled_tokenizer
    from thinkcraft.train.llm_policy.rollout import ChatPrompts

    prompts = ChatPrompts(bundled_tokenizer(), "You play a game. Answer with one action.", 2, -1)
    first = prompts.next([0, 1], ["tree to the east", "water to the north"], [None, None])
    p = len(prompts.prefix)
    assert p > 0
    for ids in first:
        assert prompts.prefix_len(ids) == prompts.prefix_len(np.asarray(ids)) == p
    other = list(first[0])
    other[p - 1] += 1  # the prefix's last token changed
    assert prompts.prefix_len(other) == prompts.prefix_len(np.asarray(other)) == 0
    assert prompts.prefix_len(first[0][:p]) == 0  # a prompt that is the prefix alone (nothing after it)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ending_rows_never_synchronises_with_the_step_in_flight():
    from thinkcraft.llm.hf.iteration import IterationMixin

    eng, tok = _engine("cuda")
    b = eng._batcher
    finish = IterationMixin._finish
    calls = []

    def strict_finish(self, ended):  # noqa: ANN001, ANN202 - a synchronising call inside it raises
        calls.append(len(ended))
        torch.cuda.set_sync_debug_mode("error")
        try:
            return finish(self, ended)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    b._finish = strict_finish.__get__(b)
    ids = list(tok("mine the stone, then craft a pickaxe", add_special_tokens=False)["input_ids"])
    reqs = [GenerationRequest(ids, SamplingParams(max_new_tokens=n, temperature=0.0, logprobs=True)) for n in (3, 5, 8)]
    res = _run(eng, reqs)
    assert [len(r.completion.token_ids) for r in res] == [3, 5, 8] and all(r.error is None for r in res)
    assert sum(calls) == 3


def test_the_garbage_collectors_time_is_counted():
    import gc

    from thinkcraft.utils.gc_clock import GC_CLOCK

    before = GC_CLOCK.install().snapshot()
    assert GC_CLOCK.install() is GC_CLOCK and gc.callbacks.count(GC_CLOCK._callback) == 1  # installed once
    junk = []
    for _ in range(20000):  # cycles: only the collector frees them
        a: list = []
        a.append(a)
        junk.append(a)
    del junk
    gc.collect()
    m = GC_CLOCK.metrics_since(before)
    assert m["host/gc_full"] >= 1 and m["host/gc_s"] > 0, m


def test_the_heap_is_frozen_once_after_the_first_step_and_the_switch_keeps_it(monkeypatch):
    import gc

    from thinkcraft.utils.gc_clock import GCClock

    clock = GCClock().install()
    try:
        monkeypatch.setenv("THINKCRAFT_GC_FREEZE", "0")
        assert clock.freeze_after_first_step() is False and gc.get_freeze_count() == 0  # the switch: no freeze
        monkeypatch.setenv("THINKCRAFT_GC_FREEZE", "1")
        cyc: list = []
        cyc.append(cyc)  # garbage the first step left: collected before the freeze, not frozen
        del cyc
        before = clock.snapshot()
        assert clock.freeze_after_first_step() is True
        assert clock.snapshot()[1] == before[1] + 1  # the collection before the freeze is a timed full one
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the process's heap (the test worker's modules), out of the collector's reach
        # once a process: no second freeze (it would move every object made since into the permanent generation).
        # The count may fall, never rise: a frozen object freed by another thread of the worker leaves it (CI,
        # 2026-12-03: 1,188,669 -> 1,188,667 between two reads)
        assert clock.freeze_after_first_step() is False and gc.get_freeze_count() <= frozen
        made = [[] for _ in range(10)]
        assert all(gc.is_tracked(x) for x in made) and gc.get_freeze_count() <= frozen  # new objects: collected
        monkeypatch.setenv("THINKCRAFT_GC_FREEZE", "bad")
        with pytest.raises(UserError, match="THINKCRAFT_GC_FREEZE"):
            GCClock().freeze_after_first_step()
    finally:
        gc.unfreeze()
        gc.callbacks.remove(clock._callback)


def test_the_training_step_freezes_the_heap_once_and_says_so(monkeypatch):
    """The sync loop's step reports the freeze (`host/gc_frozen`: 1 at the process's first step, then 0)."""
    import gc

    import thinkcraft.train.llm_policy.loop as loop
    from thinkcraft.utils.gc_clock import GCClock

    clock = GCClock()
    monkeypatch.setattr(loop, "GC_CLOCK", clock)
    monkeypatch.setenv("THINKCRAFT_GC_FREEZE", "1")
    monkeypatch.setattr(loop, "rollout", lambda *a, **k: [])
    monkeypatch.setattr(loop, "update_on", lambda cfg, learner, tok, eps, carry: ({}, carry))
    monkeypatch.setattr(loop, "_step_metrics", lambda *a: {})
    monkeypatch.setattr(loop, "_step_seeds", lambda *a: [])

    class Timer:
        def phase(self, name):
            import contextlib

            return contextlib.nullcontext()

        def metrics(self):
            return {}

    p = loop.Policy(None, None, None, type("L", (), {"autocast": None})(), None)
    try:
        cfg = type("C", (), {"samples_per_prompt": 1, "history_turns": 0})()
        rec0, _ = loop.train_step(cfg, p, 0, loop.Carry(), None, Timer())
        rec1, _ = loop.train_step(cfg, p, 1, loop.Carry(), None, Timer())
        assert (rec0["host/gc_frozen"], rec1["host/gc_frozen"]) == (1.0, 0.0) and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.callbacks.remove(clock._callback)


SYSTEM = "You play Craftax. Each turn you see the observation; answer with one action.\nActions: 0 noop, 1 left"


def _whole_ids(tok, obs: str) -> list[int]:
    """A first turn's prompt tokenized whole, as the rollout did before the prefix split."""
    from thinkcraft.train.llm_policy.rollout import _render, build_messages

    return list(tok(_render(tok, build_messages(SYSTEM, [], obs, -1)), add_special_tokens=False)["input_ids"])


def _chatml_bpe():
    from thinkcraft.train.llm_policy.model import train_bpe_tokenizer

    return train_bpe_tokenizer([SYSTEM, "tree (-1,0) x7\nwater (2,3)\nhealth 9, food 9"] * 20, vocab_size=400)


@pytest.mark.parametrize("which", ["bundled", "chatml-bpe"])
def test_first_prompts_tokenized_after_the_prefix_equal_whole_ones_turn_after_turn(which: str):
    """A group's samples share their first observation (tokenized once, each prompt still a list of its own); the
    ids equal the whole prompt's; the next turn's prompts extend them and leave the earlier lists as they were."""
    from types import SimpleNamespace

    from thinkcraft.llm.testing import bundled_tokenizer
    from thinkcraft.train.llm_policy.rollout import ChatPrompts

    tok = bundled_tokenizer() if which == "bundled" else _chatml_bpe()
    obs = ["tree (-1,0) x7\nwater (2,3)", "tree (-1,0) x7\nwater (2,3)", "  stone x3 \n", "héllo 🙂 (0,1)"]
    prompts = ChatPrompts(tok, SYSTEM, 4, -1)
    first = prompts.next([0, 1, 2, 3], obs, [None] * 4)
    assert first == [_whole_ids(tok, o) for o in obs] and prompts.split_prefix
    assert first[0] is not first[1] and all(prompts.prefix_len(ids) == len(prompts.prefix) for ids in first)
    kept = [list(x) for x in first]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    comps = [SimpleNamespace(token_ids=list(tok(f" move {e}", add_special_tokens=False)["input_ids"]) + [end],
                             text=f" move {e}", finish_reason="stop") for e in range(4)]
    second = prompts.next([0, 1, 2, 3], [f"turn 1 of {e}" for e in range(4)], comps)
    assert first == kept  # the first turn's lists (a turn record holds them) unchanged
    for a, b, c in zip(first, second, comps):
        assert b[: len(a) + len(c.token_ids)] == a + c.token_ids and len(b) > len(a) + len(c.token_ids)


def test_a_tokenizer_that_merges_across_the_prefixs_end_gets_whole_prompts(caplog):
    """A special token that takes in the whitespace before it (`lstrip`) tokenizes the prompt otherwise than the
    prefix + the rest: the call's whole tokenization shows it, the ids are the whole prompt's, a warning, whole
    from then on."""
    import copy

    from tokenizers import AddedToken

    from thinkcraft.llm.testing import bundled_tokenizer
    from thinkcraft.train.llm_policy.rollout import ChatPrompts

    tok = copy.deepcopy(bundled_tokenizer())
    tok.backend_tokenizer.add_special_tokens([AddedToken("<|im_start|>", lstrip=True, special=True, normalized=False)])
    obs = ["tree (-1,0)", "water (2,3)"]
    prompts = ChatPrompts(tok, SYSTEM, 2, -1)
    with caplog.at_level("WARNING"):
        got = prompts.next([0, 1], obs, [None, None])
    assert got == [_whole_ids(tok, o) for o in obs]
    assert not prompts.split_prefix and "tokenized whole from now on" in caplog.text
    assert prompts.prefix_len(got[0]) == 0  # (and, as before, no shared prefix for the engine)


def test_replies_decoded_in_one_call_equal_one_decode_each():
    from types import SimpleNamespace

    from thinkcraft.llm.testing import bundled_tokenizer
    from thinkcraft.train.llm_policy.rollout import ChatPrompts, _reply_texts

    tok = bundled_tokenizer(thinking=True)
    specials = ChatPrompts(tok, SYSTEM, 1, -1).specials
    end = tok.convert_tokens_to_ids("<|im_end|>")
    body = list(tok("<think>left?</think> Action: héllo", add_special_tokens=False)["input_ids"])
    comps = [None, SimpleNamespace(token_ids=body + [end], finish_reason="stop"),
             SimpleNamespace(token_ids=body + [end], finish_reason="length"),  # cut: its last token is content
             SimpleNamespace(token_ids=[], finish_reason="length"),
             SimpleNamespace(token_ids=tuple(body), finish_reason="budget")]  # no special token at its end
    want = [None, (tok.decode(body), tok.decode([end])), (tok.decode(body + [end]), ""), ("", ""),
            (tok.decode(body), "")]
    assert _reply_texts(tok, comps, specials) == (want, True)
    # reuse: a reply with no special token in its body takes its completion's text (the engine's decode with special
    # tokens skipped); one with a special token inside is decoded again; a checked reuse that differs stops it
    plain = list(tok(" Action: noop, then left", add_special_tokens=False)["input_ids"])
    skipped = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731 - what the engine's text is
    inner = plain[:3] + [tok.convert_tokens_to_ids("<|im_start|>")] + plain[3:]  # a special token sampled mid-reply
    comps = [SimpleNamespace(token_ids=plain + [end], finish_reason="stop", text=skipped(plain + [end])),
             SimpleNamespace(token_ids=inner + [end], finish_reason="stop", text=skipped(inner + [end])),
             SimpleNamespace(token_ids=plain, finish_reason="length", text=skipped(plain))]
    want = [(tok.decode(plain), tok.decode([end])), (tok.decode(inner), tok.decode([end])), (tok.decode(plain), "")]
    assert want[1][0] != comps[1].text  # its text as the engine skipped it is not the reply's
    assert _reply_texts(tok, comps, specials, reuse=True) == (want, True)
    calls = []
    from thinkcraft.llm import compat

    real = compat.decode_batch
    try:
        compat.decode_batch = lambda t, seqs, **k: calls.append(len(seqs)) or real(t, seqs, **k)
        _reply_texts(tok, comps, specials, reuse=True)
        assert calls == [2]  # the one with a special token, and one reused reply checked
        comps[0].text = "not what the ids say"
        comps[2].text = "not what the ids say"
        assert _reply_texts(tok, comps, specials, reuse=True) == (want, False)  # caught: decoded, reuse off
    finally:
        compat.decode_batch = real


def test_a_run_gives_the_frozen_heap_back_to_the_collector(tmp_path, monkeypatch):
    """`train llm-policy`'s run freezes the heap after its first step and unfreezes it when it ends (a later run in
    the process can free this one's cycles; at exit the interpreter's last collection reaches them), with an atexit
    unfreeze registered once for a process that ends without it."""
    import gc

    from thinkcraft.train import llm_policy as LP
    from thinkcraft.utils import gc_clock

    registered = []
    monkeypatch.setattr(gc_clock.atexit, "register", registered.append)
    monkeypatch.setattr(gc_clock.GC_CLOCK, "_atexit", False)
    seen = []
    real = gc_clock.GCClock.freeze_after_first_step

    def spy(self):
        froze = real(self)
        seen.append((froze, gc.get_freeze_count()))
        return froze

    monkeypatch.setattr(gc_clock.GCClock, "freeze_after_first_step", spy)
    monkeypatch.setenv("THINKCRAFT_GC_FREEZE", "1")
    cfg = LP.LLMPolicyConfig(model="random:tiny", run_dir=str(tmp_path / "run"), steps=2, prompts_per_step=2,
                             group_size=2, max_new_tokens=4, micro_batch_size=4, plot=False, log_every_s=1e9,
                             store=False, checkpoint_every=0)
    try:
        LP.run(cfg)
        assert [f for f, _ in seen] == [True, False] and seen[0][1] > 1000  # frozen after step 0, once
        assert gc.get_freeze_count() == 0  # and given back when the run ended
        assert registered == [gc.unfreeze]
    finally:
        gc.unfreeze()
