"""The decode step's slot attention in one FlashAttention call (`attention.slot_decode_attention`): the layout
(each slot's KV head a varlen sequence read in place, the GQA group folded into the query axis) equals the
matmul path over the masked width, on the CPU through the kernel's plain contract (`varlen_decode_reference`)
and on a GPU through the kernel itself; the batcher gives the same tokens with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from thinkcraft.llm import attention as A
from thinkcraft.llm import compat
from thinkcraft.llm.hf import HFEngine
from thinkcraft.llm.hf import slots as slots_mod
from thinkcraft.llm.protocol import GenerationRequest, SamplingParams
from thinkcraft.llm.testing import tiny_llama
from thinkcraft.utils.errors import UserError

GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0)


def _slot_case(s: int, h: int, hkv: int, cols: int, d: int, key_len: list[int], dtype: torch.dtype,
               device: str = "cpu") -> tuple:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(s, h, 1, d, generator=g, device=device).to(dtype)
    kc = torch.randn(s, hkv, cols, d, generator=g, device=device).to(dtype)
    vc = torch.randn(s, hkv, cols, d, generator=g, device=device).to(dtype)
    return q, kc, vc, torch.tensor(key_len, device=device)


def _matmul_path(q, kc, vc, key_len, width: int, scale: float) -> tuple:  # noqa: ANN001
    mask = (torch.arange(width, device=q.device)[None, :] < key_len[:, None])[:, None, None, :]
    return A.gqa_decode_attention(q, kc[:, :, :width], vc[:, :, :width], mask, scale, True)


@pytest.mark.parametrize("h,hkv", [(6, 2), (4, 4), (8, 1)])
def test_slot_decode_layout_equals_the_matmul_path(h: int, hkv: int) -> None:
    """Rows reading 1 column, a few, and the whole width; columns past the width (the scratch column) hold
    garbage that neither path may read."""
    q, kc, vc, key_len = _slot_case(4, h, hkv, 10, 8, [1, 3, 9, 6], torch.float32)
    want, want_lse = _matmul_path(q, kc, vc, key_len, 9, 0.3)
    got, got_lse = A.slot_decode_attention(q, kc, vc, key_len, 9, 0.3, A.varlen_decode_reference)
    assert got.shape == want.shape == (4, h, 1, 8) and got_lse.shape == (4, h)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="more than max_k"):  # the reference enforces the kernel's contract
        A.slot_decode_attention(q, kc, vc, key_len, 5, 0.3, A.varlen_decode_reference)


@pytest.mark.parametrize("h,hkv", [(6, 2), (4, 1)])
def test_prefix_decode_layout_equals_the_folded_matmul_path(h: int, hkv: int) -> None:
    """Every row's queries against the one prefix copy: the buffer's columns past the prefix's length are never
    read (garbage there), and the result equals the matmul path's (`folded_attention_lse` over the prefix)."""
    s, d, pcap, p = 3, 8, 7, 5
    q, _, _, _ = _slot_case(s, h, hkv, 1, d, [1] * s, torch.float32)
    g = torch.Generator().manual_seed(3)
    pk, pv = torch.randn(1, hkv, pcap, d, generator=g), torch.randn(1, hkv, pcap, d, generator=g)
    qp = q.reshape(s, hkv, h // hkv, d).permute(1, 0, 2, 3).reshape(1, hkv, s * h // hkv, d)
    mask = (torch.arange(pcap) < p)[None, None, None, :]
    want, want_lse = A.folded_attention_lse(qp, pk, pv, mask, 0.3)
    want = want.reshape(hkv, s, h // hkv, d).permute(1, 0, 2, 3).reshape(s, h, 1, d)
    want_lse = want_lse.reshape(hkv, s, h // hkv).permute(1, 0, 2).reshape(s, h)
    got, got_lse = A.prefix_decode_attention(q, pk, pv, 0.3, A.varlen_decode_reference, prefix_len=p)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)


def test_decode_kernel_choice_and_switch(monkeypatch) -> None:
    """CPU (and fp32 anywhere): the matmul path; the switch is validated."""
    assert slots_mod.decode_kernel(torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setenv("THINKCRAFT_FLASH_DECODE", "yes")
    with pytest.raises(UserError, match="THINKCRAFT_FLASH_DECODE"):
        slots_mod.decode_kernel(torch.device("cpu"), torch.bfloat16)


def _episodes(eng: HFEngine, tok, turns: int = 3) -> list:  # noqa: ANN001
    """Three episodes with a shared system prefix, the third joining one turn late; every turn's completion."""
    system = list(tok("You play a game. Answer with one action.", add_special_tokens=False)["input_ids"])
    obs = lambda e, k: list(tok(f" ep {e} observation {k}: tree at {k},{e}. Act:",  # noqa: E731
                                add_special_tokens=False)["input_ids"])
    prompts = {e: system + obs(e, 0) for e in range(3)}
    out = []
    for k in range(turns):
        live = [0, 1] if k == 0 else [0, 1, 2]
        hs = {eng.submit(GenerationRequest(prompts[e], GREEDY, prefix_len=len(system), episode=e, tag=e)): e
              for e in live}
        got: dict = {}
        while len(got) < len(hs):
            eng.step()
            got.update({r.handle: r for r in eng.poll()})
        for h, e in hs.items():
            c = got[h].completion
            out.append((k, e, c.token_ids, c.logprobs))
            prompts[e] = prompts[e] + c.token_ids + obs(e, k + 1)
    return out


def _bf16_runs(monkeypatch, switch: str, check, turns: int = 3) -> dict[str, list]:  # noqa: ANN001
    """`_episodes` of a bf16 tiny model on the GPU, the decode step compiled and captured (the rollout's path), with
    the environment switch `switch` at "0" and then "1"; `check(engine, flag)` after each run."""
    model, tok = tiny_llama(dtype=torch.bfloat16)
    model.cuda()
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(switch, flag)
        eng = HFEngine.from_model(model, tok, max_slots=4, compile_decode=True)
        runs[flag] = _episodes(eng, tok, turns=turns)
        check(eng, flag)
    return runs


def _agree_in_bf16(want: list, got: list) -> None:
    """Two bf16 runs of `_episodes` agree: the same tokens in >= 2/3 of the turns (near-ties may flip in bf16) and
    log-probs within 5e-2 up to each turn's first different token."""
    same = [a[2] == b[2] for a, b in zip(want, got)]
    assert np.mean(same) >= 2 / 3, same
    for a, b in zip(want, got):
        n = next((i for i, (x, y) in enumerate(zip(a[2], b[2])) if x != y), len(a[2]))
        np.testing.assert_allclose(a[3][:n], b[3][:n], atol=5e-2)


def test_the_batcher_through_the_slot_layout_equals_the_matmul_path(monkeypatch) -> None:
    """CPU: the batcher with the slot attention forced through `slot_decode_attention` (its kernel's plain
    contract) gives the matmul path's greedy tokens and log-probs over growing episodes that share a prefix."""
    model, tok = tiny_llama()
    plain = HFEngine.from_model(model, tok, max_slots=4)
    want = _episodes(plain, tok)
    assert plain.decode_metrics()["flash_decode"] == 0.0  # the CPU's matmul path, said in the metrics
    import thinkcraft.llm.hf.cache as cache_mod

    monkeypatch.setattr(cache_mod, "decode_kernel", lambda device, dtype, head_dim: A.varlen_decode_reference)
    calls = []
    real = A.slot_decode_attention
    monkeypatch.setattr(A, "slot_decode_attention", lambda *a: calls.append(1) or real(*a))
    eng = HFEngine.from_model(model, tok, max_slots=4)
    got = _episodes(eng, tok)
    assert calls and eng.decode_metrics()["flash_decode"] == 1.0
    for (k, e, tw, lw), (_, _, tg, lg) in zip(want, got):
        assert tg == tw, (k, e)
        np.testing.assert_allclose(lg, lw, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernel runs on CUDA only")
def test_flash_decode_on_gpu_equals_the_matmul_path() -> None:
    """The real kernel at the Qwen2.5-0.5B decode shape (14 query / 2 KV heads of 64), rows from 1 column to the
    whole width, bf16; and the probe picks it."""
    assert A.probe_flash_decode("cuda") and A.probe_flash_decode("cuda", 128, torch.float16)
    s = 64
    lens = torch.randint(1, 1536, (s,), generator=torch.Generator().manual_seed(1)).tolist()
    lens[:2] = [1, 1536]
    q, kc, vc, key_len = _slot_case(s, 14, 2, 1537, 64, lens, torch.bfloat16, "cuda")
    want, want_lse = _matmul_path(q, kc, vc, key_len, 1536, 0.125)
    got, got_lse = A.slot_decode_attention(q, kc, vc, key_len, 1536, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-2, rtol=1e-3)
    # the shared prefix: every row's 14 heads against one (1, 2, 320, 64) copy, 300 columns read
    g = torch.Generator(device="cuda").manual_seed(2)
    pk = torch.randn(1, 2, 320, 64, generator=g, device="cuda").to(torch.bfloat16)
    pv = torch.randn(1, 2, 320, 64, generator=g, device="cuda").to(torch.bfloat16)
    qp = q.reshape(s, 2, 7, 64).permute(1, 0, 2, 3).reshape(1, 2, s * 7, 64)
    pw, pw_lse = A.folded_attention_lse(qp, pk, pv, (torch.arange(320, device="cuda") < 300)[None, None, None], 0.125)
    pw = pw.reshape(2, s, 7, 64).permute(1, 0, 2, 3).reshape(s, 14, 1, 64)
    pg, pg_lse = A.prefix_decode_attention(q, pk, pv, 0.125, prefix_len=300)
    torch.testing.assert_close(pg.float(), pw.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pg_lse, pw_lse.reshape(2, s, 7).permute(1, 0, 2).reshape(s, 14), atol=1e-2, rtol=1e-3)
    assert slots_mod.decode_kernel(torch.device("cuda"), torch.bfloat16, 64) is compat.flash_decode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernel runs on CUDA only")
def test_the_compiled_graphed_engine_with_flash_decode_equals_the_matmul_path(monkeypatch) -> None:
    """bf16 on a GPU, the decode step compiled and captured (the rollout's path): with and without the flash
    slot attention the same episodes give the same tokens (near-ties may flip in bf16: >= 2/3 of the turns)
    and close log-probs up to the first difference; the flash run really used it and never fell back."""
    def check(eng: HFEngine, flag: str) -> None:
        b = eng._batcher
        assert (b._flash is not None and b._flash.kernel is compat.flash_decode) == (flag == "1")
        assert not b._step_fn.failed and (b._fused_fn is None or not b._fused_fn.failed)

    runs = _bf16_runs(monkeypatch, "THINKCRAFT_FLASH_DECODE", check)
    _agree_in_bf16(runs["0"], runs["1"])


@pytest.mark.parametrize("prefix_rows", [[False, False, False], [True, False, True]])
def test_decode_attention_with_flash_meta_equals_the_matmul_path(prefix_rows: list[bool]) -> None:
    """The slot attention as the decode step runs it (`per_forward`, then `_decode_attention` with the cache's
    `FlashDecode`), through the kernel's plain contract, equals the matmul path: rows that read a 3-column shared
    prefix and rows that do not, and no row reading it at all (the call still reads one column, given no weight)."""
    from types import SimpleNamespace

    kv = slots_mod.SlotKV(1, 3, 8, 2, 8, 4, torch.float32, torch.device("cpu"), static_addresses=False)
    g = torch.Generator().manual_seed(5)
    for t in kv.keys + kv.values + kv.prefix_keys + kv.prefix_values:
        t.copy_(torch.randn(t.shape, generator=g))
    kv.prefix_len = 3
    mask = (kv.pcols < 3)[None, :] & torch.tensor(prefix_rows)[:, None]
    q = torch.randn(3, 4, 1, 8, generator=g)
    k, v = torch.randn(3, 2, 1, 8, generator=g), torch.randn(3, 2, 1, 8, generator=g)
    key_len, write_col = torch.tensor([1, 4, 8]), torch.tensor([0, 3, 7])
    outs = []
    for flash in (None, slots_mod.flash_decode_meta(kv, 4, A.varlen_decode_reference)):
        kc, vc = kv.keys[0].clone(), kv.values[0].clone()  # each path writes this step's K/V into its own copy
        ctx = slots_mod.DecodeCtx((kc,), (vc,), kv.prefix_keys, kv.prefix_values, kv.rows, write_col, key_len,
                                  kv.cols, mask, flash)
        outs.append(slots_mod._decode_attention(SimpleNamespace(layer_idx=0), q, k, v, slots_mod.per_forward(ctx), 0.3))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
