"""The sampler's LoRA forward (llm/hf/lora_fast.py): with gradients off it gives PEFT's output within bf16
rounding, follows the adapters' in-place updates, gives the learner's (gradient) path PEFT's values and gradients within
bf16 rounding without the activation casts (PEFT's own with THINKCRAFT_LORA_FAST_TRAIN=0), and stays out of what
it does not cover; an engine over a bf16 LoRA model generates what PEFT's forward generates."""

from __future__ import annotations

import copy

import pytest
import torch

from thinkcraft.llm.hf import HFEngine, lora_fast
from thinkcraft.llm.protocol import Batch, SamplingParams
from thinkcraft.llm.testing import tiny_llama

peft = pytest.importorskip("peft")


def _lora(seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    model, tok = tiny_llama(seed=seed)
    model = model.to(dtype)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:  # PEFT starts B at zero: the adapter would add nothing
                p.normal_(std=0.05)
    return lora, tok


def _lora_fused_on_cuda():
    """A bf16 LoRA model on CUDA with the fast LoRA forward and the fused projections (the engine's setup), and a
    batch of 3 x 100 tokens: what the elementwise kernels' GPU tests run (skipped without a CUDA device)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from thinkcraft.llm.hf import fused_proj

    model, _ = _lora()
    model = model.to("cuda")
    lora_fast.install(model, merge=False)  # the adapters unmerged (a CUDA engine merges them by default): A folded
    fused_proj.install(model)
    ids = torch.randint(0, 64, (3, 100), generator=torch.Generator().manual_seed(1)).to("cuda")
    return model, ids


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _peft_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """PEFT's own forward on the same modules (the fast one steps aside for a non-matching adapter name)."""
    layers = lora_fast.lora_layers(model)
    names = [layer._tc_name for layer in layers]
    for layer in layers:
        layer._tc_name = "--peft--"
    try:
        return _logits(model, ids)
    finally:
        for layer, n in zip(layers, names):
            layer._tc_name = n


def test_fast_forward_equals_peft_within_rounding_and_follows_updates() -> None:
    lora, _ = _lora()
    assert {p.dtype for n, p in lora.named_parameters() if "lora_" in n} == {torch.float32}  # PEFT's fp32 adapters
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    ref = _logits(lora, ids)
    layers = lora_fast.install(lora)
    assert len(layers) == len(lora_fast.lora_layers(lora)) > 0
    assert all(type(layer).__name__.startswith("Fast") for layer in layers)
    import pickle

    again = pickle.loads(pickle.dumps(lora))  # a model pickled whole (Ray's object store): its class is found
    assert type(lora_fast.lora_layers(again)[0]) is type(layers[0])
    assert lora_fast.install(lora) == layers  # idempotent
    got = _logits(lora, ids)
    torch.testing.assert_close(got, ref, atol=0.02 * ref.abs().max().item(), rtol=0)
    # an optimizer-style in-place update: the next eager forward copies it first
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_A" in n:
                p.add_(0.2)
    after = _logits(lora, ids)
    assert not torch.allclose(after, got)
    ref_after = _peft_logits(lora, ids)
    torch.testing.assert_close(after, ref_after, atol=0.02 * ref_after.abs().max().item(), rtol=0)
    assert lora_fast.refresh(layers) == 0  # already copied by the forward
    with torch.no_grad():
        next(p for n, p in lora.named_parameters() if "lora_B" in n).mul_(2)
    assert lora_fast.refresh(layers) == 1  # what the engine runs before a graphed step
    layers[0].scaling["default"] = 4.0  # PEFT's set_scale: no tensor changes, the copies must
    assert lora_fast.refresh(layers) == 1
    assert lora_fast.refresh(layers) == 0  # the per-step check: nothing moved
    # the check holds resolved tensors: a replaced adapter Parameter and a storage swapped under one are seen too
    a = layers[1].lora_A["default"]
    a.weight = torch.nn.Parameter(a.weight.detach() + 0.5)
    assert lora_fast.refresh(layers) == 1
    torch.testing.assert_close(layers[1]._tc_a, a.weight.detach().to(layers[1]._tc_a.dtype))
    a.weight.data = a.weight.detach() * 3
    assert lora_fast.refresh(layers) == 1
    torch.testing.assert_close(layers[1]._tc_a, a.weight.detach().to(layers[1]._tc_a.dtype))
    assert lora_fast.refresh(layers) == 0


def _grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(ids).logits
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if "lora_" in n}


def test_gradient_path_without_casts_equals_peft_within_rounding(monkeypatch) -> None:
    lora, _ = _lora(seed=1)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    twin = copy.deepcopy(lora)  # PEFT's own forward on the same weights
    calls = []
    real = lora_fast._train_forward
    monkeypatch.setattr(lora_fast, "_train_forward", lambda layer, x: calls.append(x.dtype) or real(layer, x))
    layers = lora_fast.install_for_learner(lora)
    assert layers and all(layer._tc_merged is None for layer in layers)  # a learner alone: no merged copies
    out, grads = _grads(lora, ids)
    assert len(calls) == len(layers) and set(calls) == {torch.bfloat16}  # every adapted linear, activations in bf16
    ref, ref_grads = _grads(twin, ids)
    torch.testing.assert_close(out, ref, atol=0.02 * ref.abs().max().item(), rtol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * len(layers)
    for n, g in grads.items():
        r = ref_grads[n]
        assert g.dtype == torch.float32 and r.abs().max() > 0  # the fp32 adapters themselves are trained
        torch.testing.assert_close(g, r, atol=0.05 * r.abs().max().item(), rtol=0, msg=n)
    # an engine's install before or after keeps its merge choice; the learner's leaves the engine's alone
    assert lora_fast.install_for_learner(lora) == layers
    # THINKCRAFT_LORA_FAST_TRAIN=0: the gradient path is PEFT's, bit for bit
    monkeypatch.setenv("THINKCRAFT_LORA_FAST_TRAIN", "0")
    off = copy.deepcopy(twin)
    lora_fast.install(off)
    calls.clear()
    out_off, grads_off = _grads(off, ids)
    assert not calls and torch.equal(out_off, ref)
    assert all(torch.equal(grads_off[n], ref_grads[n]) for n in ref_grads)


def test_what_it_does_not_cover_stays_peft(monkeypatch) -> None:
    fp32, _ = _lora(seed=2, dtype=torch.float32)
    assert lora_fast.install(fp32) == []  # no casts to save: a full-precision base keeps PEFT's forward
    monkeypatch.setenv("THINKCRAFT_LORA_FAST", "0")
    off, _ = _lora(seed=2)
    assert lora_fast.install(off) == []
    monkeypatch.setenv("THINKCRAFT_LORA_FAST", "maybe")
    with pytest.raises(Exception, match="THINKCRAFT_LORA_FAST must be 0 or 1"):
        lora_fast.install(off)
    monkeypatch.delenv("THINKCRAFT_LORA_FAST")
    lora, _ = _lora(seed=3)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    lora_fast.install(lora)
    with lora.disable_adapter():  # the adapter-off judge: the base model alone, as PEFT computes it
        base = _logits(lora, ids)
    assert not torch.allclose(base, _logits(lora, ids))
    moved = copy.deepcopy(lora).to(torch.float16)  # a copy in another dtype gets copies of its own
    fast = lora_fast.install(moved)
    assert fast and all(layer._tc_a.dtype == torch.float16 for layer in fast)


def test_engine_over_a_bf16_lora_model_generates_peft_tokens() -> None:
    lora, tok = _lora(seed=4)
    ref_model = copy.deepcopy(lora)
    prompt = list(tok("fast adapters", add_special_tokens=False)["input_ids"])
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    eng = HFEngine.from_model(lora, tok)
    assert eng._lora_fast  # installed by the engine
    first = eng.generate(Batch(items=[prompt]), sp)[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("THINKCRAFT_LORA_FAST", "0")
        ref_eng = HFEngine.from_model(ref_model, tok)
        assert not ref_eng._lora_fast
        expected = ref_eng.generate(Batch(items=[prompt]), sp)[0]
    assert first.token_ids == expected.token_ids
    # the learner's in-place update between generations reaches the engine's copies (and the reference's PEFT)
    with torch.no_grad():
        for m in (lora, ref_model):
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.mul_(-3.0)
    second = eng.generate(Batch(items=[prompt]), sp)[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("THINKCRAFT_LORA_FAST", "0")
        again = ref_eng.generate(Batch(items=[prompt]), sp)[0]
    assert second.token_ids == again.token_ids
    assert second.token_ids != first.token_ids  # the update changed what is sampled: the copies followed it


def test_merged_weights_are_w_plus_sba_rounded_once_and_follow_updates(monkeypatch) -> None:
    """THINKCRAFT_LORA_MERGE's layers: one linear over W + s·B·A (merged in fp32, one bf16 rounding - to nearest
    here, THINKCRAFT_LORA_MERGE_ROUNDING=nearest, for exact values), re-merged in place when an adapter or the scale
    changes; within bf16 rounding of PEFT; off again, and stripped."""
    monkeypatch.setenv("THINKCRAFT_LORA_MERGE_ROUNDING", "nearest")
    lora, _ = _lora(seed=5)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    ref = _logits(lora, ids)
    layers = lora_fast.install(lora, merge=True)
    assert layers and all(layer._tc_merged is not None for layer in layers)

    def exact(layer) -> torch.Tensor:
        a, b = layer.lora_A["default"].weight.float(), layer.lora_B["default"].weight.float()
        w = layer.base_layer.weight.float() + layer.scaling["default"] * (b @ a)
        return w.to(layer.base_layer.weight.dtype)

    for layer in layers:
        torch.testing.assert_close(layer._tc_merged, exact(layer), atol=0, rtol=0)
    got = _logits(lora, ids)
    torch.testing.assert_close(got, ref, atol=0.02 * ref.abs().max().item(), rtol=0)
    ptrs = [layer._tc_merged.data_ptr() for layer in layers]
    with torch.no_grad():
        next(p for n, p in lora.named_parameters() if "lora_B" in n).mul_(-2)
    assert lora_fast.refresh(layers) == 1  # the graphed step's refresh: one layer's adapter moved
    layers[2].scaling["default"] = 3.0
    assert lora_fast.refresh(layers) == 1 and lora_fast.refresh(layers) == 0
    assert [layer._tc_merged.data_ptr() for layer in layers] == ptrs  # in place: a captured graph reads them
    for layer in layers:
        torch.testing.assert_close(layer._tc_merged, exact(layer), atol=0, rtol=0)
    after, want = _logits(lora, ids), _peft_logits(lora, ids)
    assert not torch.allclose(after, got)
    # a bf16 rounding of each merged weight (PEFT rounds the adapter's output instead): a little further apart
    torch.testing.assert_close(after, want, atol=0.03 * want.abs().max().item(), rtol=0)
    assert lora_fast.install(lora, merge=True) == layers  # idempotent
    assert [layer._tc_merged.data_ptr() for layer in layers] == ptrs
    # over its memory allowance, or switched off: the three-operator forward, the merged copies dropped
    assert all(layer._tc_merged is None for layer in lora_fast.install(lora, merge=True, max_merge_bytes=1000))
    assert all(layer._tc_merged is None for layer in lora_fast.install(lora))  # THINKCRAFT_LORA_MERGE unset: off (CPU)
    lora_fast.install(lora, merge=True)
    from thinkcraft.llm.hf.weights import strip_copies

    twin = copy.deepcopy(lora)
    strip_copies(twin)  # a copy for another engine or process: no derived tensors travel with it
    assert not any(type(m).__name__.startswith("Fast") or "_tc_merged" in m.__dict__ for m in twin.modules())
    want = _peft_logits(lora, ids)  # PEFT's own forward (a CPU bf16 GEMM's blocking may differ by an ulp)
    torch.testing.assert_close(_logits(twin, ids), want, atol=0.02 * want.abs().max().item(), rtol=0)


def test_stochastic_bf16_is_unbiased_where_nearest_loses_a_small_change() -> None:
    """`stochastic_bf16`: every value lands on one of its two bf16 neighbours (exactly representable values stay), and
    the mean over many roundings is the fp32 value, where rounding to nearest returns the base weight itself for a
    change below half a bf16 step - so a layer's output keeps the change's effect in expectation. Negative values,
    a binade's edge and zero included."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    w[0, :4] = torch.tensor([1.0, -1.0, 0.0, 2.0 - 2.0 ** -7])  # exact, and the last bf16 value below 2
    _, e = torch.frexp(w.float().abs().clamp_min(2.0 ** -14))  # |w| = m 2^e, m in [0.5, 1)
    step = torch.ldexp(torch.ones_like(w, dtype=torch.float32), e - 8)  # a bf16 step at each entry (8 bits)
    # well below half a step, away from zero (toward zero, a power of two's step below is half as large): nearest
    # drops it
    delta = torch.sign(w.float()) * step * (0.05 + 0.3 * torch.rand(w.shape, generator=gen))
    delta[0, :3] = 0.0
    exact = w.float() + delta
    assert torch.equal(exact.to(torch.bfloat16), w)  # rounded to nearest, the merge is the base weight
    n = 400
    acc = torch.zeros_like(exact, dtype=torch.float64)
    for _ in range(n):
        r = lora_fast.stochastic_bf16(exact)
        assert torch.equal(r.to(torch.bfloat16).float(), r)  # a bf16 value already
        below, above = r <= exact, r >= exact
        assert bool((below | above).all())
        # the neighbours: the bf16 value at or below the exact one in magnitude, or the next one up
        up = torch.nextafter(exact.to(torch.bfloat16), torch.where(exact >= 0, 1.0, -1.0).to(torch.bfloat16) * 4e38)
        assert bool(((r == exact.to(torch.bfloat16).float()) | (r == up.float())).all())
        acc += r.double()
    assert torch.equal(lora_fast.stochastic_bf16(exact)[0, :3], exact[0, :3])  # exact values never move
    # the noise's generator is seeded alike in every process: the same merges in the same order, the same weights
    lora_fast._ROUNDING_NOISE.clear()
    first = lora_fast.stochastic_bf16(exact)
    lora_fast._ROUNDING_NOISE.clear()
    assert torch.equal(lora_fast.stochastic_bf16(exact), first)
    mean = acc / n
    err = (mean - exact.double()).abs()
    # each rounding's error is at most a step (variance <= step^2 / 4): the mean's, a few step / (2 sqrt(n))
    assert bool((err <= 5 * step.double() / (2 * n ** 0.5)).all())
    x = torch.randn(8, 48, generator=gen)
    want = x.double() @ delta.double().t()  # the small change's effect on a layer's output
    got = x.double() @ (mean - w.double()).t()
    assert float((got - want).norm() / want.norm()) < 0.15
    assert float((x.double() @ (exact.to(torch.bfloat16).double() - w.double()).t()).norm()) == 0.0  # nearest: lost


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the stochastic rounding's CUDA run needs a GPU (none here)")
def test_stochastic_bf16_on_gpu_lands_on_a_neighbour_and_is_unbiased() -> None:
    """`stochastic_bf16` on CUDA (the merge a CUDA engine runs at each learner update): every value one of its two bf16
    neighbours (the base weight or the next one away from zero), exact values kept, the mean of many roundings the
    fp32 value."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(256, 128, generator=gen).to(torch.bfloat16)
    _, e = torch.frexp(w.float().abs().clamp_min(2.0 ** -14))
    step = torch.ldexp(torch.ones_like(w, dtype=torch.float32), e - 8)
    exact = (w.float() + torch.sign(w.float()) * step * 0.3 * torch.rand(w.shape, generator=gen)).cuda()
    w = w.cuda()
    acc = torch.zeros_like(exact, dtype=torch.float64)
    n = 256
    for _ in range(n):
        r = lora_fast.stochastic_bf16(exact)
        assert torch.equal(r.to(torch.bfloat16).float(), r)
        assert bool(((r == w.float()) | ((r.abs() > w.float().abs()) & (r.abs() <= w.float().abs() + step.cuda()))).all())
        acc += r.double()
    err = (acc / n - exact.double()).abs()
    assert bool((err <= 5 * step.cuda().double() / (2 * n ** 0.5)).all())
    assert torch.equal(lora_fast.stochastic_bf16(w.float()), w.float())  # bf16 values stay


def test_merge_rounding_switch(monkeypatch) -> None:
    """THINKCRAFT_LORA_MERGE_ROUNDING: stochastic by default (each re-merge draws new noise; the layer's weight is
    W + s·B·A within one bf16 step an entry, not the nearest rounding everywhere), "nearest" exact, a bad value one
    clear error; switching it re-merges an installed layer."""
    lora, _ = _lora(seed=9)
    monkeypatch.delenv("THINKCRAFT_LORA_MERGE_ROUNDING", raising=False)
    assert lora_fast.merge_rounding() == "stochastic"
    layers = lora_fast.install(lora, merge=True)

    def exact(layer) -> torch.Tensor:
        a, b = layer.lora_A["default"].weight.float(), layer.lora_B["default"].weight.float()
        return layer.base_layer.weight.float() + layer.scaling["default"] * (b @ a)

    for layer in layers:
        e, m = exact(layer), layer._tc_merged.float()
        step = torch.finfo(torch.bfloat16).eps * e.abs().clamp_min(2.0 ** -14) * 2
        assert bool(((m - e).abs() <= step).all())
    assert any(not torch.equal(layer._tc_merged, exact(layer).to(torch.bfloat16)) for layer in layers)
    monkeypatch.setenv("THINKCRAFT_LORA_MERGE_ROUNDING", "nearest")
    assert lora_fast.install(lora, merge=True) == layers
    for layer in layers:
        assert torch.equal(layer._tc_merged, exact(layer).to(torch.bfloat16))
    monkeypatch.setenv("THINKCRAFT_LORA_MERGE_ROUNDING", "up")
    with pytest.raises(Exception, match="THINKCRAFT_LORA_MERGE_ROUNDING must be one of stochastic, nearest"):
        lora_fast.install(lora, merge=True)
    assert len(lora_fast.install(lora)) == len(layers)  # not merging: the switch is not read


def test_merge_is_the_default_for_cuda_engines_only(monkeypatch) -> None:
    """THINKCRAFT_LORA_MERGE unset: merged weights for a model on CUDA, the three-operator forward elsewhere; "1" and
    "0" force either; anything else one clear error."""
    monkeypatch.delenv("THINKCRAFT_LORA_MERGE", raising=False)
    assert lora_fast.merge_default(torch.device("cuda", 0)) is True
    assert lora_fast.merge_default(torch.device("cpu")) is False and lora_fast.merge_default(None) is False
    lora, _ = _lora(seed=4)
    assert all(layer._tc_merged is None for layer in lora_fast.install(lora))  # a CPU model: not merged
    monkeypatch.setenv("THINKCRAFT_LORA_MERGE", "1")
    assert lora_fast.merge_default(torch.device("cpu")) is True
    assert all(layer._tc_merged is not None for layer in lora_fast.install(lora))
    monkeypatch.setenv("THINKCRAFT_LORA_MERGE", "0")
    assert lora_fast.merge_default(torch.device("cuda", 0)) is False
    monkeypatch.setenv("THINKCRAFT_LORA_MERGE", "auto")
    with pytest.raises(Exception, match="THINKCRAFT_LORA_MERGE must be 0 or 1"):
        lora_fast.merge_default(torch.device("cpu"))


def test_engine_with_merged_adapters_generates_peft_tokens(monkeypatch) -> None:
    lora, tok = _lora(seed=6)
    ref_model = copy.deepcopy(lora)
    prompt = list(tok("merged adapters", add_special_tokens=False)["input_ids"])
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    monkeypatch.setenv("THINKCRAFT_LORA_MERGE", "1")
    eng = HFEngine.from_model(lora, tok)
    assert eng._lora_fast and all(layer._tc_merged is not None for layer in eng._lora_fast)
    monkeypatch.setenv("THINKCRAFT_LORA_MERGE", "0")
    monkeypatch.setenv("THINKCRAFT_LORA_FAST", "0")
    ref_eng = HFEngine.from_model(ref_model, tok)
    assert eng.generate(Batch(items=[prompt]), sp)[0].token_ids == ref_eng.generate(Batch(items=[prompt]), sp)[0].token_ids
    monkeypatch.delenv("THINKCRAFT_LORA_FAST")
    monkeypatch.setenv("THINKCRAFT_LORA_MERGE", "maybe")
    with pytest.raises(Exception, match="THINKCRAFT_LORA_MERGE must be 0 or 1"):
        lora_fast.install(lora)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the hand-captured decode graph needs a GPU (none here)")
@pytest.mark.parametrize("merge", [False, True])
def test_graphed_decode_reads_the_refreshed_copies_on_gpu(merge: bool) -> None:
    """On CUDA with the compiled, hand-captured decode step under the learner's bf16 autocast: the fast engine
    (and the merged one, THINKCRAFT_LORA_MERGE) samples PEFT's greedy tokens, and after an in-place adapter
    update (no recapture: the copies keep their addresses) it samples the updated adapter's tokens - the step
    refreshes (re-merges) the copies before replaying."""
    lora, tok = _lora(seed=7)
    lora = lora.to("cuda")
    ref_model = copy.deepcopy(lora)
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in ("graphs and adapters", "a b c d")]
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("THINKCRAFT_LORA_MERGE", "1" if merge else "0")
        # rounded to nearest: what is checked is that the graph reads the re-merged copies, and PEFT's greedy tokens
        # are compared exactly (the stochastic rounding's own GPU test is below)
        mp.setenv("THINKCRAFT_LORA_MERGE_ROUNDING", "nearest")
        eng = HFEngine.from_model(lora, tok, kv_cache="static", compile_decode=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("THINKCRAFT_LORA_FAST", "0")
        ref_eng = HFEngine.from_model(ref_model, tok, kv_cache="static", compile_decode=True)
    assert eng._lora_fast and not ref_eng._lora_fast
    assert all((layer._tc_merged is not None) == merge for layer in eng._lora_fast)

    def both() -> tuple[list, list]:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            got = [r.token_ids for r in eng.generate(Batch(items=prompts), sp)]
            want = [r.token_ids for r in ref_eng.generate(Batch(items=prompts), sp)]
        return got, want

    got, want = both()
    assert got == want
    with torch.no_grad():
        for m in (lora, ref_model):
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.mul_(-3.0)
    got2, want2 = both()
    assert got2 != got  # the graphed step read the updated adapter (stale copies would repeat `got`)
    # PEFT's tokens, up to where a near-tie of this random model's bf16 logits flips (H200, 2026-11-28: the first
    # 6 of 8 agreed, then two alternating tokens swapped places): the rounding order differs, not the weights
    assert all(g[:4] == w[:4] for g, w in zip(got2, want2))
    assert eng.decode_metrics()["graph_captures"] == 1  # one capture: the update was read in place


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the hand-captured decode graph needs a GPU (none here)")
def test_graphed_decode_sees_the_adapter_switched_off_on_gpu() -> None:
    """`disable_adapter()` (the adapter-off 'self' judge) around a graphed engine: a replayed graph cannot see the
    switch, so the step keys its graphs on it - the judge samples the base model's tokens (as an eager engine
    does), not the policy's, and its graph is captured apart."""
    lora, tok = _lora(seed=8)
    lora = lora.to("cuda")
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in ("judge this", "x y z")]
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    graphed = HFEngine.from_model(lora, tok, kv_cache="static", compile_decode=True)
    eager = HFEngine.from_model(lora, tok, kv_cache="static", compile_decode=False)

    def gen(eng) -> list:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            return [r.token_ids for r in eng.generate(Batch(items=prompts), sp)]

    policy = gen(graphed)
    with lora.disable_adapter():
        judge, judge_eager = gen(graphed), gen(eager)
    assert judge != policy  # the switch reached the graphed step
    assert all(a[:4] == b[:4] for a, b in zip(judge, judge_eager))  # (bf16 near-ties: the first tokens)
    assert graphed.decode_metrics()["graph_captures"] == 2  # adapters on, adapters off


def test_derived_copies_take_at_most_a_quarter_of_a_gpus_free_memory(monkeypatch, caplog) -> None:
    """One allowance for every derived copy (merged LoRA weights, autocast shadows): an explicit byte limit, else
    `COPY_FREE_FRACTION` of the GPU's free memory, no limit on the CPU; a refusal is said in the log."""
    from thinkcraft.llm.hf import copies

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert copies.copies_fit(10**15, cpu, None, "x")  # the CPU: no limit
    assert copies.copies_fit(100, cpu, 100, "x") and not copies.copies_fit(101, cpu, 100, "x")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4000, 8000))  # 4,000 bytes free
    assert copies.copies_fit(1000, gpu, None, "x")
    with caplog.at_level("WARNING"):
        assert not copies.copies_fit(1001, gpu, None, "merged things: the slow path")
    assert "no merged things: the slow path" in caplog.text
    assert copies.copies_fit(5000, gpu, 6000, "x")  # an explicit limit wins over the free memory
