"""Continuous batching in the hf engine (tiny random models, CPU): requests arriving at different steps give
the tokens of one-at-a-time generation; an episode's KV kept between turns gives the logits of a full
re-prefill; a prompt that does not extend the episode falls back (counted); eviction and the too-large
error; weight updates at step boundaries (recorded switch, stale and failed updates refused)."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

from llm_helpers import NoGate, forward_logprobs, replay_capture
from thinkcraft.llm.hf import HFEngine
from thinkcraft.llm.hf.slot_table import PARKED, SlotTable, common_prefix_len, reuse_len
from thinkcraft.llm.protocol import Batch, GenerationRequest, SamplingParams, WeightUpdateError
from thinkcraft.llm.testing import tiny_llama
from thinkcraft.utils.errors import UserError

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def tiny() -> tuple:
    return tiny_llama(thinking=True)


def _ids(tok, text: str) -> list[int]:  # noqa: ANN001
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _run(eng: HFEngine, handles: list[int]) -> dict:
    out = {}
    while len(out) < len(handles):
        eng.step()
        out.update({r.handle: r for r in eng.poll()})
    return out


def test_requests_joining_at_different_steps_equal_one_at_a_time(tiny) -> None:
    model, tok = tiny
    texts = ["Hello there", "The quick brown fox jumps over", "a", "Numbers: 1 2 3 4 5 6 7", "Once upon a time"]
    prompts = [_ids(tok, t) for t in texts]
    lengths = [6, 9, 3, 7, 5]
    alone = HFEngine.from_model(model, tok)
    want = [alone.generate(Batch(items=[p]), SamplingParams(max_new_tokens=n, temperature=0.0))[0]
            for p, n in zip(prompts, lengths)]
    eng = HFEngine.from_model(model, tok, max_slots=3)  # fewer slots than requests: some wait for a free slot
    arrive = {0: [0, 1], 2: [2], 3: [3], 5: [4]}  # step index -> requests submitted before it
    handles: dict[int, int] = {}
    got: dict[int, object] = {}
    step = 0
    while len(got) < len(prompts):
        for i in arrive.get(step, []):
            handles[eng.submit(GenerationRequest(prompts[i], SamplingParams(max_new_tokens=lengths[i], temperature=0.0),
                                                 tag=i))] = i
        eng.step()
        got.update({r.tag: r for r in eng.poll()})
        step += 1
    for i, w in enumerate(want):
        c = got[i].completion
        assert c.token_ids == w.token_ids and c.finish_reason == w.finish_reason
        np.testing.assert_allclose(c.logprobs, forward_logprobs(model, prompts[i], c.token_ids), atol=1e-4)
        assert got[i].weight_versions == [(0, 0)] and got[i].prefill_tokens == len(prompts[i])
    assert eng.pending() == 0 and not eng.step()


def test_submit_many_queues_all_in_order_or_none(tiny) -> None:
    """`submit_many`: the requests' handles in order, the same results as one `submit` each; a bad request among
    them (an empty prompt) is one UserError and queues none of them."""
    model, tok = tiny
    prompts = [_ids(tok, t) for t in ("Hello there", "a b c", "Numbers: 1 2 3")]
    one = HFEngine.from_model(model, tok)
    want = _run(one, [one.submit(GenerationRequest(p, GREEDY, tag=i)) for i, p in enumerate(prompts)])
    eng = HFEngine.from_model(model, tok)
    with pytest.raises(UserError, match="at least one prompt token"):
        eng.submit_many([GenerationRequest(prompts[0], GREEDY), GenerationRequest([], GREEDY)])
    assert eng.pending() == 0 and not eng.step()
    handles = eng.submit_many([GenerationRequest(p, GREEDY, tag=i) for i, p in enumerate(prompts)])
    assert handles == sorted(handles) and len(set(handles)) == 3 and eng.pending() == 3
    got = _run(eng, handles)
    by_tag = {r.tag: r.completion.token_ids for r in want.values()}
    assert {r.tag: r.completion.token_ids for r in got.values()} == by_tag


def test_admit_prefills_a_chunk_and_the_turn_decodes_in_lockstep(tiny) -> None:
    """`admit` prefills the queued requests without a decode iteration: a turn submitted in two chunks with `admit`
    between them decodes in as many steps as the turn submitted at once (lockstep: no row a step ahead), with the
    same greedy tokens; a `step` between the chunks instead puts the first chunk a step ahead."""
    model, tok = tiny
    prompts = [_ids(tok, t) for t in ["Hello there", "The quick brown fox", "a b c", "Numbers: 1 2 3"]]

    def play(between: str | None) -> tuple[list[list[int]], float, float]:
        eng = HFEngine.from_model(model, tok)
        hs = [eng.submit(GenerationRequest(p, GREEDY, tag=i)) for i, p in enumerate(prompts[:2])]
        if between is not None:
            assert getattr(eng, between)() is True
            assert eng.poll() == []
            if between == "admit":  # prefilled, nothing decoded yet
                assert eng.decode_metrics()["prefill_calls"] == 1 and eng.decode_metrics()["decode_steps"] == 0
        hs += [eng.submit(GenerationRequest(p, GREEDY, tag=i + 2)) for i, p in enumerate(prompts[2:])]
        done = _run(eng, hs)
        m = eng.decode_metrics()
        return [done[h].completion.token_ids for h in hs], m["decode_steps"], m["prefill_calls"]

    want, steps, calls = play(None)
    got, steps_admit, calls_admit = play("admit")
    assert got == want and steps_admit == steps and (calls, calls_admit) == (1, 2)
    _, steps_step, _ = play("step")
    assert steps_step == steps + 1


def _episode_prompts(tok, turns: int) -> list[list[int]]:  # noqa: ANN001
    return [_ids(tok, f" observation {k}: tree at {k},{k + 1}; health {9 - k}. Act:") for k in range(turns)]


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_turn_kv_reuse_equals_full_prefill_over_five_turns(tiny, shared_prefix: bool) -> None:
    """Each turn's prompt = the previous prompt + its completion + a new observation. With the episode's KV
    kept, only the new tokens are prefilled, and every generated token's logprob (the logits) equals a
    from-scratch prefill of the whole prompt (the next test reads the logits themselves)."""
    model, tok = tiny
    system = _ids(tok, "You play a game. Answer with one action.")
    obs = _episode_prompts(tok, 5)
    reuse = HFEngine.from_model(model, tok)
    full = HFEngine.from_model(model, tok, prefix_reuse=False)
    prompt, prev_seq, prefilled = system + obs[0], None, 0
    for k in range(5):
        h = reuse.submit(GenerationRequest(prompt, GREEDY, prefix_len=len(system) if shared_prefix else 0,
                                           episode="ep"))
        r = _run(reuse, [h])[h]
        want = full.generate(Batch(items=[prompt]), GREEDY)[0]
        assert r.completion.token_ids == want.token_ids
        np.testing.assert_allclose(r.completion.logprobs, want.logprobs, atol=1e-5)
        # kept: the shared prefix (turn 1), then everything but the previous turn's last sampled token
        kept = len(prev_seq) - 1 if k else (len(system) if shared_prefix else 0)
        assert (r.reused_tokens, r.prefill_tokens, r.kv_fallback) == (kept, len(prompt) - kept, False)
        prefilled += r.prefill_tokens
        prev_seq = prompt + r.completion.token_ids
        prompt = prev_seq + (obs[k + 1] if k < 4 else [])
    m = reuse.decode_metrics()
    assert m["fallbacks"] == 0 and m["prefill_tokens"] == prefilled < sum(len(p) for p in [prompt]) * 2
    reuse.release("ep")
    assert reuse._batcher.table.parked("ep") is None


def test_prefill_logits_after_reused_kv_equal_a_full_forward(tiny) -> None:
    """The logits the first new token is sampled from, read straight after admission, equal the model's
    logits at the end of the full prompt (turn 2 of an episode, with a shared prefix)."""
    model, tok = tiny
    system = _ids(tok, "System: be brief.")
    p1 = system + _ids(tok, " first observation")
    eng = HFEngine.from_model(model, tok)
    h = eng.submit(GenerationRequest(p1, GREEDY, prefix_len=len(system), episode=1))
    r = _run(eng, [h])[h]
    p2 = p1 + r.completion.token_ids + _ids(tok, " second observation, longer than the first")
    eng.submit(GenerationRequest(p2, GREEDY, prefix_len=len(system), episode=1))
    b = eng._batcher
    with b._step_lock, b._contexts():
        b._admit()
    slot = next(s for s, q in enumerate(b._slot_seq) if q is not None)
    with torch.no_grad():
        want = model(torch.tensor([p2])).logits[0, -1].float()
    torch.testing.assert_close(b.logits[slot], want, atol=1e-4, rtol=1e-4)
    assert b._slot_seq[slot].reused_tokens == len(p1) + len(r.completion.token_ids) - 1


def test_a_next_turns_prompt_array_is_its_episodes_parked_ids_and_the_new_tail(tiny, monkeypatch) -> None:
    """`Batcher.submit` builds a list prompt that extends its episode's parked ids from the parked array + the new
    tail (no conversion of the whole list); the array equals np.asarray of the prompt in every case: extending,
    not extending (a rewritten turn), an array prompt, no parked slot."""
    model, tok = tiny
    eng = HFEngine.from_model(model, tok)
    b = eng._batcher
    p1 = _ids(tok, "Turn one: the first observation")
    r1 = _run(eng, [eng.submit(GenerationRequest(p1, GREEDY, episode="e"))])
    reply = next(iter(r1.values())).completion.token_ids
    s = b.table.parked("e")
    assert s is not None and b.table.token_lists[s] == p1 + reply[:-1] == b.table.tokens[s].tolist()
    seen = []
    real = np.asarray
    monkeypatch.setattr(np, "asarray", lambda a, *args, **kw: (seen.append(len(a)), real(a, *args, **kw))[1])
    p2 = p1 + reply + _ids(tok, " turn two")
    for prompt, whole in ((p2, False), (p1[:3] + _ids(tok, " rewritten") + reply, True),
                          (real(p2, dtype=np.int64), True)):
        seen.clear()
        got = b._prompt_array(GenerationRequest(prompt, GREEDY, episode="e"))
        assert got.dtype == np.int64 and got.tolist() == list(map(int, prompt))
        assert (max(seen) == len(prompt)) == whole  # the fast path converts only the tail
    seen.clear()
    assert b._prompt_array(GenerationRequest(p2, GREEDY, episode="other")).tolist() == p2 and max(seen) == len(p2)
    monkeypatch.setattr(np, "asarray", real)
    h = eng.submit(GenerationRequest(p2, GREEDY, episode="e"))  # the turn runs from that array, its KV kept
    r2 = _run(eng, [h])[h]
    assert r2.reused_tokens == len(p1) + len(reply) - 1 and not r2.kv_fallback
    assert r2.completion.token_ids == HFEngine.from_model(model, tok).generate(Batch(items=[p2]), GREEDY)[0].token_ids


def test_non_append_prompt_falls_back_and_is_counted(tiny) -> None:
    """A template that rewrites an earlier turn (Qwen3 drops earlier thoughts): the engine keeps only the
    common token prefix, recomputes the rest, counts a fallback - and the tokens are still exact."""
    model, tok = tiny
    p1 = _ids(tok, "Turn one: <think> long thought here </think> act")
    eng = HFEngine.from_model(model, tok)
    r1 = _run(eng, [eng.submit(GenerationRequest(p1, GREEDY, episode="e"))])
    reply = next(iter(r1.values())).completion.token_ids
    cut = 3  # the "template" drops tokens after position 3 of the earlier turn
    p2 = p1[:cut] + _ids(tok, " act") + reply + _ids(tok, " turn two")
    h = eng.submit(GenerationRequest(p2, GREEDY, episode="e"))
    r2 = _run(eng, [h])[h]
    assert r2.kv_fallback and eng.decode_metrics()["fallbacks"] == 1
    assert r2.reused_tokens == common_prefix_len(np.array(p1 + reply), np.array(p2))
    assert r2.completion.token_ids == HFEngine.from_model(model, tok).generate(Batch(items=[p2]), GREEDY)[0].token_ids


def test_eviction_policy_and_counter(tiny) -> None:
    model, tok = tiny
    eng = HFEngine.from_model(model, tok, max_slots=2)
    prompts = {e: _ids(tok, f"episode {e} starts here" + " x" * e) for e in range(3)}
    for e in range(3):  # the third episode needs a slot: the oldest parked one (episode 0) is evicted
        _run(eng, [eng.submit(GenerationRequest(prompts[e], GREEDY, episode=e))])
    t = eng._batcher.table
    assert eng.decode_metrics()["evictions"] == 1 and t.parked(0) is None and t.parked(1) is not None
    r = _run(eng, [h := eng.submit(GenerationRequest(prompts[0] + [5, 6], GREEDY, episode=0))])[h]
    assert r.reused_tokens == 0 and not r.kv_fallback  # evicted: a full prefill, not a mismatch
    # the pure policy: "longest" frees the parked slot holding the most tokens
    table = SlotTable(3, "longest")
    for s, n in enumerate([5, 9, 2]):
        table.run(s, f"e{s}", 0)
        table.park(s, np.arange(n), 0, 0)
    assert table.take("new") == 1 and table.evictions == 1 and table.status[1] != PARKED
    oldest = SlotTable(2, "oldest")
    for s in (1, 0):
        oldest.run(s, s, 0)
        oldest.park(s, np.arange(3), 0, 0)
    assert oldest.take("x") == 1  # parked first


def test_one_episode_too_large_is_a_clear_error(tiny) -> None:
    model, tok = tiny
    eng = HFEngine.from_model(model, tok, max_seq_len=32)
    with pytest.raises(UserError, match=r"needs 38 tokens of KV .* at most 32 \(max_seq_len\)"):
        eng.submit(GenerationRequest(list(range(10, 40)), SamplingParams(max_new_tokens=8)))
    eng.reserve(4, 64)  # a reservation is capped at max_seq_len
    assert eng._batcher._reserve == (4, 32, 0)
    # a KV budget that cannot hold one sequence is a clear error too
    small = HFEngine.from_model(model, tok, kv_cache_gb=1e-6)
    with pytest.raises(UserError, match="more than the KV cache budget"):
        small.generate(Batch(items=[list(range(10, 40))]), SamplingParams(max_new_tokens=8))
    per_token = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x head dim 16 x fp32
    few = HFEngine.from_model(model, tok, kv_cache_gb=2.5 * 65 * per_token / 2**30)  # 2 slots of 64 (+ scratch)
    out = few.generate(Batch(items=[[10 + i, 11, 12] for i in range(5)]), SamplingParams(max_new_tokens=3))
    assert len(out) == 5 and few.decode_metrics()["slots"] <= 2


def test_reuse_len_rules() -> None:
    t = SlotTable(1)
    t.run(0, "e", 2)
    t.park(0, np.array([1, 2, 3, 4, 5]), 2, 7)
    assert reuse_len(t, 0, np.array([1, 2, 3, 4, 5, 6]), 2, 7) == (3, False)  # all 5 kept: columns 2..4
    assert reuse_len(t, 0, np.array([1, 2, 3, 4, 5]), 2, 7) == (2, False)  # the last prompt token is recomputed
    assert reuse_len(t, 0, np.array([1, 2, 9, 4, 5, 6]), 2, 7) == (0, True)
    assert reuse_len(t, 0, np.array([1, 2, 3, 4, 5, 6]), 0, 7) == (0, True)  # another prefix layout
    assert reuse_len(t, 0, np.array([1, 2, 3, 4, 5, 6]), 2, 8) == (0, False)  # other weights: not a mismatch


# --- weight updates -----------------------------------------------------------------------------------


def _perturbed(model, scale: float = 0.5, seed: int = 1) -> dict[str, torch.Tensor]:  # noqa: ANN001
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


@pytest.mark.parametrize("prefix", ["eager", "graph", "broken graph"])
def test_weight_update_at_a_step_boundary_records_the_switch(prefix: str) -> None:
    """The shared prefix's KV recomputed at the switch by the eager forward, by the prefix graph's replay
    (prefix_graph.py; its CPU stand-in replays the captured function), or eagerly after the graph's capture
    failed - the same tokens every way."""
    from thinkcraft.llm.hf.prefix_graph import PrefixGraph

    model, tok = tiny_llama(seed=2)
    prompt = _ids(tok, "Count the trees and the stones:")
    sp = SamplingParams(max_new_tokens=12, temperature=0.0)
    before = HFEngine.from_model(*tiny_llama(seed=2)).generate(Batch(items=[prompt]), sp)[0].token_ids
    new_state = _perturbed(model)
    eng = HFEngine.from_model(model, tok)
    def broken(run, device, pool=None):  # noqa: ANN001, ANN202
        raise RuntimeError("capture failed")

    if prefix != "eager":
        eng._batcher._pgraph = graph = PrefixGraph(eng._prefix_forward, eng.device, gate=NoGate(),
                                                   capture=replay_capture if prefix == "graph" else broken)
    h = eng.submit(GenerationRequest(prompt, sp, prefix_len=4))  # installs the shared prefix (old weights)
    for _ in range(4):
        eng.step()
    eng.update_weights(new_state, version=1)  # between steps, on the stepping thread: applied now
    if prefix == "graph":
        assert (graph.captures, graph.replays, graph.failed) == (1, 1, False)
        assert eng.decode_metrics()["prefix_graph_replays"] == 1
    elif prefix == "broken graph":
        assert graph.failed and eng.decode_metrics()["prefix_graph_failed"] == 1
    r = _run(eng, [h])[h]
    (i0, v0), (switch, v1) = r.weight_versions
    assert (i0, v0, v1) == (0, 0, 1) and 1 <= switch < 12 and eng.weights_version == 1
    toks = r.completion.token_ids
    assert toks[:switch] == before[:switch] and toks != before  # old weights up to the switch, new after
    # a request after the update runs on the new weights alone, and equals an engine built on them; its shared
    # prefix (installed before the update, recomputed at it) is still shared
    fresh, ftok = tiny_llama(seed=2)
    fresh.load_state_dict({k: v for k, v in new_state.items()}, strict=False)
    p = 4
    h2 = eng.submit(GenerationRequest(prompt, sp, prefix_len=p))
    r2 = _run(eng, [h2])[h2]
    assert r2.reused_tokens == p and r2.weight_versions == [(0, 1)]
    assert r2.completion.token_ids == HFEngine.from_model(fresh, ftok).generate(Batch(items=[prompt]), sp)[0].token_ids


def _prefix_state(kv) -> list[torch.Tensor]:  # noqa: ANN001
    p = kv.prefix_len
    return [b[:, :, :p].clone() for b in kv.prefix_keys + kv.prefix_values]


def test_prefix_graph_replays_each_version_and_checks_itself() -> None:
    """prefix_graph.py on the CPU (stand-in capture): one capture, then a replay a version, each leaving the
    prefix buffers equal to the eager forward's KV of the new weights; a new cache or new parameter storage
    captures again; a graph whose replay keeps what its capture computed (as one reading a host-side cached
    tensor would) is caught by the bit-for-bit check at the first weight change and turned off for good; a capture
    that fails too."""
    from thinkcraft.llm.hf.prefix_graph import VERIFY, PrefixGraph

    model, tok = tiny_llama(seed=3)
    eng = HFEngine.from_model(model, tok)
    system = _ids(tok, "You are a careful player. Think, then act.")
    _run(eng, [eng.submit(GenerationRequest(system + _ids(tok, " go"), GREEDY, prefix_len=len(system)))])
    b = eng._batcher
    kv, pre = b.kv, b._prefix
    assert kv is not None and pre is not None and len(pre) == len(system)
    graph = PrefixGraph(eng._prefix_forward, eng.device, capture=replay_capture, gate=NoGate())
    ids = torch.as_tensor(pre[None])

    def eager_now() -> list[torch.Tensor]:
        with torch.no_grad():
            kvs = eng._prefix_forward(ids)
        return [k for k, _ in kvs] + [v for _, v in kvs]

    for version in range(1, 5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * version)
            assert graph.write(kv, pre, b._weights_key())
        got = _prefix_state(kv)
        assert all(torch.equal(g, w) for g, w in zip(got, eager_now()))
    assert (graph.captures, graph.replays, graph.failed, graph.checked) == (1, 4, False, VERIFY)
    with torch.no_grad():  # new storage under a parameter: a new key, a new capture
        model.model.norm.weight.data = model.model.norm.weight.data.clone()
        assert graph.write(kv, pre, b._weights_key()) and graph.captures == 2
        # a new Parameter object (not only new storage) registered on a module: the cached parameter list is
        # listed again (`_params`), so the key moves and the graph is captured anew
        key = b._weights_key()
        model.model.norm.weight = torch.nn.Parameter(model.model.norm.weight.data.clone())
        assert b._weights_key() != key and any(p is model.model.norm.weight for p in b._params())
        assert graph.write(kv, pre, b._weights_key()) and graph.captures == 3

    def frozen_capture(run, device, pool=None):  # noqa: ANN001, ANN202
        """A graph that replays what its capture computed (as one reading a host-side cached tensor would)."""
        out = run()
        snap = _prefix_state(kv)
        bufs = kv.prefix_keys + kv.prefix_values
        return (lambda: [b[:, :, :s.shape[2]].copy_(s) for b, s in zip(bufs, snap)]), out

    stale = PrefixGraph(eng._prefix_forward, eng.device, capture=frozen_capture, gate=NoGate())
    with torch.no_grad():
        assert stale.write(kv, pre, ())  # the capture's write: checked, equal (nothing changed yet)
        for p in model.parameters():
            p.add_(0.05)
        assert not stale.write(kv, pre, ()) and stale.failed  # caught: the caller writes the eager KV instead
        assert not stale.write(kv, pre, ())  # off for good

    def broken(run, device, pool=None):  # noqa: ANN001, ANN202
        raise RuntimeError("capture failed")

    bad = PrefixGraph(eng._prefix_forward, eng.device, capture=broken, gate=NoGate())
    assert not bad.write(kv, pre, ()) and bad.failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (none here)")
def test_prefix_graph_on_gpu_equals_the_eager_prefix_across_updates(monkeypatch) -> None:
    """On CUDA the batcher replays the prefix graph at each weight update (a bf16 copy engine): after every
    update the prefix buffers equal the eager forward's KV, the graph passed its checks, and the greedy tokens
    after the updates equal those of an engine with the graph off (THINKCRAFT_PREFIX_GRAPH=0)."""
    dev = torch.device("cuda")

    def run(graph: str) -> tuple[list[int], object]:
        monkeypatch.setenv("THINKCRAFT_PREFIX_GRAPH", graph)
        model, tok = tiny_llama(seed=5)
        model = model.to(dev, torch.bfloat16)
        eng = HFEngine.from_model(model, tok)
        system = _ids(tok, "You are a careful player. Think, then act.")
        prompt = system + _ids(tok, " go")
        _run(eng, [eng.submit(GenerationRequest(prompt, GREEDY, prefix_len=len(system)))])
        b = eng._batcher
        for version in range(1, 5):
            state = {n: (p.detach().float() + 0.01 * version).to(p.dtype) for n, p in model.named_parameters()}
            eng.update_weights(state, version=version)
            with b._contexts():
                want = eng._prefix_forward(torch.as_tensor(b._prefix[None], device=dev))
            got = _prefix_state(b.kv)
            assert all(torch.equal(g, w) for g, w in zip(got, [k for k, _ in want] + [v for _, v in want]))
        h = eng.submit(GenerationRequest(prompt, GREEDY, prefix_len=len(system)))
        return _run(eng, [h])[h].completion.token_ids, eng

    tokens, eng = run("1")
    graph = eng._batcher._pgraph
    assert graph is not None and not graph.failed and graph.replays >= 4
    m = eng.decode_metrics()
    assert m["prefix_graph_replays"] >= 4 and m["prefix_graph_failed"] == 0
    eager_tokens, eager = run("0")
    assert eager._batcher._pgraph is None and tokens == eager_tokens


def test_stale_and_failed_updates_keep_the_old_weights_and_version() -> None:
    model, tok = tiny_llama(seed=4)
    eng = HFEngine.from_model(model, tok)
    prompt = _ids(tok, "hello")
    want = eng.generate(Batch(items=[prompt]), GREEDY)[0].token_ids
    eng.update_weights(None, version=3)  # shared-weights engine: the version moves, nothing is copied
    with pytest.raises(WeightUpdateError, match="stale"):
        eng.update_weights(_perturbed(model), version=3)
    w0 = model.model.embed_tokens.weight.detach().clone()
    bad = _perturbed(model)
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)  # shape mismatch, after valid tensors
    with pytest.raises(WeightUpdateError, match="shape"):
        eng.update_weights(bad, version=4)
    with pytest.raises(WeightUpdateError, match="no tensor"):
        eng.update_weights({"model.not_a_layer.weight": torch.zeros(1)}, version=4)
    assert eng.weights_version == 3 and torch.equal(model.model.embed_tokens.weight, w0)
    assert eng.generate(Batch(items=[prompt]), GREEDY)[0].token_ids == want
    eng.update_weights(_perturbed(model), version=4)  # a good one after the failures is applied
    assert eng.weights_version == 4 and not torch.equal(model.model.embed_tokens.weight, w0)


def test_lora_adapter_update_only_and_parked_kv_invalidated() -> None:
    peft = pytest.importorskip("peft")
    model, tok = tiny_llama(seed=6)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    eng = HFEngine.from_model(lora, tok)
    prompt = _ids(tok, "adapters only")
    _run(eng, [eng.submit(GenerationRequest(prompt, GREEDY, episode="a"))])
    assert eng._batcher.table.parked("a") is not None
    adapters = {n: torch.randn_like(p) for n, p in lora.named_parameters() if "lora_B" in n}
    eng.update_weights(adapters, version=1)
    assert eng._batcher.table.parked("a") is None and eng.decode_metrics()["invalidated"] == 1
    b_name = next(iter(adapters))
    torch.testing.assert_close(dict(lora.named_parameters())[b_name], adapters[b_name])


def test_update_from_another_thread_while_the_engine_thread_steps(tiny) -> None:
    model, tok = tiny_llama(seed=8)
    eng = HFEngine.from_model(model, tok)
    eng.start()
    try:
        prompts = [_ids(tok, f"thread {i} prompt") for i in range(6)]
        results: dict[int, object] = {}

        def worker(i: int) -> None:
            c = eng.generate(Batch(items=[prompts[i]]), SamplingParams(max_new_tokens=10, temperature=0.0))[0]
            results[i] = c

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in ts:
            t.start()
        eng.update_weights(_perturbed(model, 0.01), version=1)
        for t in ts:
            t.join()
        assert sorted(results) == list(range(6)) and eng.weights_version == 1
        assert all(len(c.token_ids) == 10 for c in results.values())
    finally:
        eng.stop()


def test_thinking_budget_under_continuous_batching(tiny) -> None:
    """Rows with different budgets, arriving at different steps: each thought is closed exactly at its
    budget in the same sequence (forced tokens marked), and the answer follows."""
    model, tok = tiny
    eng = HFEngine.from_model(model, tok)
    prompt = _ids(tok, "Question: what next?<think>")
    close = eng._encode(eng.thinking_close_text, first=False)
    h0 = eng.submit(GenerationRequest(prompt, SamplingParams(max_new_tokens=16, temperature=0.0, thinking_budget=5)))
    eng.step()
    eng.step()
    h1 = eng.submit(GenerationRequest(prompt + [5], SamplingParams(max_new_tokens=16, temperature=0.0,
                                                                   thinking_budget=2)))
    res = _run(eng, [h0, h1])
    for h, budget in ((h0, 5), (h1, 2)):
        r = res[h]
        c = r.completion
        assert c.thinking_tokens == budget and r.thinking_budget == budget
        assert c.token_ids[budget: budget + len(close)] == close
        assert c.forced_token_indices == list(range(budget, budget + len(close)))
        alone = HFEngine.from_model(model, tok).generate(
            Batch(items=[c.prompt_token_ids]), SamplingParams(max_new_tokens=16, temperature=0.0, thinking_budget=budget))
        assert alone[0].token_ids == c.token_ids


@pytest.mark.slow
def test_compiled_decode_step_equals_eager(tiny) -> None:
    """compile_decode (torch.compile of the one-token step and of the bookkeeping; CUDA graphs on a GPU) gives
    the eager tokens and logprobs, static and dynamic widths, with requests joining mid-way."""
    import thinkcraft.llm.hf.cache as C

    model, tok = tiny
    prompts = [_ids(tok, t) for t in ("Hello there", "The quick brown fox", "a b c d e f")]
    sp = SamplingParams(max_new_tokens=5, temperature=0.0)
    want = HFEngine.from_model(model, tok).generate(Batch(items=prompts), sp)
    for width in ("static", "dynamic"):
        eng = HFEngine.from_model(model, tok, kv_cache=width, compile_decode=True)
        warned: list[str] = []
        C.log.warning = lambda msg, *a: warned.append(msg % a)  # type: ignore[method-assign]
        try:
            got = eng.generate(Batch(items=prompts), sp)
        finally:
            del C.log.warning
        if warned:
            pytest.skip(f"torch.compile cannot build here: {warned[0][:200]}")
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)


def test_compiled_prefill_equals_eager_over_turns(tiny, monkeypatch) -> None:
    """THINKCRAFT_PREFILL_COMPILE=1 (the packed prefill through torch.compile, dynamic shapes) gives the eager
    tokens and logprobs: three episodes of three turns with a shared prefix (new-token and key counts differ
    from prefill to prefill, the prefix's key index in use), and it really ran compiled (no eager fallback)."""
    import thinkcraft.llm.hf.cache as C

    model, tok = tiny
    system = _ids(tok, "You play a game. Answer with one action.")
    obs = _episode_prompts(tok, 3)

    def play(eng: HFEngine) -> list[tuple[list[int], list[float]]]:
        out, prompts = [], {e: system + obs[0] + _ids(tok, f" ep{e}" * (e + 1)) for e in range(3)}
        for k in range(3):
            hs = {e: eng.submit(GenerationRequest(p, GREEDY, prefix_len=len(system), episode=e))
                  for e, p in prompts.items()}
            done = _run(eng, list(hs.values()))
            for e, h in hs.items():
                c = done[h].completion
                out.append((c.token_ids, c.logprobs))
                prompts[e] = prompts[e] + c.token_ids + (obs[k + 1] if k < 2 else [])
        return out

    monkeypatch.setenv("THINKCRAFT_PREFILL_COMPILE", "0")
    want = play(HFEngine.from_model(model, tok))
    monkeypatch.setenv("THINKCRAFT_PREFILL_COMPILE", "1")
    eng = HFEngine.from_model(model, tok)
    warned: list[str] = []
    monkeypatch.setattr(C.log, "warning", lambda msg, *a: warned.append(msg % a))
    from torch._dynamo.utils import counters

    graphs0 = counters["stats"]["unique_graphs"]
    got = play(eng)
    fn = eng._batcher._prefill_fn
    if warned and fn.failed:
        pytest.skip(f"torch.compile cannot build here: {warned[0][:200]}")
    assert isinstance(fn, C.OrEager) and not fn.failed and eng.decode_metrics()["reused_tokens"] > 0
    # one graph for the whole layer stack, not one per layer, per shape or per coincidence of two sizes (the
    # first turn's key count equals its token count: no duck sizing)
    assert counters["stats"]["unique_graphs"] - graphs0 == 1, counters["stats"]
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4)
    monkeypatch.setenv("THINKCRAFT_PREFILL_COMPILE", "yes")
    with pytest.raises(UserError, match="THINKCRAFT_PREFILL_COMPILE must be 0 or 1"):
        C.prefill_compiled()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA decode path (varlen prefill, CUDA graphs) needs a GPU")
def test_cuda_compiled_step_and_turn_reuse_agree_with_eager_in_bf16() -> None:
    """On a GPU: the FlashAttention varlen prefill and the compiled CUDA-graph step (static and dynamic widths)
    give the eager engine's tokens (bf16: near-ties may flip, so >= 90% agree) and close logprobs, over a
    3-turn episode with a shared prefix."""
    model, tok = tiny_llama(thinking=True, dtype=torch.bfloat16)
    model.cuda()
    system = _ids(tok, "You play a game. Answer with one action.")
    engines = {"eager": HFEngine.from_model(model, tok),
               "static": HFEngine.from_model(model, tok, kv_cache="static", compile_decode=True),
               "dynamic": HFEngine.from_model(model, tok, kv_cache="dynamic", compile_decode=True)}
    prompts, want = [system + _ids(tok, " first observation")], []
    for k in range(3):  # the eager engine's episode fixes the prompts every engine gets
        h = engines["eager"].submit(GenerationRequest(prompts[k], GREEDY, prefix_len=len(system), episode="e"))
        want.append(_run(engines["eager"], [h])[h])
        prompts.append(prompts[k] + want[k].completion.token_ids + _ids(tok, f" observation {k + 2}"))
    for name in ("static", "dynamic"):
        eng = engines[name]
        got = []
        for k in range(3):
            h = eng.submit(GenerationRequest(prompts[k], GREEDY, prefix_len=len(system), episode="e"))
            got.append(_run(eng, [h])[h])
        assert np.mean([a.completion.token_ids == b.completion.token_ids for a, b in zip(want, got)]) >= 2 / 3, name
        a, b = want[0].completion, got[0].completion
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        np.testing.assert_allclose(a.logprobs[:n], b.logprobs[:n], atol=5e-2)
        assert got[1].reused_tokens > len(system) and got[0].reused_tokens == len(system)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an engine on a second GPU needs 2 CUDA GPUs")
def test_an_engine_on_the_second_gpu_stepped_from_a_thread_on_the_first() -> None:
    """The async pools step each engine from its own thread, whose current GPU is cuda:0: an engine on cuda:1
    (compiled CUDA-graph step, pipelined host copies) gives the tokens it gives stepped on its own device, and
    never runs a row past max_new_tokens (its copies' completion events are on cuda:1's stream)."""
    model, tok = tiny_llama(thinking=True, dtype=torch.bfloat16)
    prompts = [_ids(tok, t) for t in ("Hello there", "The quick brown fox", "a b c d e f", "one two")]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0)
    model.cuda(1)
    with torch.cuda.device(1):  # the reference: the same compiled path, stepped with its own GPU current
        want = HFEngine.from_model(model, tok, kv_cache="static", compile_decode=True).generate(
            Batch(items=prompts), sp)
    eng = HFEngine.from_model(model, tok, kv_cache="static", compile_decode=True)
    got: dict = {}

    def work() -> None:
        torch.cuda.set_device(0)
        hs = [eng.submit(GenerationRequest(p, sp)) for p in prompts]
        got.update(_run(eng, hs))
        got["order"] = hs

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert [got[h].completion.token_ids for h in got["order"]] == [c.token_ids for c in want]
    assert eng.decode_metrics()["host_length_ends"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two engines on two GPUs need 2 CUDA GPUs")
def test_two_engines_on_two_gpus_stepped_at_once_stay_compiled(caplog) -> None:
    """The async pools with two GPUs: an engine per GPU, each stepped from its own thread at the same time,
    both capturing their compiled decode steps at once. Tokens equal the eager step's on each, and neither
    falls back to eager (the 2-GPU async bench of 2026-11-27 had two such fallbacks; torch allows one graph
    capture at a time per process and its default capture stream is bound to the first capture's device)."""
    import logging

    model, tok = tiny_llama(thinking=True)  # fp32: compiled and eager pick the same greedy tokens
    prompts = [_ids(tok, t) for t in ("Hello there", "The quick brown fox", "a b c d e f", "one two")]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0)
    models = {d: copy.deepcopy(model).to(f"cuda:{d}") for d in (0, 1)}
    want = {d: HFEngine.from_model(models[d], tok, kv_cache="static", compile_decode=False).generate(
        Batch(items=prompts), sp) for d in (0, 1)}
    engines = {d: HFEngine.from_model(models[d], tok, kv_cache="static", compile_decode=True) for d in (0, 1)}
    got: dict = {}
    start = threading.Barrier(2)

    def work(d: int) -> None:
        start.wait()
        hs = [engines[d].submit(GenerationRequest(p, sp)) for p in prompts]
        res = _run(engines[d], hs)
        got[d] = [res[h].completion.token_ids for h in hs]

    with caplog.at_level(logging.WARNING, logger="thinkcraft.llm.hf"):
        threads = [threading.Thread(target=work, args=(d,)) for d in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not [r for r in caplog.records if "unavailable" in r.getMessage()]
    for d in (0, 1):
        assert got[d] == [c.token_ids for c in want[d]], d


def test_structured_and_free_requests_share_the_decode_batch() -> None:
    """A JSON-schema-constrained request and free ones in the same running batch, joining at different steps:
    the constrained answer parses, the free ones are the tokens they get alone (the mask touches their rows
    not), and a slot freed by a constrained request serves a free one unconstrained."""
    pytest.importorskip("xgrammar")
    import json

    from thinkcraft.llm.constrained import StructuredOutput

    model, tok = tiny_llama(seed=3)
    schema = {"type": "object", "properties": {"move": {"type": "string", "enum": ["left", "right"]}},
              "required": ["move"]}
    spec = StructuredOutput.from_schema(schema)
    free_sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    prompts = [_ids(tok, f"state {i}: tree at ({i}, {i + 1})") for i in range(3)]
    alone = HFEngine.from_model(model, tok).generate(Batch(items=prompts), free_sp)
    eng = HFEngine.from_model(model, tok, max_slots=2)
    h_json = eng.submit(GenerationRequest(prompts[0], SamplingParams(max_new_tokens=24, temperature=0.0,
                                                                     structured=spec)))
    eng.step()
    h_free = [eng.submit(GenerationRequest(p, free_sp)) for p in prompts]
    res = _run(eng, [h_json, *h_free])
    assert json.loads(res[h_json].completion.text)["move"] in ("left", "right")
    for h, want in zip(h_free, alone):
        assert res[h].completion.token_ids == want.token_ids


def test_a_failed_step_ends_the_requests_in_flight_and_the_engine_recovers(tiny, monkeypatch) -> None:
    model, tok = tiny
    eng = HFEngine.from_model(model, tok)
    prompts = [_ids(tok, "Hello there"), _ids(tok, "The quick brown fox")]
    want = eng.generate(Batch(items=prompts), GREEDY)
    h = eng.submit(GenerationRequest(prompts[0], GREEDY, episode="e", tag="mine"))
    eng.step()
    real = type(eng._batcher)._forward_last
    calls = {"n": 0}

    def flaky(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fault (injected)")
        return real(self, *a, **k)

    monkeypatch.setattr(type(eng._batcher), "_forward_last", flaky)
    eng._batcher._step_fn = eng._batcher._forward_last
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    (r,) = eng.poll()
    assert (r.handle, r.tag, r.completion.finish_reason) == (h, "mine", "error") and "injected" in r.error
    assert eng.pending() == 0 and eng.decode_metrics()["failed"] == 1
    got = eng.generate(Batch(items=prompts), GREEDY)  # a clean cache: the same tokens as before the fault
    assert [c.token_ids for c in got] == [c.token_ids for c in want] and eng.poll() == []


def test_a_row_the_device_runs_past_max_new_tokens_ends_on_the_host(tiny) -> None:
    """If the device's bookkeeping lets a row run past its max_new_tokens (seen once on an H100 with the async
    pools: an IndexError that failed every running request), the host ends it with exactly max_new_tokens
    tokens - the same ones - as finish "length", stops it on the device, and counts it."""
    model, tok = tiny
    prompt = _ids(tok, "Plain prompt without thinking")
    sp = SamplingParams(max_new_tokens=5, temperature=0.0, logprobs=True)
    want = HFEngine.from_model(model, tok).generate(Batch(items=[prompt]), sp)[0]
    if want.finish_reason != "length":
        pytest.skip("the tiny model ends this prompt before max_new_tokens; the case needs a row that runs to it")
    eng = HFEngine.from_model(model, tok)
    h = eng.submit(GenerationRequest(prompt, sp))
    eng.step()  # admitted and one token launched
    b = eng._batcher
    b.state.max_new[b.h_run.nonzero()[0]] = 1000  # the device would run on
    got = _run(eng, [h])[h].completion
    assert got.token_ids == want.token_ids and got.finish_reason == "length"
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert eng.decode_metrics()["host_length_ends"] == 1
    h2 = eng.submit(GenerationRequest(prompt, sp))  # the slot serves the next request normally
    assert _run(eng, [h2])[h2].completion.token_ids == want.token_ids


def test_no_iteration_is_launched_after_every_row_ended_by_length(tiny, monkeypatch) -> None:
    """The host reads an iteration's record one iteration late; where every running row samples its last allowed
    token in an iteration already launched, the next one is not launched (`_ends_in_flight`): the same tokens and
    log-probs as with it, one launch fewer for a batch that ends together, counted (`launches_skipped`); rows of
    different lengths skip only at the end, and a row that may still go on is launched as before."""
    model, tok = tiny
    prompts = [_ids(tok, t) for t in ("Hello there", "Numbers: 1 2 3", "Once upon a time")]

    def run(lengths: list[int], skip: bool) -> tuple[list, dict, int]:
        monkeypatch.setenv("THINKCRAFT_SKIP_ENDED_LAUNCH", "1" if skip else "0")  # the A/B switch, read per engine
        eng = HFEngine.from_model(model, tok)
        hs = [eng.submit(GenerationRequest(p, SamplingParams(max_new_tokens=n, temperature=0.0, logprobs=True)))
              for p, n in zip(prompts, lengths)]
        out = _run(eng, hs)
        assert eng.pending() == 0 and not eng.step()
        return [out[h].completion for h in hs], eng.decode_metrics(), eng._batcher._iter

    for lengths in ([5, 5, 5], [3, 6, 4]):
        got, m, launched = run(lengths, skip=True)
        want, m_off, launched_off = run(lengths, skip=False)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-6)
        if all(w.finish_reason == "length" for w in want):
            assert launched == launched_off - 1 == max(lengths)
            assert m["launches_skipped"] >= 1 and m_off["launches_skipped"] == 0
        assert m["host_length_ends"] == 0 and m["decode_steps"] == m_off["decode_steps"]


def _fused_eagerly(monkeypatch) -> list[int]:
    """Every engine made from here on runs `_fused_iteration` (what the CUDA path captures as one graph) eagerly,
    in place of the step-by-step iteration; the returned list counts the fused iterations."""
    from thinkcraft.llm.hf.batcher import Batcher

    allocate = Batcher._allocate
    calls = [0]

    def alloc(self, *args):  # noqa: ANN001, ANN202
        allocate(self, *args)

        def fused(*flags):  # noqa: ANN002, ANN202
            calls[0] += 1
            return self._fused_iteration(self._forward_last, *flags)

        self._fused_fn = fused

    monkeypatch.setattr(Batcher, "_allocate", alloc)
    return calls


def test_the_fused_iteration_equals_the_step_by_step_one(tiny, monkeypatch) -> None:
    """The fused iteration (sampling, bookkeeping, log-probs and forward with no host decision inside: one CUDA
    graph on a GPU) gives the step-by-step iteration's tokens, log-probs, thinking cuts and ends: greedy and
    sampled rows (the same default-generator draws), thinking budgets, requests joining at different steps."""
    model, tok = tiny
    prompts = [_ids(tok, t) for t in ("Hello there<think>", "The quick brown fox", "a", "Once upon<think>")]
    sps = [SamplingParams(max_new_tokens=9, temperature=0.0, thinking_budget=3),
           SamplingParams(max_new_tokens=7, temperature=1.0),
           SamplingParams(max_new_tokens=5, temperature=0.8, top_p=0.9),
           SamplingParams(max_new_tokens=10, temperature=1.0, thinking_budget=2)]

    def run() -> tuple[list, dict]:
        eng = HFEngine.from_model(model, tok, max_slots=3)
        torch.manual_seed(7)
        arrive = {0: [0, 1], 2: [2], 4: [3]}
        got: dict = {}
        step = 0
        while len(got) < len(prompts):
            for i in arrive.get(step, []):
                eng.submit(GenerationRequest(prompts[i], sps[i], tag=i))
            eng.step()
            got.update({r.tag: r.completion for r in eng.poll()})
            step += 1
        return [got[i] for i in range(len(prompts))], eng.decode_metrics()

    want, _ = run()
    calls = _fused_eagerly(monkeypatch)
    got, m = run()
    assert calls[0] >= m["decode_steps"] > 0  # (an iteration launched after the last row ended is not counted)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.thinking_tokens == w.thinking_tokens and g.forced_token_indices == w.forced_token_indices
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    assert got[0].forced_token_indices and got[0].thinking_tokens == 3  # the budget cut ran in the fused path
    assert m["generated_tokens"] == sum(len(c.token_ids) for c in got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused decode graph is captured on CUDA only (no GPU here)")
def test_the_fused_decode_graph_on_gpu_equals_the_step_by_step_one(monkeypatch) -> None:
    """On a GPU (hand-captured graphs): the fused iteration as one graph gives the step-by-step engine's greedy
    tokens, log-probs and thinking cuts, with a request joining mid-way; it really ran (no fallback, fused
    captures); and its sampling draws anew at every replay (two unseeded sampled calls differ: a graph that froze
    its random numbers would repeat them)."""
    model, tok = tiny_llama(thinking=True)
    model.cuda()
    prompts = [_ids(tok, t) for t in ("Hello there<think>", "The quick brown fox", "Once upon<think>")]
    sps = [SamplingParams(max_new_tokens=12, temperature=0.0, thinking_budget=3),
           SamplingParams(max_new_tokens=9, temperature=0.0),
           SamplingParams(max_new_tokens=10, temperature=0.0, thinking_budget=2)]

    def run(fused: str) -> tuple[list, HFEngine]:
        monkeypatch.setenv("THINKCRAFT_DECODE_FUSED", fused)
        eng = HFEngine.from_model(model, tok, compile_decode=True)
        hs = [eng.submit(GenerationRequest(prompts[i], sps[i])) for i in (0, 1)]
        for _ in range(3):
            eng.step()
        hs.append(eng.submit(GenerationRequest(prompts[2], sps[2])))
        res = _run(eng, hs)
        return [res[h].completion for h in hs], eng

    want, _ = run("0")
    got, eng = run("1")
    b = eng._batcher
    assert b._fused_fn is not None and not b._fused_fn.failed
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.forced_token_indices == w.forced_token_indices
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-3)
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95)
    first = eng.generate(Batch(items=[prompts[1]] * 2), sampled)
    second = eng.generate(Batch(items=[prompts[1]] * 2), sampled)
    assert not b._fused_fn.failed
    assert [c.token_ids for c in first] != [c.token_ids for c in second]


def test_shared_weights_version_follows_in_place_steps_and_new_parameters() -> None:
    """`Batcher._params_now` keeps the parameter list between admissions (no walk of the model each turn) and
    still sees an optimizer's in-place step, a Parameter registered later (a new adapter) and a step on it; an
    in-place step drops the parked KV that the old weights computed."""
    model, tok = tiny_llama(seed=9)
    eng = HFEngine.from_model(model, tok)
    b = eng._batcher
    v0 = b._params_now()
    assert b._params_now() == v0 and b._param_list is not None
    with torch.no_grad():
        model.lm_head.weight.add_(0.0)  # an in-place op bumps the version, whatever it adds
    v1 = b._params_now()
    assert v1 != v0
    model.model.norm.extra = torch.nn.Parameter(torch.zeros(3))  # registered: the list is resolved again
    assert b._params_now() == v1 and any(p is model.model.norm.extra for p in b._param_list[2])
    with torch.no_grad():
        model.model.norm.extra.add_(1.0)
    assert b._params_now() != v1
    del model.model.norm.extra
    prompt = _ids(tok, "in-place steps")
    _run(eng, [eng.submit(GenerationRequest(prompt, GREEDY, episode="a"))])
    assert b.table.parked("a") is not None
    with torch.no_grad():
        next(model.parameters()).mul_(1.0)
    _run(eng, [eng.submit(GenerationRequest(prompt + [5], GREEDY, episode="a"))])
    assert eng.decode_metrics()["invalidated"] == 1
