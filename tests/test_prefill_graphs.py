"""The packed prefill replayed from CUDA graphs (`llm/hf/prefill_graphs.py`): the buckets, the padded layout, and
the batcher through graphs - on the CPU with a capture stand-in that replays the captured function over the same
input buffers, and the in-place prefill through its kernel's plain contract - giving the eager prefill's greedy
tokens and log-probs; a failing capture or a replay that differs from the eager forward turns the graphs off
with one warning, the tokens unchanged. On a GPU: the real capture, against the eager engine."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from thinkcraft.llm import attention as A
from thinkcraft.llm.hf import HFEngine
from thinkcraft.llm.hf import prefill_graphs as PG
from thinkcraft.llm.testing import tiny_llama

from llm_helpers import NoGate, replay_capture
from test_flash_decode import _agree_in_bf16, _bf16_runs, _episodes


def test_buckets_bound_the_padding_and_are_few() -> None:
    """At least n, at most 1/16 more above the floor; the later turns' token counts of a rollout (a few hundred
    apart) share a handful of buckets."""
    for n in range(1, 70000, 37):
        b = PG.bucket(n, 16, 64)
        assert b >= n and (n <= 64 or b <= n + n / 16), n
        assert PG.bucket(b, 16, 64) == b  # a bucket is its own
    assert PG.bucket(5, 16, 64) == 64
    assert len({PG.bucket(n, 16, 64) for n in range(22000, 24000)}) <= 3


def _call(prefix: bool) -> PG.PrefillCall:
    # rows: slot 3 (2 kept + 3 new), slot 0 (1 new), slot 5 (4 new)
    slots, kept, new = np.array([3, 0, 5]), np.array([2, 0, 0]), np.array([3, 1, 4])
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    col = np.concatenate([np.arange(k, k + n) for k, n in zip(kept, new)])
    return PG.PrefillCall(np.arange(10, 18), col + 7, np.repeat(slots, new), col, cu, slots, kept + new,
                          np.array([True, False, True]) if prefix else None)


@pytest.mark.parametrize("prefix", [True, False])
def test_the_padded_layout(prefix: bool) -> None:
    """Pads at the end: the pad id at position 0 into slot 0's scratch column, marked invalid, reading no prefix;
    empty rows after the real ones (no new token, no key, their last token 0); the prefix call over every token."""
    call = _call(prefix)
    shape = PG.shape_of(call, 7)
    assert shape == PG.Shape(64, 8, 16, 7 if prefix else 0)
    i64, i32 = PG.padded(call, shape, pad_id=99, scratch_col=40, slot_stride=100, view_rows=650, prefix_cols=12)
    inp = PG.Inputs(shape, torch.device("cpu"))
    inp.load(i64, i32)
    assert inp.ids[0, :8].tolist() == list(range(10, 18)) and set(inp.ids[0, 8:].tolist()) == {99}
    assert inp.pos[0, :8].tolist() == (call.pos).tolist() and set(inp.pos[0, 8:].tolist()) == {0}
    assert inp.tok_slot[:8].tolist() == call.tok_slot.tolist() and set(inp.tok_slot[8:].tolist()) == {0}
    assert inp.tok_col[:8].tolist() == call.tok_col.tolist() and set(inp.tok_col[8:].tolist()) == {40}
    assert inp.last.tolist() == [2, 3, 7, 0, 0, 0, 0, 0]
    assert inp.cu_q.tolist() == [0, 3, 4, 8, 8, 8, 8, 8, 8]
    assert inp.starts.tolist() == [300, 0, 500, 0, 0, 0, 0, 0, 650]
    assert inp.used.tolist() == [5, 1, 4, 0, 0, 0, 0, 0]
    assert inp.valid.tolist() == [1] * 8 + [0] * 56
    assert inp.reads.tolist() == ([1, 1, 1, 0, 1, 1, 1, 1] if prefix else [0] * 8) + [0] * 56
    assert [m.tolist() for m in inp.meta] == [[0, 64], [0, 12], [7 if prefix else 1]]


def _graphed(model, tok, monkeypatch, capture=replay_capture, **kw):  # noqa: ANN001, ANN003, ANN202
    """An engine whose prefill runs in place (the kernel's plain contract) and through CPU stand-in graphs."""
    import thinkcraft.llm.hf.cache as cache_mod

    monkeypatch.setattr(cache_mod, "prefill_inplace_kernel", lambda device, dtype, head_dim: A.varlen_decode_reference)
    eng = HFEngine.from_model(model, tok, max_slots=4)
    graphs = PG.PrefillGraphs(eng._batcher._forward_last, eng.device, eng.pad_id, int(model.config.vocab_size),
                              capture=capture, gate=NoGate(), **kw)
    eng._batcher._fgraphs = graphs
    return eng, graphs


def test_the_batcher_through_prefill_graphs_equals_the_eager_prefill(monkeypatch) -> None:
    """Growing episodes that keep their KV between turns and share a prefix (one joining late): the same greedy
    tokens and log-probs as the eager prefill; every call replayed (a capture per new bucket, the first replays
    checked against the eager forward), counted in the metrics."""
    model, tok = tiny_llama()
    want = _episodes(HFEngine.from_model(model, tok, max_slots=4), tok, turns=5)
    eng, graphs = _graphed(model, tok, monkeypatch, capture_after=1)
    got = _episodes(eng, tok, turns=5)
    m = eng.decode_metrics()
    assert not graphs.failed and graphs.captures >= 1 and graphs.replays == m["prefill_calls"] == 5
    assert graphs.replays > graphs.captures  # later calls fell in a bucket captured before
    assert m["prefill_graph_replays"] == 5 and m["prefill_graph_captures"] == graphs.captures
    assert m["reused_tokens"] > 0
    for (k, e, tw, lw), (_, _, tg, lg) in zip(want, got):
        assert tg == tw, (k, e)
        np.testing.assert_allclose(lg, lw, atol=1e-5)


def test_prefill_graphs_fall_back_with_one_warning(monkeypatch, caplog) -> None:
    """A capture that fails, and a graph whose replays keep what its capture computed (a host-side decision frozen
    in the graph): both caught - the first at once, the second by the check of the next call in its bucket - the
    graphs off for good with one warning, and the tokens those of the eager prefill."""
    model, tok = tiny_llama()
    want = [o[2] for o in _episodes(HFEngine.from_model(model, tok, max_slots=4), tok, turns=4)]

    def broken(run, device, pool=None):  # noqa: ANN001, ANN202
        raise RuntimeError("capture failed")

    def frozen(run, device, pool=None):  # noqa: ANN001, ANN202
        out = run()
        return (lambda: out), out  # the replay recomputes nothing

    for capture in (broken, frozen):
        caplog.clear()
        eng, graphs = _graphed(model, tok, monkeypatch, capture=capture, capture_after=1)
        with caplog.at_level(logging.WARNING, logger="thinkcraft.llm.hf.prefill_graphs"):
            got = [o[2] for o in _episodes(eng, tok, turns=4)]
        assert graphs.failed and eng.decode_metrics()["prefill_graph_failed"] == 1.0
        assert sum("CUDA graphs are off" in r.message for r in caplog.records) == 1
        assert got == want, capture.__name__


def test_which_calls_stay_eager(monkeypatch) -> None:
    """Declined (eager, counted), the tokens the same: every call above `max_tokens`; a shape's calls before its
    `capture_after`-th (the default: its first), so a shape met once never captures; new shapes past `max_graphs`."""
    model, tok = tiny_llama()
    want = [o[2] for o in _episodes(HFEngine.from_model(model, tok, max_slots=4), tok, turns=5)]
    shapes: list = []
    real = PG.shape_of
    monkeypatch.setattr(PG, "shape_of", lambda call, p: shapes.append(real(call, p)) or shapes[-1])
    for kw, replays in (({"max_tokens": 8}, lambda s: 0),
                        ({}, lambda s: len(s) - len(set(s))),  # every call of a shape after its first
                        ({"capture_after": 1, "max_graphs": 1}, lambda s: s.count(s[0]))):  # the first shape only
        shapes.clear()
        eng, graphs = _graphed(model, tok, monkeypatch, **kw)
        assert [o[2] for o in _episodes(eng, tok, turns=5)] == want, kw
        assert len(shapes) == 5 and graphs.replays == replays(shapes), (kw, shapes)
        assert graphs.declined == 5 - graphs.replays and len(graphs.graphs) <= kw.get("max_graphs", 32)
        assert not graphs.failed
    assert len(set(shapes)) < 5  # the premise: some shape came back


def test_the_padded_eager_prefill_equals_the_eager_prefill(monkeypatch) -> None:
    """THINKCRAFT_PREFILL_PAD=1, no graphs: every call runs eagerly over its tokens padded to a bucket (at most 1/64
    more, at least 64), the same greedy tokens and log-probs as over its own count, the pads counted."""
    import thinkcraft.llm.hf.cache as cache_mod

    model, tok = tiny_llama()
    want = _episodes(HFEngine.from_model(model, tok, max_slots=4), tok, turns=4)
    monkeypatch.setattr(cache_mod, "prefill_inplace_kernel", lambda device, dtype, head_dim: A.varlen_decode_reference)
    calls: list = []
    real = PG.padded_forward
    monkeypatch.setattr("thinkcraft.llm.hf.iteration.padded_forward",
                        lambda fwd, call, *a: calls.append(len(call.ids)) or real(fwd, call, *a))
    for pad in ("0", "1"):
        monkeypatch.setenv("THINKCRAFT_PREFILL_PAD", pad)
        calls.clear()
        eng = HFEngine.from_model(model, tok, max_slots=4)
        assert eng._batcher._prefill_graphs() is None  # the CPU builds no graphs
        got = _episodes(eng, tok, turns=4)
        m = eng.decode_metrics()
        assert eng._batcher._flash_prefill is not None
        assert len(calls) == (m["prefill_calls"] if pad == "1" else 0) and (pad == "0" or calls)
        pads = sum(PG.bucket(n, PG.PAD_FINE, 64) - n for n in calls)
        assert m["prefill_pad_tokens"] == pads and (pad == "0" or pads > 0)
        for (k, e, tw, lw), (_, _, tg, lg) in zip(want, got):
            assert tg == tw, (pad, k, e)
            np.testing.assert_allclose(lg, lw, atol=1e-5)


def test_the_switch(monkeypatch) -> None:
    from llm_helpers import check_env_switch

    check_env_switch(monkeypatch, "THINKCRAFT_PREFILL_GRAPHS", PG.prefill_graphs_on, True, bad="on")
    check_env_switch(monkeypatch, "THINKCRAFT_PREFILL_PAD", PG.prefill_pad_on, False, bad="yes")  # opt-in
    # the CPU engine never builds them
    model, tok = tiny_llama()
    eng = HFEngine.from_model(model, tok, max_slots=4)
    _episodes(eng, tok, turns=1)
    assert eng._batcher._prefill_graphs() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the in-place prefill run on CUDA only")
def test_prefill_graphs_on_gpu_equal_the_eager_prefill(monkeypatch) -> None:
    """bf16 on a GPU, the rollout's path (decode graphs too): with and without the prefill's graphs the same
    episodes give the same tokens and log-probs - the graphed replays are checked bit for bit against the eager
    forward over the same padded inputs, so only the padding's other GEMM shapes can move a near-tie."""
    def check(eng: HFEngine, flag: str) -> None:
        m = eng.decode_metrics()
        assert m["prefill_graph_failed"] == 0.0
        assert m["prefill_graph_replays"] == (m["prefill_calls"] if flag == "1" else 0)

    monkeypatch.setattr(PG, "CAPTURE_AFTER", 1)  # every call replayed (the default would run each shape's first eagerly)
    runs = _bf16_runs(monkeypatch, "THINKCRAFT_PREFILL_GRAPHS", check, turns=5)
    _agree_in_bf16(runs["0"], runs["1"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the in-place prefill runs on CUDA only")
def test_padded_eager_prefill_on_gpu_agrees_with_the_eager_prefill(monkeypatch) -> None:
    """bf16 on a GPU, no prefill graphs: THINKCRAFT_PREFILL_PAD=1 runs every call over a bucket's token count (the
    pads counted); the same episodes agree with the unpadded calls' (only the GEMMs' other row counts can move a
    near-tie)."""
    def check(eng: HFEngine, flag: str) -> None:
        m = eng.decode_metrics()
        assert m["flash_prefill"] == 1.0 and m["prefill_graph_replays"] == 0.0
        assert (m["prefill_pad_tokens"] > 0) == (flag == "1")

    monkeypatch.setenv("THINKCRAFT_PREFILL_GRAPHS", "0")
    runs = _bf16_runs(monkeypatch, "THINKCRAFT_PREFILL_PAD", check, turns=5)
    _agree_in_bf16(runs["0"], runs["1"])
