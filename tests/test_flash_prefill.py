"""The prefill's attention over the slot cache read in place (`attention.prefill_in_place`): each row's kept and new
columns read where they are by one FlashAttention call (the slot cache viewed as overlapping rows,
`attention.slot_rows`; causal aligned bottom-right through `seqused_k`), the shared prefix's one copy by another,
merged by their LSEs - equal to the gather it replaces (every row's [prefix | columns] copied into one packed
sequence), on the CPU through the kernel's plain contract (`varlen_decode_reference`) and on a GPU through the
kernel itself; the batcher gives the same tokens with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from thinkcraft.llm import attention as A
from thinkcraft.llm import compat
from thinkcraft.llm.hf import HFEngine
from thinkcraft.llm.hf import slots as slots_mod
from thinkcraft.llm.testing import tiny_llama
from thinkcraft.utils.errors import UserError

from test_flash_decode import _agree_in_bf16, _bf16_runs, _episodes


def test_slot_rows_is_a_view_of_every_slot_column() -> None:
    """Row s*Hkv*C + c, head j of the view is slot s's column c of head j, for every slot (the last included: the
    view stays in bounds) - no copy."""
    cache = torch.arange(3 * 2 * 5 * 4, dtype=torch.float32).reshape(3, 2, 5, 4)
    rows = A.slot_rows(cache)
    assert rows.data_ptr() == cache.data_ptr() and rows.shape == (2 * 2 * 5 + 5, 2, 4)
    for s in range(3):
        for j in range(2):
            for c in range(5):
                assert torch.equal(rows[s * 2 * 5 + c, j], cache[s, j, c])


@pytest.mark.parametrize("prefix", [True, False])
def test_prefill_in_place_equals_the_gather(prefix: bool) -> None:
    """Rows with kept columns and without, one row of a single new token, rows reading the shared prefix and one
    that does not (garbage past every row's columns and past the prefix's length): the in-place attention
    through the kernel's plain contract equals the gather + varlen path."""
    case = A.prefill_case("cpu", 8, torch.float32, prefix=prefix)
    got = A.prefill_in_place(*case["inplace"], A.varlen_decode_reference, prefix=case["prefix"])
    want = A.prefill_gather_reference(*case["reference"], **case["reference_prefix"])
    assert got.shape == want.shape == (9, 6, 8)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the contract the kernel is held to: a row's keys past max_k are refused, not read
    q, kc, vc, cu_q, starts, used, max_q, _, scale = case["inplace"]
    with pytest.raises(ValueError, match="more than max_k"):
        A.slot_prefill_attention(q, kc, vc, cu_q, starts, used, max_q, 8, scale, A.varlen_decode_reference)


def test_prefill_kernel_choice_and_switch(monkeypatch) -> None:
    """CPU (and fp32 anywhere): the gather; the switch is validated."""
    assert slots_mod.prefill_inplace_kernel(torch.device("cpu"), torch.bfloat16) is None
    assert not A.probe_flash_prefill("cpu")
    monkeypatch.setenv("THINKCRAFT_FLASH_PREFILL", "yes")
    with pytest.raises(UserError, match="THINKCRAFT_FLASH_PREFILL"):
        slots_mod.prefill_inplace_kernel(torch.device("cpu"), torch.bfloat16)


def test_the_batcher_with_the_prefill_in_place_equals_the_gather(monkeypatch) -> None:
    """CPU: the batcher with its prefill's attention forced through `prefill_in_place` (the kernel's plain
    contract) gives the gather's greedy tokens and log-probs over growing episodes that keep their KV between
    turns and share a prefix (one joining a turn late)."""
    model, tok = tiny_llama()
    plain = HFEngine.from_model(model, tok, max_slots=4)
    want = _episodes(plain, tok)
    assert plain.decode_metrics()["flash_prefill"] == 0.0  # the CPU gathers, said in the metrics
    import thinkcraft.llm.hf.cache as cache_mod

    monkeypatch.setattr(cache_mod, "prefill_inplace_kernel", lambda device, dtype, head_dim: A.varlen_decode_reference)
    calls = []  # per call: did some row read the shared prefix
    real = A.prefill_in_place

    def counted(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[-1] is not None)
        return real(*args, **kw)

    monkeypatch.setattr(A, "prefill_in_place", counted)
    eng = HFEngine.from_model(model, tok, max_slots=4)
    got = _episodes(eng, tok)
    m = eng.decode_metrics()
    assert m["flash_prefill"] == 1.0 and m["reused_tokens"] > 0  # turn KV kept: the in-place path read kept columns
    assert calls and all(calls)  # every prefill call had rows reading the shared prefix
    for (k, e, tw, lw), (_, _, tg, lg) in zip(want, got):
        assert tg == tw, (k, e)
        np.testing.assert_allclose(lg, lw, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernel runs on CUDA only")
def test_flash_prefill_on_gpu_equals_the_gather() -> None:
    """The real kernel: the probe's case (fp16 and bf16, head dims 64 and 128), then a Craftax-sized chunk at the
    Qwen2.5-0.5B shape (14 query / 2 KV heads of 64): 48 rows of 1-400 new tokens after 0-1,200 kept columns,
    half of them reading a 300-column prefix, in a 64-slot cache of 1,601 columns."""
    assert A.probe_flash_prefill("cuda") and A.probe_flash_prefill("cuda", 128, torch.float16)
    assert slots_mod.prefill_inplace_kernel(torch.device("cuda"), torch.bfloat16, 64) is compat.flash_decode
    rng = np.random.default_rng(1)
    g = torch.Generator(device="cuda").manual_seed(2)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

    s_total, cols, hkv, h, d = 64, 1601, 2, 14, 64
    kc, vc, pk, pv = r(s_total, hkv, cols, d), r(s_total, hkv, cols, d), r(1, hkv, 320, d), r(1, hkv, 320, d)
    slots = rng.permutation(s_total)[:48].tolist()
    new = rng.integers(1, 401, 48).tolist()
    kept = rng.integers(0, 1201, 48).tolist()
    rows = (rng.random(48) < 0.5).tolist()
    used = [a + b for a, b in zip(new, kept)]
    q = r(sum(new), h, d)
    i32 = dict(dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, *np.cumsum(new).tolist()], **i32)
    starts = torch.tensor([x * hkv * cols for x in slots] + [(s_total - 1) * hkv * cols + cols], **i32)
    reads = torch.tensor(np.repeat(rows, new), device="cuda")
    meta = (torch.tensor([0, sum(new)], **i32), torch.tensor([0, 320], **i32), torch.tensor([300], **i32))
    got = A.prefill_in_place(q, kc, vc, cu_q, starts, torch.tensor(used, **i32), max(new), max(used), 0.125,
                             compat.flash_decode, prefix=(pk, pv, meta, 300, reads))
    want = A.prefill_gather_reference(q, kc, vc, cu_q, slots, used, 0.125, prefix=(pk, pv, 300), prefix_rows=rows)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # max_q / max_k are bounds, not counts (what the prefill's graphs pass: a bucket's longest row, the slot's width)
    wide = A.prefill_in_place(q, kc, vc, cu_q, starts, torch.tensor(used, **i32), 512, cols, 0.125,
                              compat.flash_decode, prefix=(pk, pv, meta, 300, reads))
    assert torch.equal(wide, got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernel runs on CUDA only")
def test_the_compiled_graphed_engine_with_flash_prefill_equals_the_gather(monkeypatch) -> None:
    """bf16 on a GPU, the rollout's path (decode compiled and captured): with and without the in-place prefill the
    same episodes give the same tokens (near-ties may flip in bf16: >= 2/3 of the turns) and close log-probs up to
    the first difference; the in-place run really used it."""
    def check(eng: HFEngine, flag: str) -> None:
        assert eng.decode_metrics()["flash_prefill"] == float(flag == "1")

    runs = _bf16_runs(monkeypatch, "THINKCRAFT_FLASH_PREFILL", check)
    _agree_in_bf16(runs["0"], runs["1"])


def test_keys_read_in_place_do_not_split_a_turn(monkeypatch) -> None:
    """The gather bounds a prefill call's keys (4 x max_batch_tokens, copied per layer); read in place they cost no
    memory, so late turns of long kept episodes are one call each: fewer calls than the gather, the same tokens."""
    import thinkcraft.llm.hf.cache as cache_mod

    model, tok = tiny_llama()
    runs = []
    for inplace in (False, True):
        if inplace:
            monkeypatch.setattr(cache_mod, "prefill_inplace_kernel",
                                lambda device, dtype, head_dim: A.varlen_decode_reference)
        eng = HFEngine.from_model(model, tok, max_slots=4, max_batch_tokens=64)
        out = _episodes(eng, tok, turns=8)
        m = eng.decode_metrics()
        runs.append((m["prefill_calls"], m["prefill_tokens"], [o[2] for o in out]))
    (calls_g, tokens_g, toks_g), (calls_i, tokens_i, toks_i) = runs
    assert toks_i == toks_g and tokens_i == tokens_g
    assert calls_i < calls_g, (calls_i, calls_g)
