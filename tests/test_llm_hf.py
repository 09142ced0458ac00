"""hf engine on tiny random-weight models (fast): cascade prefix reuse = plain path, padding invariance,
generation (greedy determinism, static = dynamic cache, logprobs = a forward pass, stop strings, thinking
budget, n/seed), PEFT-wrapped models, DLPack round trip, engine specs and serving options."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llm_helpers import NoGate, forward_logprobs, replay_capture
from thinkcraft.llm.attention import (
    attention_lse,
    attention_lse_reference,
    merge_attention,
    shared_prefix_attention,
)
from thinkcraft.llm.hf import HFEngine, top_p_filter
from thinkcraft.llm.protocol import Batch, EngineCapabilityError, SamplingParams
from thinkcraft.llm.testing import tiny_llama
from thinkcraft.utils.errors import UserError


@pytest.fixture(scope="module")
def tiny() -> tuple:
    return tiny_llama(thinking=True)


@pytest.fixture(scope="module")
def eng(tiny) -> HFEngine:
    return HFEngine.from_model(*tiny)


# --- attention maths -----------------------------------------------------------------------------------


def _full_attention(q, k, v, pk, pv):  # noqa: ANN001, ANN202
    """Reference: plain SDPA over [prefix | causal suffix] with the prefix copied per item."""
    b, h, s, _ = q.shape
    g = h // k.shape[1]
    kk = torch.cat([pk.expand(b, -1, -1, -1), k], 2).repeat_interleave(g, 1)
    vv = torch.cat([pv.expand(b, -1, -1, -1), v], 2).repeat_interleave(g, 1)
    p = pk.shape[2]
    mask = torch.ones(s, p + s, dtype=torch.bool)
    mask[:, p:] = torch.ones(s, s).tril().bool()
    return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("gqa_native", [True, False])
def test_shared_prefix_attention_equals_full_attention(heads: int, kv_heads: int, gqa_native: bool, monkeypatch) -> None:
    """Both ways of folding the prefix queries (GQA heads left to the kernel, or folded into the rows), with
    q laid out as transformers hands it over (a (B, S, H, d) buffer seen as (B, H, S, d)) or contiguous."""
    import thinkcraft.llm.attention as A

    monkeypatch.setitem(A._GQA_NATIVE, "cpu", gqa_native)
    torch.manual_seed(0)
    b, s, p, d = 3, 5, 7, 16
    q_bshd = torch.randn(b, s, heads, d)
    k, v = torch.randn(b, kv_heads, s, d), torch.randn(b, kv_heads, s, d)
    pk, pv = torch.randn(1, kv_heads, p, d), torch.randn(1, kv_heads, p, d)
    for q in (q_bshd.transpose(1, 2), q_bshd.transpose(1, 2).contiguous()):
        ref = _full_attention(q, k, v, pk, pv)
        for fn in (attention_lse, attention_lse_reference):
            out = shared_prefix_attention(q, k, v, pk, pv, lse_fn=fn)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_varlen_layout_equals_full_attention(heads: int, kv_heads: int) -> None:
    """The one-call varlen path's packing (per item [prefix | own suffix] keys, cumulative offsets, causal
    bottom-right) through the plain varlen reference = attention over the concatenated sequence. The CUDA
    kernels' agreement with the reference: the GPU test below and tests/test_llm_compat.py."""
    import thinkcraft.llm.attention as A

    torch.manual_seed(4)
    b, s, p, d = 3, 5, 7, 16
    q = torch.randn(b, s, heads, d).transpose(1, 2)
    k, v = torch.randn(b, kv_heads, s, d), torch.randn(b, kv_heads, s, d)
    pk, pv = torch.randn(1, kv_heads, p, d), torch.randn(1, kv_heads, p, d)
    got = A.varlen_prefix_attention(q, k, v, pk, pv, d**-0.5, A.varlen_reference)
    torch.testing.assert_close(got, _full_attention(q, k, v, pk, pv), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_loop_free_varlen_equals_the_reference(heads: int, kv_heads: int) -> None:
    """`varlen_dense` (the compiled CPU prefill's kernel: one masked attention, no loop over sequences) equals
    the per-sequence reference on packed sequences of unequal query and key lengths (queries fewer than keys:
    a turn's new tokens after its kept KV; one sequence of a single query)."""
    import thinkcraft.llm.attention as A

    torch.manual_seed(5)
    q_lens, k_lens, d = [3, 1, 6, 2], [7, 4, 6, 9], 16
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, d)
    k, v = torch.randn(sum(k_lens), kv_heads, d), torch.randn(sum(k_lens), kv_heads, d)
    args = (q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), d**-0.5)
    torch.testing.assert_close(A.varlen_dense(*args), A.varlen_reference(*args), atol=1e-5, rtol=1e-5)


def test_public_varlen_api_takes_what_the_candidate_passes() -> None:
    """torch's public varlen attention (the "public" candidate kernel) still has the arguments it is called with."""
    import inspect

    varlen = pytest.importorskip("torch.nn.attention.varlen")
    params = inspect.signature(varlen.varlen_attn).parameters
    assert {"scale", "window_size", "enable_gqa"} <= set(params), list(params)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention varlen is CUDA-only (no CUDA here)")
@pytest.mark.parametrize("kernel", ["aten", "public"])
def test_varlen_cascade_equals_the_two_part_merge_on_gpu(kernel: str) -> None:
    import thinkcraft.llm.attention as A

    if kernel == "public":  # a candidate, not the default: where it fails its probe the engine never uses it
        pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no public varlen attention")
        if not A.probe_varlen("cuda", "public"):
            A._VARLEN.pop("cuda", None)
            pytest.skip(f"torch {torch.__version__}'s public varlen_attn fails the probe (the engine keeps the aten op)")

    before = A._VARLEN.get("cuda", "unset")
    try:
        assert A.probe_varlen("cuda", kernel), f"varlen kernel {kernel!r} failed its probe"
        torch.manual_seed(3)
        b, s, p, h, hkv, d = 5, 9, 13, 8, 2, 64
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        pk, pv = (torch.randn(1, hkv, p, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        want = shared_prefix_attention(q, k, v, pk, pv, lse_fn=attention_lse_reference)
        got = shared_prefix_attention(q, k, v, pk, pv)  # takes the varlen path with this kernel
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    finally:
        if before == "unset":
            A._VARLEN.pop("cuda", None)
        else:
            A._VARLEN["cuda"] = before


def test_gqa_probe_and_fused_gqa_lse_equal_the_expanded_reference() -> None:
    """The CPU flash kernel takes GQA-shaped k/v (torch >= 2.5): the probe says so, and attention_lse with
    fewer KV heads equals the reference over expanded heads."""
    import thinkcraft.llm.attention as A

    assert A.probe_gqa_native("cpu") is True
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    for causal in (False, True):
        o1, l1 = attention_lse(q, k, v, causal, 0.3)
        o2, l2 = attention_lse_reference(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), causal, 0.3)
        torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)


def test_fused_lse_equals_reference_and_merge_is_exact() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    for causal in (False, True):
        o1, l1 = attention_lse(q, k, v, causal, 0.3)
        o2, l2 = attention_lse_reference(q, k, v, causal, 0.3)
        torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)
    # merging attention over two halves of the keys = attention over all keys
    k2, v2 = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    oa, la = attention_lse_reference(q, k, v, False, 0.3)
    ob, lb = attention_lse_reference(q, k2, v2, False, 0.3)
    oall, _ = attention_lse_reference(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2), False, 0.3)
    torch.testing.assert_close(merge_attention(oa, la, ob, lb), oall, atol=1e-5, rtol=1e-5)


def test_top_p_filter_keeps_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.75))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 1e-6)).sum() == 1  # the top token always survives


# --- hidden states ---------------------------------------------------------------------------------------

PREFIX = [1, 20, 21, 22, 23, 24, 25, 26, 27]
ITEMS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [30]]


_ARCH_MODELS: dict[str, tuple] = {}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("layer", [-1, 1, 0])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_prefix_reuse_equals_no_reuse(arch: str, layer: int, pooling: str) -> None:
    if arch not in _ARCH_MODELS:
        _ARCH_MODELS[arch] = tiny_llama(arch=arch)
    eng = HFEngine.from_model(*_ARCH_MODELS[arch])
    b = Batch(items=ITEMS, prefix=PREFIX)
    ref = eng.hidden_states_torch(b, layer, pooling, prefix_reuse=False)
    got = eng.hidden_states_torch(b, layer, pooling, prefix_reuse=True)
    assert got.shape == (len(ITEMS), eng.hidden_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    # second call reuses the cached prefix KV and still agrees
    assert len(eng._prefix_cache) == 1
    torch.testing.assert_close(eng.hidden_states_torch(b, layer, pooling), ref, atol=1e-5, rtol=1e-4)


def test_prefix_reuse_in_small_chunks_and_cache_bound(eng: HFEngine) -> None:
    b = Batch(items=ITEMS, prefix=PREFIX)
    ref = eng.hidden_states(b)
    old = eng.max_batch_tokens
    eng.max_batch_tokens = 8  # forces several chunks, sorted by length then unsorted
    try:
        torch.testing.assert_close(torch.from_numpy(eng.hidden_states(b)), torch.from_numpy(ref), atol=1e-5, rtol=1e-4)
    finally:
        eng.max_batch_tokens = old
    for i in range(6):
        eng.hidden_states(Batch(items=ITEMS[:1], prefix=PREFIX + [40 + i]))
    assert len(eng._prefix_cache) <= eng._prefix_cache_size


def test_left_right_padding_and_batching_invariance(eng: HFEngine) -> None:
    b = Batch(items=ITEMS, prefix=PREFIX)
    right = eng.hidden_states_torch(b, prefix_reuse=False, padding_side="right")
    left = eng.hidden_states_torch(b, prefix_reuse=False, padding_side="left")
    torch.testing.assert_close(left, right, atol=1e-5, rtol=1e-4)
    one_by_one = torch.cat([eng.hidden_states_torch(Batch(items=[it], prefix=PREFIX), prefix_reuse=False) for it in ITEMS])
    torch.testing.assert_close(one_by_one, right, atol=1e-5, rtol=1e-4)


def test_layers_match_hf_output_hidden_states(tiny) -> None:
    model, tok = tiny
    eng = HFEngine.from_model(model, tok)
    seq = PREFIX + ITEMS[0]
    with torch.no_grad():
        hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    for layer in (0, 1, 2, -1, -3):
        got = eng.hidden_states_torch(Batch(items=[ITEMS[0]], prefix=PREFIX), layer=layer)
        torch.testing.assert_close(got[0], hs[layer][0, -1], atol=1e-5, rtol=1e-4)
    with pytest.raises(UserError, match="layer 7 out of range"):
        eng.hidden_states(Batch(items=[[1, 2]]), layer=7)


def test_text_batch_tokenizes_prefix_and_items_apart(eng: HFEngine) -> None:
    b = Batch(items=["a tree", "some water"], prefix="You see:")
    prefix, items = eng.tokenize_batch(b)
    assert prefix == eng.tokenizer("You see:")["input_ids"]
    ids = Batch(items=items, prefix=prefix)
    np.testing.assert_allclose(eng.hidden_states(b), eng.hidden_states(ids), atol=1e-6)
    assert eng.hidden_states(Batch(items=[])).shape == (0, eng.hidden_size)


# --- generation -------------------------------------------------------------------------------------------

PROMPTS = [[1, 50, 51, 52, 53, 54], [1, 60, 61], [1, 70, 71, 72, 73, 74, 75, 76, 77]]


def test_greedy_is_deterministic_batch_invariant_and_logprobs_match_forward(eng: HFEngine, tiny) -> None:
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    a = eng.generate(Batch(items=PROMPTS), sp)
    b = eng.generate(Batch(items=PROMPTS), sp)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    singles = [eng.generate(Batch(items=[p]), sp)[0] for p in PROMPTS]
    assert [c.token_ids for c in a] == [c.token_ids for c in singles]  # left padding does not change greedy
    for c, p in zip(a, PROMPTS):
        assert c.prompt_token_ids == p and len(c.token_ids) == len(c.logprobs)
        np.testing.assert_allclose(c.logprobs, forward_logprobs(tiny[0], p, c.token_ids), atol=1e-4)
        assert c.text == eng.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason in ("stop", "length")


def test_static_cache_equals_dynamic_cache(tiny) -> None:
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    dyn = HFEngine.from_model(*tiny).generate(Batch(items=PROMPTS), sp)
    sta = HFEngine.from_model(*tiny, kv_cache="static").generate(Batch(items=PROMPTS), sp)
    assert [c.token_ids for c in dyn] == [c.token_ids for c in sta]
    for d, s in zip(dyn, sta):
        np.testing.assert_allclose(d.logprobs, s.logprobs, atol=1e-4)


def test_sampling_n_seed_and_logprobs(eng: HFEngine, tiny) -> None:
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, n=3, seed=7)
    a = eng.generate(Batch(items=PROMPTS[:2]), sp)
    b = eng.generate(Batch(items=PROMPTS[:2]), sp)
    assert len(a) == 6 and [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.prompt_token_ids for c in a] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3  # item-major
    assert len({tuple(c.token_ids) for c in a[:3]}) > 1  # samples differ within a group
    for c in a[:3]:  # logprobs are under the unmodified model, not the tempered/top-p one
        np.testing.assert_allclose(c.logprobs, forward_logprobs(tiny[0], c.prompt_token_ids, c.token_ids), atol=1e-4)
    no_lp = eng.generate(Batch(items=PROMPTS[:1]), SamplingParams(max_new_tokens=3, logprobs=False, seed=1))
    assert no_lp[0].logprobs is None


def test_stop_strings_cut_text_and_end_generation(eng: HFEngine) -> None:
    full = eng.generate(Batch(items=PROMPTS[:1]), SamplingParams(max_new_tokens=12, temperature=0.0))[0]
    assert len(full.text) > 6, full.text
    stop = full.text[3:6]
    cut = eng.generate(Batch(items=PROMPTS[:1]), SamplingParams(max_new_tokens=12, temperature=0.0, stop=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)
    assert stop in eng.tokenizer.decode(cut.token_ids, skip_special_tokens=True)


def test_thinking_budget(eng: HFEngine) -> None:
    tok = eng.tokenizer
    prompt = tok("Question: what next?<think>", add_special_tokens=False)["input_ids"]
    assert prompt[-1] == eng.think_open_id
    for budget in (0, 4):
        c = eng.generate(Batch(items=[prompt]), SamplingParams(max_new_tokens=16, temperature=0.0, thinking_budget=budget))[0]
        close = eng._encode(eng.thinking_close_text, first=False)
        assert c.thinking_tokens == budget
        assert c.token_ids[budget : budget + len(close)] == close  # the thought is closed right at the budget
        assert c.forced_token_indices == list(range(budget, budget + len(close)))
        assert c.token_ids.count(eng.think_close_id) >= 1
        assert c.finish_reason in ("budget", "length")
    # a budget larger than the generation never forces anything
    c = eng.generate(Batch(items=[prompt]), SamplingParams(max_new_tokens=5, temperature=0.0, thinking_budget=100))[0]
    assert c.forced_token_indices == [] and c.finish_reason == "length"
    plain = HFEngine.from_model(*tiny_llama(thinking=False))
    with pytest.raises(EngineCapabilityError, match="<think>"):
        plain.generate(Batch(items=[prompt[:3]]), SamplingParams(max_new_tokens=2, thinking_budget=3))


def test_peft_wrapped_model_generates_and_keeps_training_mode(tiny) -> None:
    peft = pytest.importorskip("peft")
    model, tok = tiny_llama(seed=3)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # make the adapter matter
    lora.train()
    eng = HFEngine.from_model(lora, tok)
    assert eng.capabilities.weight_update
    sp = SamplingParams(max_new_tokens=5, temperature=0.0)
    a = eng.generate(Batch(items=PROMPTS[:2]), sp)
    assert lora.training  # restored
    assert [c.token_ids for c in a] == [c.token_ids for c in eng.generate(Batch(items=PROMPTS[:2]), sp)]
    lora.eval()
    np.testing.assert_allclose(a[0].logprobs, forward_logprobs(lora, PROMPTS[0], a[0].token_ids), atol=1e-4)
    b = Batch(items=ITEMS, prefix=PREFIX)
    torch.testing.assert_close(eng.hidden_states_torch(b), eng.hidden_states_torch(b, prefix_reuse=False), atol=1e-5, rtol=1e-4)


# --- DLPack, specs, options ---------------------------------------------------------------------------------


def test_dlpack_round_trip(eng: HFEngine) -> None:
    jnp = pytest.importorskip("jax.numpy")
    from thinkcraft.llm.dlpack import jax_to_torch, torch_to_jax

    h = eng.hidden_states_torch(Batch(items=ITEMS, prefix=PREFIX))
    x = torch_to_jax(h)
    assert x.shape == tuple(h.shape) and x.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(x), h.numpy())
    back = jax_to_torch(x * 2)
    torch.testing.assert_close(back, h * 2)
    bf = torch_to_jax(h.bfloat16())
    assert bf.dtype == jnp.bfloat16 and jax_to_torch(bf).dtype == torch.bfloat16
    assert torch_to_jax(h.T).shape == (h.shape[1], h.shape[0])  # non-contiguous input


def test_engine_specs_and_options() -> None:
    from thinkcraft.llm import make_engine
    from thinkcraft.llm.clients import OpenAIEngine, SGLangEngine
    from thinkcraft.llm.options import ServingOptions, sglang_server_args, vllm_llm_kwargs, vllm_serve_args

    assert isinstance(make_engine("sglang+http://127.0.0.1:1"), SGLangEngine)
    oa = make_engine("openai+http://127.0.0.1:1/v1", model="m")
    assert isinstance(oa, OpenAIEngine) and not oa.capabilities.hidden_states
    with pytest.raises(EngineCapabilityError):
        oa.hidden_states(Batch(items=["x"]))
    with pytest.raises(UserError, match="expected one of"):
        make_engine("llama:foo")
    with pytest.raises(UserError, match="not found"):
        make_engine("hf:/nonexistent/model")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match="pip install"):
            make_engine("vllm:/some/model")
    o = ServingOptions(speculative_model="/draft", speculative_num_tokens=4, quantization="fp8", memory_fraction=0.5, tensor_parallel=2)
    kw = vllm_llm_kwargs("/m", o)
    assert kw["speculative_config"] == {"method": "eagle3", "model": "/draft", "num_speculative_tokens": 4}
    assert kw["quantization"] == "fp8" and kw["gpu_memory_utilization"] == 0.5 and kw["tensor_parallel_size"] == 2
    assert "--enable-prefix-caching" in vllm_serve_args("/m", o)
    sg = sglang_server_args("/m", o)
    assert sg[sg.index("--speculative-algorithm") + 1] == "EAGLE3" and "--enable-return-hidden-states" in sg
    assert sg[sg.index("--mem-fraction-static") + 1] == "0.5" and sg[sg.index("--tp-size") + 1] == "2"
    with pytest.raises(UserError, match="quantization"):
        ServingOptions(quantization="int3")


def test_eos_ends_each_sequence_on_device_and_host_paths(tiny) -> None:
    eng = HFEngine.from_model(*tiny)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    full = eng.generate(Batch(items=PROMPTS), sp)
    eos = full[0].token_ids[2]
    eng.eos_ids = {eos}  # pretend this token is EOS: row 0 must end right after it
    for params in (sp, SamplingParams(max_new_tokens=8, temperature=0.0, stop=("\x00never",))):  # device / host loop
        got = eng.generate(Batch(items=PROMPTS), params)
        for f, g in zip(full, got):
            n = next((j + 1 for j, x in enumerate(f.token_ids) if x == eos), len(f.token_ids))
            assert g.token_ids == f.token_ids[:n]
            assert g.finish_reason == ("stop" if n < len(f.token_ids) or f.token_ids[n - 1] == eos else "length")
            assert len(g.logprobs) == n
            np.testing.assert_allclose(g.logprobs, f.logprobs[:n], atol=1e-5)


def test_prefix_cache_follows_in_place_weight_updates() -> None:
    model, tok = tiny_llama(seed=5)
    eng = HFEngine.from_model(model, tok)
    b = Batch(items=ITEMS, prefix=PREFIX)
    before = eng.hidden_states_torch(b)
    with torch.no_grad():  # what an optimizer step does: in-place updates
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    after = eng.hidden_states_torch(b)
    assert not torch.allclose(before, after, atol=1e-4)
    torch.testing.assert_close(after, eng.hidden_states_torch(b, prefix_reuse=False), atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="zero-copy DLPack is a same-GPU property (no CUDA here)")
def test_dlpack_zero_copy_on_gpu() -> None:
    jax = pytest.importorskip("jax")
    if jax.devices()[0].platform != "gpu":
        pytest.skip("JAX has no GPU backend here (the tests pin JAX_PLATFORMS=cpu unless it is set)")
    from thinkcraft.llm.dlpack import jax_to_torch, shares_memory, torch_to_jax

    t = torch.randn(64, 32, device="cuda")
    x = torch_to_jax(t)
    assert shares_memory(t, x)
    back = jax_to_torch(x)
    assert back.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("kv_cache", ["dynamic", "static"])
def test_generation_with_reused_prefix_equals_concatenated_prompts(tiny, kv_cache: str) -> None:
    reuse = HFEngine.from_model(*tiny, kv_cache=kv_cache)
    plain = HFEngine.from_model(*tiny, kv_cache=kv_cache, prefix_reuse=False)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, n=2)
    b = Batch(items=ITEMS, prefix=PREFIX)
    got, want = reuse.generate(b, sp), plain.generate(b, sp)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.prompt_token_ids for c in got] == [PREFIX + it for it in ITEMS for _ in range(2)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
        np.testing.assert_allclose(g.logprobs, forward_logprobs(tiny[0], g.prompt_token_ids, g.token_ids), atol=1e-4)
    assert len(reuse._prefix_cache) == 1


def test_failed_conversion_leaves_nothing_behind(tmp_path) -> None:  # noqa: ANN001
    from thinkcraft.llm.models import convert_gguf, resolve_model

    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"not a gguf file")
    target = tmp_path / "cache" / "broken"
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF parser raises
        convert_gguf(bogus, target)
    assert not target.exists() and list((tmp_path / "cache").iterdir()) == []
    folder = tmp_path / "not_a_model"
    folder.mkdir()
    with pytest.raises(UserError, match="no config.json"):
        resolve_model(str(folder))


@pytest.mark.slow  # torch.compile builds C++ kernels on a CPU: ~25 s
def test_compiled_prefill_equals_eager_one_graph_for_all_layers() -> None:
    """compile_prefill (the GPU default for frozen engines) gives the eager hidden states, with and without
    a shared prefix, at several batch shapes, and compiles one graph per path - not one per layer/shape
    (paths: with/without the prefix, x the full layer / the read layer with its MLP on the pooled tokens)."""
    import torch._dynamo.utils as dynamo_utils

    model, tok = tiny_llama(arch="qwen3", num_hidden_layers=4)
    ref = HFEngine.from_model(model, tok, compile_prefill=False)
    eng = HFEngine.from_model(model, tok, compile_prefill=True)
    prefix = "You are a helpful agent reading game states.\n"
    items = ["tree (1,2) stone (3,4)", "water", "cow (0,1) zombie (2,2) x3 inventory wood 2"]
    graphs0 = dynamo_utils.counters["stats"]["unique_graphs"]
    for batch in (items, items[:2], items * 3):
        for kw in ({"prefix": prefix}, {}):
            for layer in (-1, 2):
                a = eng.hidden_states_torch(Batch(batch, **kw), layer=layer)
                b = ref.hidden_states_torch(Batch(batch, **kw), layer=layer)
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    if eng._layer_fn is not None and eng._layer_fn.failed:
        pytest.skip("torch.compile cannot build here (no C++ compiler?); eager fallback checked only")
    assert dynamo_utils.counters["stats"]["unique_graphs"] - graphs0 <= 4


def test_gqa_decode_attention_equals_expanded_sdpa_and_is_used_by_generate(tiny, monkeypatch) -> None:
    """One-token decode attention with folded GQA heads (no repeat_kv copy) equals sdpa over expanded
    heads with the same padding mask, and `generate` goes through it."""
    import thinkcraft.llm.attention as A

    torch.manual_seed(0)
    b, h, hkv, t, d = 3, 8, 2, 11, 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
    mask[0, ..., :4] = False  # left pads of row 0
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(A.gqa_decode_attention(q, k, v, mask, 0.25), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(A.gqa_decode_attention(q, k, v, None, 0.25),
                               torch.nn.functional.scaled_dot_product_attention(
                                   q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), scale=0.25),
                               atol=1e-5, rtol=1e-5)
    calls = []
    real = A.gqa_decode_attention
    monkeypatch.setattr(A, "gqa_decode_attention", lambda *a: calls.append(1) or real(*a))
    HFEngine.from_model(*tiny).generate(Batch(items=["hi", "a longer prompt here"]),
                                        SamplingParams(max_new_tokens=3, temperature=0.0))
    assert calls  # tiny model: 4 query / 2 KV heads


def test_generate_under_autocast_runs_the_residual_stream_in_the_autocast_dtype() -> None:
    """Full fine-tuning keeps fp32 weights and generates under bf16 autocast: inside `generate` the token
    embeddings are cast to bf16 (so RoPE'd keys and values share one dtype - a static cache needs that);
    outside it the model is untouched, and static and dynamic caches give the same tokens."""
    model, tok = tiny_llama(arch="qwen3")
    seen: list[torch.dtype] = []
    model.model.layers[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    outs = {}
    for kv in ("static", "dynamic"):
        eng = HFEngine.from_model(model, tok, kv_cache=kv)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[kv] = [c.token_ids for c in eng.generate(Batch(items=["hi there", "a b c"]), sp)]
    assert seen and set(seen) == {torch.bfloat16}
    assert outs["static"] == outs["dynamic"]
    seen.clear()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert seen == [torch.float32]


# --- forward chunk planning and the SM partition ----------------------------------------------------------


def _brute_force_cost(lengths: list[int], overhead: int, max_tokens: int, max_rows: int) -> float:
    """Cheapest cut of sorted lengths by trying every cut set (small n only)."""
    import itertools

    n, best = len(lengths), float("inf")
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = [0, *cuts, n]
            cost = 0.0
            for a, b in zip(bounds, bounds[1:]):
                rows, padded = b - a, (b - a) * lengths[b - 1]
                if rows > max_rows or (padded > max_tokens and rows > 1):
                    cost = float("inf")
                    break
                cost += padded + overhead
            best = min(best, cost)
    return best


def _plan_cost(lengths: list[int], plan: list[tuple[int, int]], overhead: int) -> float:
    return sum((b - a) * lengths[b - 1] + overhead for a, b in plan)


@pytest.mark.parametrize("seed", range(6))
def test_plan_chunks_is_optimal_within_limits(seed: int) -> None:
    from thinkcraft.llm.batching import plan_chunks

    rng = np.random.default_rng(seed)
    lengths = sorted(rng.integers(1, 40, size=int(rng.integers(1, 10))).tolist())
    overhead, max_tokens, max_rows = int(rng.integers(0, 60)), int(rng.integers(30, 200)), int(rng.integers(1, 6))
    plan = plan_chunks(lengths, overhead, max_tokens, max_rows, quantum=1)
    coarse = plan_chunks(lengths, overhead, max_tokens, max_rows, quantum=8)
    best = _brute_force_cost(lengths, overhead, max_tokens, max_rows)
    assert best <= _plan_cost(lengths, coarse, overhead) <= best + 7 * len(lengths)
    # a partition of range(n), in order
    assert plan[0][0] == 0 and plan[-1][1] == len(lengths)
    assert all(b1 == a2 for (_, b1), (a2, _) in zip(plan, plan[1:])) and all(a < b for a, b in plan)
    for a, b in plan:
        assert b - a <= max_rows
        assert (b - a) * lengths[b - 1] <= max_tokens or b - a == 1
    assert _plan_cost(lengths, plan, overhead) == best


def test_plan_chunks_trades_padding_against_launches() -> None:
    from thinkcraft.llm.batching import plan_chunks

    bimodal = [10] * 64 + [100] * 64
    assert plan_chunks(bimodal, 512, 10**6, 10**6) == [(0, 64), (64, 128)]  # saves 5,760 padded tokens
    assert plan_chunks(bimodal, 10**5, 10**6, 10**6) == [(0, 128)]  # a launch costs more than that
    equal = plan_chunks([5] * 10, 0, 20, 100)  # no padding to save: only the token limit cuts
    assert sum(b - a for a, b in equal) == 10 and all((b - a) * 5 <= 20 for a, b in equal)
    assert plan_chunks([50], 0, 20, 100) == [(0, 1)]  # a lone over-long row still runs
    assert plan_chunks([], 0, 10, 10) == []
    with pytest.raises(ValueError):
        plan_chunks([3, 1], 0, 10, 10)


def test_sm_limit_needs_cuda_and_a_valid_count(eng: HFEngine) -> None:
    assert eng.sm_limit is None
    assert eng.set_sm_limit(None) is None  # no-op without a limit
    if eng.device.type != "cuda":
        with pytest.raises(UserError, match="CUDA"):
            eng.set_sm_limit(8)
        assert eng.sm_limit is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="green contexts need a CUDA GPU (none here)")
def test_sm_limit_gives_the_same_hidden_states_on_gpu() -> None:
    model, tok = tiny_llama()
    e = HFEngine.from_model(model.to("cuda"), tok)
    b = Batch(items=ITEMS, prefix=PREFIX)
    ref = e.hidden_states_torch(b)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(UserError, match="out of range"):
        e.set_sm_limit(total)
    e.set_sm_limit(total // 2)
    torch.testing.assert_close(e.hidden_states_torch(b), ref, atol=1e-4, rtol=1e-3)
    assert e.set_sm_limit(None) == total // 2


def test_fp8_linear_is_close_to_the_linear_and_the_engine_quantises_decoder_linears() -> None:
    from thinkcraft.llm.quant import FP8Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=True)
    x = torch.randn(3, 5, 64)
    ref = lin(x)
    y = FP8Linear(lin)(x)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert ((y - ref).norm() / ref.norm()).item() < 0.08  # e4m3: 3 mantissa bits, per-row/column scales

    model, tok = tiny_llama()
    plain = HFEngine.from_model(model, tok)
    b = Batch(items=ITEMS, prefix=PREFIX)
    ref_h = plain.hidden_states_torch(b)
    model2, _ = tiny_llama()
    model2.requires_grad_(False)
    q = HFEngine.from_model(model2, tok, quantize="fp8")
    n_fp8 = sum(isinstance(m, FP8Linear) for m in q._dec.layers.modules())
    assert n_fp8 == 7 * q.num_layers  # q, k, v, o, gate, up, down
    h = q.hidden_states_torch(b)
    cos = torch.nn.functional.cosine_similarity(h, ref_h, dim=-1)
    assert cos.min().item() > 0.98
    # a model being trained cannot be quantised; unknown modes are refused
    with pytest.raises(UserError, match="frozen"):
        HFEngine.from_model(*tiny_llama(), quantize="fp8")
    with pytest.raises(UserError, match="quantize"):
        HFEngine.from_model(*tiny_llama(), quantize="int3")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pooled_read_runs_the_read_layers_mlp_on_the_pooled_tokens_only(arch: str) -> None:
    """pooling="last": the layer read runs its MLP on each row's last token alone (attention still on all
    tokens), and the result equals HF's own full forward (the left-padded path) at the last and a middle
    layer, with and without the shared prefix."""
    from thinkcraft.llm.hf import splits_at_mlp

    if arch not in _ARCH_MODELS:
        _ARCH_MODELS[arch] = tiny_llama(arch=arch)
    model, tok = _ARCH_MODELS[arch]
    eng = HFEngine.from_model(model, tok)
    layers = eng._dec.layers
    assert all(splits_at_mlp(layer) for layer in layers)
    for layer, read in ((-1, len(layers) - 1), (2, 1)):
        shapes: list[tuple] = []
        hook = layers[read].mlp.register_forward_hook(lambda _m, i, _o: shapes.append(tuple(i[0].shape)))
        try:
            for reuse in (True, False):
                b = Batch(items=ITEMS, prefix=PREFIX)
                got = eng.hidden_states_torch(b, layer, "last", prefix_reuse=reuse)
                ref = eng.hidden_states_torch(b, layer, "last", prefix_reuse=False, padding_side="left")
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
        finally:
            hook.remove()
        # two pooled calls: (rows, H); the left-padded HF reference: (rows, T, H)
        assert [s for s in shapes if len(s) == 2] == [(len(ITEMS), eng.hidden_size)] * 2, shapes
    extra = torch.nn.Module()
    for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp", "post_feedforward_layernorm"):
        extra.add_module(name, torch.nn.Identity())
    assert not splits_at_mlp(extra)  # e.g. Gemma's extra norms: the full layer runs


def test_decode_graphs_setting(monkeypatch) -> None:
    from thinkcraft.llm.hf.cache import decode_graphs

    monkeypatch.delenv("THINKCRAFT_DECODE_GRAPHS", raising=False)
    assert decode_graphs() == "manual"  # measured faster than the graph trees (H100, 2026-11-27)
    monkeypatch.setenv("THINKCRAFT_DECODE_GRAPHS", " Trees ")
    assert decode_graphs() == "trees"
    monkeypatch.setenv("THINKCRAFT_DECODE_GRAPHS", "fast")
    with pytest.raises(UserError, match="trees.*manual"):
        decode_graphs()


def test_decode_dynamic_setting_and_the_bench_column(monkeypatch) -> None:
    """THINKCRAFT_DECODE_DYNAMIC: the manual step's compile is width-specialised unless 1 (automatic dynamic),
    and for the "dynamic" width automatic unless 0; the benches' `decode_graphs` column tells the two apart, so
    their rows never merge."""
    import sys
    from pathlib import Path

    from thinkcraft.llm.hf.cache import decode_dynamic

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from common import decode_graphs_column

    monkeypatch.delenv("THINKCRAFT_DECODE_GRAPHS", raising=False)
    monkeypatch.delenv("THINKCRAFT_DECODE_DYNAMIC", raising=False)
    assert decode_dynamic() is False and decode_graphs_column() == "manual"
    assert decode_dynamic("dynamic") is None and decode_graphs_column("dynamic") == "manual-dynamic"
    monkeypatch.setenv("THINKCRAFT_DECODE_DYNAMIC", "1")
    assert decode_dynamic() is None and decode_graphs_column() == "manual-dynamic"
    monkeypatch.setenv("THINKCRAFT_DECODE_DYNAMIC", "0")
    assert decode_dynamic("dynamic") is False and decode_graphs_column("dynamic") == "manual"
    monkeypatch.setenv("THINKCRAFT_DECODE_DYNAMIC", "yes")
    with pytest.raises(UserError, match="0 or 1"):
        decode_dynamic()


def test_decode_autotune_setting(monkeypatch) -> None:
    """THINKCRAFT_DECODE_AUTOTUNE: off by default (no options: torch.compile's defaults), on it asks inductor to
    tune the step's GEMMs against cuBLAS; anything but 0 / 1 is refused before a compile."""
    from thinkcraft.llm.hf.cache import decode_autotune

    monkeypatch.delenv("THINKCRAFT_DECODE_AUTOTUNE", raising=False)
    assert decode_autotune() is None
    monkeypatch.setenv("THINKCRAFT_DECODE_AUTOTUNE", "1")
    opts = decode_autotune()
    assert opts["max_autotune_gemm"] is True and "ATEN" in opts["max_autotune_gemm_backends"]
    from torch._inductor import config as inductor_config

    assert all(hasattr(inductor_config, k) for k in opts)  # options torch.compile accepts
    monkeypatch.setenv("THINKCRAFT_DECODE_AUTOTUNE", "max")
    with pytest.raises(UserError, match="0 or 1"):
        decode_autotune()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a hand-captured CUDA graph needs a GPU (none here)")
def test_manual_decode_graph_equals_eager_and_recaptures_when_weights_move(monkeypatch) -> None:
    """THINKCRAFT_DECODE_GRAPHS=manual: greedy tokens and log-probs equal the eager step's, with and without the
    shared prefix; a parameter whose storage moved (a learner that reassigns it) is seen: the graph is captured
    again rather than replayed over the old address."""
    from thinkcraft.llm import compat

    model, tok = tiny_llama()
    model = model.to("cuda")
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, n=2)
    eager = HFEngine.from_model(model, tok, kv_cache="static", compile_decode=False)
    monkeypatch.setenv("THINKCRAFT_DECODE_GRAPHS", "manual")
    graphed = HFEngine.from_model(model, tok, kv_cache="static", compile_decode=True)
    for batch in (Batch(items=ITEMS, prefix=PREFIX), Batch(items=[PREFIX + it for it in ITEMS])):
        want, got = eager.generate(batch, sp), graphed.generate(batch, sp)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=2e-3)
    counters = graphed._batcher.counters  # every capture counted and timed (engine/graph_captures, graph_capture_s)
    captures = counters["graph_captures"]
    assert captures >= 2 and counters["graph_capture_s"] > 0  # with and without the shared prefix
    lm_head = compat.lm_head(model)
    with torch.no_grad():  # a new tensor at another address, scaled: the tokens change if it is read
        lm_head.weight = torch.nn.Parameter(lm_head.weight.detach() * 3.0)
    batch = Batch(items=ITEMS, prefix=PREFIX)
    want, got = eager.generate(batch, sp), graphed.generate(batch, sp)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert graphed._batcher.counters["graph_captures"] > captures  # the moved weight: captured again


def test_manual_decode_graph_logic_on_cpu(monkeypatch) -> None:
    """The hand-captured step's bookkeeping without a GPU: a stand-in "graph" whose replay re-runs the
    captured call on the captured buffers. Tokens equal the eager step's (so the per-step inputs reach the
    buffers the graph reads), one capture per (prefix, width, autocast) key, and a new capture when a parameter
    moves to another address."""
    import thinkcraft.llm.hf.cache as C
    from thinkcraft.llm import compat

    captures = []

    def fake_capture(run, device):
        out = run()
        captures.append(device)
        return (lambda: out.copy_(run())), out

    monkeypatch.setattr(C, "_graph_capture", fake_capture)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(C.CacheMixin, "_compiled_step", C.CacheMixin._manual_graph_step)
    model, tok = tiny_llama()
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, n=2)
    eager = HFEngine.from_model(model, tok, kv_cache="static", compile_decode=False)
    graphed = HFEngine.from_model(model, tok, kv_cache="static", compile_decode=True)
    batch = Batch(items=ITEMS, prefix=PREFIX)
    want, got = eager.generate(batch, sp), graphed.generate(batch, sp)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
    n = len(captures)
    assert n >= 1
    graphed.generate(batch, sp)  # same cache, same addresses: replayed, not captured again
    assert len(captures) == n
    lm_head = compat.lm_head(model)
    with torch.no_grad():
        lm_head.weight = torch.nn.Parameter(lm_head.weight.detach() * 3.0)
    want, got = eager.generate(batch, sp), graphed.generate(batch, sp)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert len(captures) > n  # the moved parameter was seen


@pytest.mark.parametrize("layer", [-1, 1])
def test_hidden_graph_padding_buckets_equal_the_unpadded_rows(layer: int) -> None:
    """The graphed hidden states (hidden_graphs.py): rows padded to a multiple of 8 and tokens to a multiple of
    32, each padded row reading one token - the first B rows of a replay are the unpadded rows' last-token
    states (right padding is exact under causal attention). One capture per bucket, reused by every batch of
    that bucket whatever its rows; a failing capture gives None (the caller's compiled path) for good."""
    from thinkcraft.llm.hf.hidden_graphs import MAX_GRAPHS, HiddenGraphs

    if "llama" not in _ARCH_MODELS:
        _ARCH_MODELS["llama"] = tiny_llama(arch="llama")
    eng = HFEngine.from_model(*_ARCH_MODELS["llama"])
    kv = eng._prefix_kv(PREFIX)
    idx = eng._layer_index(layer)
    graphs = HiddenGraphs(eng._layers_pooled, eng.device, eng.pad_id, capture=replay_capture, gate=NoGate())
    rng = np.random.default_rng(0)
    batches = [[list(rng.integers(5, 60, size=n)) for n in lens]
               for lens in ([3, 9, 5], [7, 2, 8], [31, 1, 12, 6, 6, 6, 6, 6, 6], [33])]
    with torch.no_grad():
        for items in batches:
            want = eng._pooled_cascade(items, len(PREFIX), kv, idx, "last")
            got = graphs.run(items, len(PREFIX), kv, idx)
            assert got is not None and got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # buckets (8 x 32) x2, (16 x 32), (8 x 64): the second batch replayed the first one's graph
    assert (graphs.captures, graphs.replays, len(graphs.graphs)) == (3, 4, 3) and MAX_GRAPHS >= 3

    def broken(run, device, pool=None):  # noqa: ANN001, ANN202
        raise RuntimeError("capture failed")

    bad = HiddenGraphs(eng._layers_pooled, eng.device, eng.pad_id, capture=broken, gate=NoGate())
    assert bad.run(batches[0], len(PREFIX), kv, idx) is None and bad.failed
    assert bad.run(batches[0], len(PREFIX), kv, idx) is None  # stays off


def test_hidden_graphs_switch_and_where_they_serve(monkeypatch) -> None:
    """THINKCRAFT_HIDDEN_GRAPHS: 0/1 only; on the CPU (and for a model being trained) the engine keeps its
    compiled path whatever it says."""
    from thinkcraft.llm.hf.hidden_graphs import hidden_graphs_on

    if "llama" not in _ARCH_MODELS:
        _ARCH_MODELS["llama"] = tiny_llama(arch="llama")
    eng = HFEngine.from_model(*_ARCH_MODELS["llama"])
    monkeypatch.setenv("THINKCRAFT_HIDDEN_GRAPHS", "1")
    assert hidden_graphs_on() and eng._hidden_graphs() is None  # CPU
    monkeypatch.setenv("THINKCRAFT_HIDDEN_GRAPHS", "on")
    with pytest.raises(UserError, match="THINKCRAFT_HIDDEN_GRAPHS must be 0 or 1"):
        hidden_graphs_on()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (none here)")
def test_hidden_graphs_on_gpu_equal_the_compiled_layers(monkeypatch) -> None:
    """On CUDA, a frozen bf16 engine's hidden states replayed from graphs equal its compiled layers' (two
    batches of one bucket: one capture, two replays)."""
    model, tok = tiny_llama(arch="qwen3")
    model = model.to("cuda", torch.bfloat16).eval().requires_grad_(False)
    eng = HFEngine.from_model(model, tok)  # frozen (no parameter requires grad): a feature engine
    items = [[int(x) for x in np.random.default_rng(k).integers(5, 60, size=n)] for k, n in enumerate([5, 17, 9])]
    b = Batch(items=items, prefix=PREFIX)
    monkeypatch.setenv("THINKCRAFT_HIDDEN_GRAPHS", "0")
    want = eng.hidden_states_torch(b)
    monkeypatch.setenv("THINKCRAFT_HIDDEN_GRAPHS", "1")
    for _ in range(2):
        torch.testing.assert_close(eng.hidden_states_torch(b), want, atol=2e-2, rtol=2e-2)
    g = eng._graphs
    assert g is not None and not g.failed and (g.captures, g.replays) == (1, 2)
