"""Every entry of `thinkcraft.llm.compat` (the engine's reaches into transformers/torch internals), checked
on tiny random models: when an upgrade changes one, its test fails with a message naming the entry, what
changed and the versions it was checked against (`compat.broken`)."""

from __future__ import annotations

import inspect

import pytest
import torch

from thinkcraft.llm import compat
from thinkcraft.llm.attention import attention_lse_reference
from thinkcraft.llm.batching import take_rows
from thinkcraft.llm.testing import tiny_llama
from thinkcraft.utils.errors import UserError

ARCHS = ["llama", "qwen3"]
_MODELS: dict[str, tuple] = {}


def _model(arch: str) -> tuple:
    if arch not in _MODELS:
        _MODELS[arch] = tiny_llama(arch=arch, num_hidden_layers=3)
    return _MODELS[arch]


def _ids(b: int = 2, t: int = 7) -> torch.Tensor:
    return torch.arange(5, 5 + b * t).reshape(b, t)


# --- transformers: structure, cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_of_and_text_config(arch: str) -> None:
    model, _ = _model(arch)
    dec = compat.decoder_of(model)
    assert dec is model.model, compat.broken("decoder_of", "get_decoder() no longer returns the `.model` stack")
    assert int(compat.text_config(model).num_hidden_layers) == len(dec.layers) == 3, \
        compat.broken("text_config", "the text config's num_hidden_layers disagrees with the decoder's layers")
    with pytest.raises(UserError, match="embed_tokens"):
        compat.decoder_of(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_kwarg_is_a_forward_parameter_of_the_decoder_and_the_lm(arch: str) -> None:
    """The engine passes the cache under this name to the decoder (prefix KV) and to the LM (decode)."""
    from transformers import DynamicCache

    model, _ = _model(arch)
    dec = compat.decoder_of(model)
    name = compat.cache_kwarg(dec)
    for fn in (type(dec).forward, type(model).forward):
        assert name in inspect.signature(fn).parameters, \
            compat.broken("cache_kwarg", f"{fn.__qualname__} takes no `{name}` argument")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        dec(input_ids=_ids(1), use_cache=True, **{name: cache})
    assert cache.get_seq_length() == 7, compat.broken("cache_kwarg", f"the cache passed as `{name}` was not filled")


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_kv_reads_the_keys_and_values_a_forward_stored(arch: str) -> None:
    """cache_kv's (k, v) put back into a fresh cache continue the sequence exactly like HF's full forward."""
    from transformers import DynamicCache

    model, _ = _model(arch)
    dec = compat.decoder_of(model)
    name = compat.cache_kwarg(dec)
    ids = _ids(1, 12)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        dec(input_ids=ids[:, :8], use_cache=True, **{name: cache})
        kv = compat.cache_kv(cache)
        assert len(kv) == 3 and kv[0][0].shape == (1, 2, 8, 16), \
            compat.broken("cache_kv", f"expected 3 layers of (1, Hkv=2, 8, d=16) keys, got {[k.shape for k, _ in kv]}")
        again = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(kv):
            again.update(k, v, i)
        tail = model(input_ids=ids[:, 8:], position_ids=torch.arange(8, 12)[None], use_cache=True, **{name: again}).logits
        full = model(input_ids=ids).logits[:, 8:]
    torch.testing.assert_close(tail, full, atol=1e-5, rtol=1e-4,
                               msg=lambda m: compat.broken("cache_kv", f"the extracted KV is not the prefix's KV: {m}"))


# --- transformers: the attention function -------------------------------------------------------------------


def _counting_attention(calls: list) -> object:
    def fn(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN003, ANN202
        calls.append(kwargs.pop(compat.PREFIX_KV_KWARG, None))
        return compat.sdpa_attention(module, query, key, value, attention_mask, **kwargs)

    return fn


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_implementation_routes_every_layer_through_the_registered_function(arch: str) -> None:
    model, _ = _model(arch)
    dec = compat.decoder_of(model)
    calls: list = []
    name = compat.register_attention(f"thinkcraft_test_count_{arch}", _counting_attention(calls))
    with torch.no_grad():
        ref = model(input_ids=_ids()).logits
        with compat.attention_implementation(compat.attention_configs(dec), name):
            got = model(input_ids=_ids()).logits
    assert len(calls) == 3, compat.broken(
        "attention_implementation", f"the function registered as {name!r} ran {len(calls)} times for 3 layers "
        "(transformers no longer reads config._attn_implementation_internal per call?)")
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    assert model.config._attn_implementation == "sdpa", compat.broken("attention_implementation", "not restored")
    with torch.no_grad():
        model(input_ids=_ids())
    assert len(calls) == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_registered_function_gets_sdpas_mask_for_padded_rows(arch: str) -> None:
    """A left-padded batch under a registered name: the mask transformers builds for it is sdpa's, so the
    real rows' logits equal the unpadded forward."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    model, _ = _model(arch)
    name = compat.register_attention(f"thinkcraft_test_mask_{arch}", _counting_attention([]))
    assert name in ALL_MASK_ATTENTION_FUNCTIONS, compat.broken("register_attention", "no mask function registered")
    ids = torch.tensor([[2, 2, 7, 8, 9], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), compat.attention_implementation(compat.attention_configs(compat.decoder_of(model)), name):
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[0, 2:]
    with torch.no_grad():
        want = model(input_ids=ids[:1, 2:]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4,
                               msg=lambda m: compat.broken("register_attention", f"padded rows differ: {m}"))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_kv_kwarg_reaches_the_attention_function(arch: str) -> None:
    """call_layer's prefix (k, v) travels layer -> self_attn -> attention function as PREFIX_KV_KWARG."""
    model, _ = _model(arch)
    dec = compat.decoder_of(model)
    calls: list = []
    name = compat.register_attention(f"thinkcraft_test_kwarg_{arch}", _counting_attention(calls))
    h = dec.embed_tokens(_ids())
    pos = torch.arange(7)[None].expand(2, 7)
    sentinel = ("prefix-k", "prefix-v")
    with torch.no_grad(), compat.attention_implementation(compat.attention_configs(dec), name):
        compat.call_layer(dec.layers[0], h, pos, compat.rotary(dec, h, pos), sentinel)
        compat.call_layer(dec.layers[0], h, pos, compat.rotary(dec, h, pos), sentinel, torch.tensor([6, 3]))
    assert calls == [sentinel, sentinel], compat.broken(
        "PREFIX_KV_KWARG", f"the attention function received {calls!r} instead of the layer's extra kwarg "
        "(decoder layers no longer forward **kwargs to the attention function?)")


def test_sdpa_attention_is_causal_gqa_attention() -> None:
    model, _ = _model("llama")
    attn = compat.decoder_of(model).layers[0].self_attn
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    out, _ = compat.sdpa_attention(attn, q, k, v, None, scaling=0.25)
    want, _ = attention_lse_reference(q, k, v, True, 0.25)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-5, rtol=1e-4,
                               msg=lambda m: compat.broken("sdpa_attention", f"no longer (B, S, H, d) causal attention: {m}"))


# --- transformers: the re-implemented decoder layer ---------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_call_layer_equals_hfs_layers_and_the_mlp_split_equals_the_full_layer(arch: str) -> None:
    """Layer by layer (embeddings, `rotary`, `call_layer`) = HF's own forward at every layer; with `last`
    the split layer (MLP on the kept tokens only) = the full layer read at those tokens."""
    model, _ = _model(arch)
    dec = compat.decoder_of(model)
    ids = _ids()
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    last = torch.tensor([6, 3])
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        h = dec.embed_tokens(ids)
        pe = compat.rotary(dec, h, pos)
        for i, layer in enumerate(dec.layers):
            assert compat.splits_at_mlp(layer), compat.broken(
                "splits_at_mlp", f"{type(layer).__name__}'s sub-modules are now {[n for n, _ in layer.named_children()]}")
            split = compat.call_layer(layer, h, pos, pe, None, last)
            h = compat.call_layer(layer, h, pos, pe, None)
            want = hs[i + 1] if i + 1 < len(dec.layers) else None  # HF's last entry is after the final norm
            if want is not None:
                torch.testing.assert_close(h, want, atol=1e-5, rtol=1e-4, msg=lambda m: compat.broken(
                    "call_layer", f"layer {i} run alone differs from HF's forward: {m}"))
            torch.testing.assert_close(split, take_rows(h, last), atol=1e-5, rtol=1e-4, msg=lambda m: compat.broken(
                "call_layer", f"the MLP-on-kept-tokens split of layer {i} no longer equals the layer "
                f"(HF changed the decoder layer's residual/norm structure?): {m}"))
        torch.testing.assert_close(dec.norm(h), hs[-1], atol=1e-5, rtol=1e-4)


# --- torch: private attributes and ops ---------------------------------------------------------------------


def test_weights_version_tracks_in_place_updates() -> None:
    p = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    v0 = compat.weights_version(p)
    assert compat.weights_version(p) == v0
    with torch.no_grad():
        p[1].add_(1.0)
    assert compat.weights_version(p) > v0, compat.broken("weights_version", "Tensor._version did not move on add_")


def test_cpu_flash_attention_lse_equals_the_reference_with_gqa() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    for causal in (False, True):
        o, lse = compat.cpu_flash_attention_lse(q, k, v, causal, 0.3)
        o2, lse2 = attention_lse_reference(q, k, v, causal, 0.3)
        torch.testing.assert_close(o, o2, atol=1e-5, rtol=1e-5, msg=lambda m: compat.broken("cpu_flash_attention_lse", m))
        torch.testing.assert_close(lse, lse2, atol=1e-5, rtol=1e-5, msg=lambda m: compat.broken("cpu_flash_attention_lse", m))


def _args(op: object) -> list[str]:
    return [a.name for a in op.default._schema.arguments]  # type: ignore[attr-defined]


@pytest.mark.parametrize("entry,op,head", [
    ("flash_attention_lse", "_scaled_dot_product_flash_attention",
     ["query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"]),
    ("efficient_attention_lse", "_scaled_dot_product_efficient_attention",
     ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "scale"]),
    ("cpu_flash_attention_lse", "_scaled_dot_product_flash_attention_for_cpu",
     ["query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"]),
    ("flash_varlen", "_flash_attention_forward",
     ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
      "return_debug_mask", "scale"]),
    ("scaled_mm", "_scaled_mm", ["self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype"]),
])
def test_private_op_signatures(entry: str, op: str, head: list[str]) -> None:
    """The CUDA-only ops can't run here, but their schemas are in every build: the arguments compat passes
    (positionally, then by name) are still where it passes them."""
    args = _args(getattr(torch.ops.aten, op))
    assert args[: len(head)] == head, compat.broken(entry, f"aten::{op} now takes {args}")


def test_flash_decode_keyword_is_in_the_varlen_op() -> None:
    """`compat.flash_decode` passes the varlen op's arguments as `flash_varlen` does, plus `seqused_k` by name."""
    args = _args(torch.ops.aten._flash_attention_forward)
    assert "seqused_k" in args, compat.broken("flash_decode", f"aten::_flash_attention_forward now takes {args}")


def test_scaled_mm_applies_row_and_column_scales() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(4, 32), torch.randn(16, 32)
    sa = a.abs().amax(1, keepdim=True) / 448
    sb = b.abs().amax(1, keepdim=True).t() / 448
    aq, bq = (a / sa).to(torch.float8_e4m3fn), (b / sb.t()).to(torch.float8_e4m3fn)
    got = compat.scaled_mm(aq, bq.t(), sa, sb, torch.float32)
    want = (aq.float() * sa) @ (bq.float() * sb.t()).t()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: compat.broken("scaled_mm", m))


def test_green_context_api() -> None:
    try:
        from torch.cuda import green_contexts
    except ImportError:
        pytest.fail(compat.broken("green_context", "torch.cuda.green_contexts is gone"))
    params = inspect.signature(green_contexts.GreenContext.create).parameters
    assert {"num_sms", "device_id"} <= set(params), compat.broken("green_context", f"create() takes {list(params)}")
    assert callable(getattr(green_contexts.GreenContext, "Stream", None)), compat.broken("green_context", "no .Stream()")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA attention ops and green contexts need a GPU (none here)")
def test_cuda_entries_run_and_agree_with_the_reference() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 8, 9, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 9, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    want, lse_want = attention_lse_reference(q, k, v, True, 0.125)
    for entry, fn in (("flash_attention_lse", compat.flash_attention_lse),
                      ("efficient_attention_lse", compat.efficient_attention_lse)):
        kk, vv = (k, v) if entry == "flash_attention_lse" else (k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))
        o, lse = fn(q, kk, vv, True, 0.125)
        torch.testing.assert_close(o.float(), want.float(), atol=2e-2, rtol=2e-2, msg=lambda m: compat.broken(entry, m))
        torch.testing.assert_close(lse, lse_want, atol=2e-2, rtol=2e-2, msg=lambda m: compat.broken(entry, m))
    cu = torch.tensor([0, 9, 18], device="cuda", dtype=torch.int32)
    out = compat.flash_varlen(q.transpose(1, 2).reshape(18, 8, 64), k.transpose(1, 2).reshape(18, 2, 64),
                              v.transpose(1, 2).reshape(18, 2, 64), cu, cu, 9, 9, 0.125)
    torch.testing.assert_close(out.float(), want.transpose(1, 2).reshape(18, 8, 64).float(), atol=2e-2, rtol=2e-2,
                               msg=lambda m: compat.broken("flash_varlen", m))
    total = torch.cuda.get_device_properties(0).multi_processor_count
    ctx, stream = compat.green_context(total // 2, 0)
    with torch.cuda.stream(stream):
        x = torch.ones(1024, device="cuda").sum()
    stream.synchronize()
    assert x.item() == 1024


@pytest.mark.parametrize("arch", ARCHS)
def test_lm_head_and_norm_after_the_layers_give_the_models_logits(arch: str) -> None:
    """The continuous-batching decode runs the layers itself, then the final norm and `lm_head`: that must be
    the model's own logits."""
    model, _ = _model(arch)
    dec = compat.decoder_of(model)
    ids = _ids(1)
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        h = dec.embed_tokens(ids)
        pe = compat.rotary(dec, h, pos)
        for layer in dec.layers:
            h = compat.call_layer(layer, h, pos, pe, None)
        got = compat.lm_head(model)(dec.norm(h))
        want = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                               msg=compat.broken("lm_head", "norm + get_output_embeddings() != the model's logits"))
    with pytest.raises(UserError, match="lm_head"):
        compat.lm_head(torch.nn.Linear(2, 2))


def test_mark_static_address_tags_the_tensor_for_dynamo() -> None:
    """torch 2.13 records the tag as `_dynamo_static_input_type` on the tensor (what dynamo reads to keep the
    buffer's address in a CUDA graph instead of copying it)."""
    t = torch.zeros(4, 3)
    compat.mark_static_address(t)
    assert getattr(t, "_dynamo_static_input_type", None) is not None, \
        compat.broken("mark_static_address", "torch._dynamo no longer tags the tensor (_dynamo_static_input_type)")


# --- the learner: LM head from hidden states, packed (varlen) forwards -------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_lm_head_on_the_decoders_hidden_states_gives_the_models_logits(arch: str) -> None:
    """The learner runs the decoder (`last_hidden_state`, final norm applied) and then the head's weight itself,
    in chunks: that must be the causal LM's logits."""
    model, _ = _model(arch)
    weight, bias = compat.plain_lm_head(model)
    ids = _ids(2)
    with torch.no_grad():
        h = compat.decoder_of(model)(input_ids=ids, use_cache=False).last_hidden_state
        got = torch.nn.functional.linear(h, weight, bias)
        want = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: compat.broken(
        "plain_lm_head", f"head(decoder(...).last_hidden_state) != the model's logits: {m}"))


def test_plain_lm_head_refuses_logit_postprocessing_and_adapted_heads() -> None:
    import copy

    model, _ = _model("llama")
    capped = copy.deepcopy(model)
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(UserError, match="final_logit_softcapping"):
        compat.plain_lm_head(capped)

    class Adapted(torch.nn.Linear):
        pass

    adapted = copy.deepcopy(model)
    adapted.lm_head = Adapted(4, 4)
    with pytest.raises(UserError, match="Adapted"):
        compat.plain_lm_head(adapted)


@pytest.mark.parametrize("arch", ARCHS)
def test_maskless_attention_gets_the_varlen_kwargs_and_no_mask(arch: str) -> None:
    """A function registered by `register_maskless_attention` is called with attention_mask None (transformers
    built no mask for a packed row) and the boundaries of `varlen_kwargs`, in every layer; attending within
    them, a packed row gives each sequence's own logits."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    model, _ = _model(arch)
    dec = compat.decoder_of(model)
    seen: list = []

    def fn(module, query, key, value, attention_mask, scaling=None, **kwargs):  # noqa: ANN001, ANN003, ANN202
        cu, _, max_len, _ = compat.varlen_from_kwargs(kwargs)
        seen.append((attention_mask, cu.tolist(), max_len))
        outs = [torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=True)
            for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:])]
        return torch.cat(outs, 2).transpose(1, 2), None

    name = compat.register_maskless_attention(f"thinkcraft_test_varlen_{arch}", fn)
    assert name not in ALL_MASK_ATTENTION_FUNCTIONS, compat.broken("register_maskless_attention", "a mask is registered")
    a, b = _ids(1, 4), _ids(1, 6) + 20
    ids = torch.cat([a, b], 1)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with torch.no_grad(), compat.attention_implementation(compat.attention_configs(dec), name):
        h = dec(input_ids=ids, position_ids=pos, use_cache=False, **compat.varlen_kwargs(cu, 6)).last_hidden_state
    assert seen == [(None, [0, 4, 10], 6)] * 3, compat.broken(
        "register_maskless_attention", f"the attention function saw {seen[:1]} (a mask was built, or the "
        "FlashAttentionKwargs no longer reach it)")
    with torch.no_grad():
        want = torch.cat([dec(input_ids=a).last_hidden_state, dec(input_ids=b).last_hidden_state], 1)
    torch.testing.assert_close(h, want, atol=1e-5, rtol=1e-5, msg=lambda m: compat.broken("varlen_kwargs", m))


def _old_get_obj(local, attr: str):
    """torch 2.11's cudagraph_trees.get_obj (the GPU image): a thread without the state fails a bare assert."""
    if hasattr(local, attr):
        return getattr(local, attr)
    assert torch._C._is_key_in_tls(attr)
    return torch._C._get_obj_in_tls(attr)


def test_cudagraph_thread_state_lets_a_new_thread_reach_its_tree_manager() -> None:
    """The async pools step engines from their own threads; without the thread's state, torch 2.11's CUDA graph
    trees fail there (a bare AssertionError) and the compiled decode step fell back to eager."""
    import threading

    from torch._inductor import cudagraph_trees as trees

    got: dict[str, object] = {}

    def plain() -> None:  # the failure the entry exists for, reproduced with the old lookup
        try:
            _old_get_obj(trees.local, "tree_manager_containers")
            got["plain"] = "ok"
        except AssertionError:
            got["plain"] = "assert"

    def ensured() -> None:
        compat.ensure_cudagraph_thread_state()
        compat.ensure_cudagraph_thread_state()  # idempotent
        got["ensured"] = _old_get_obj(trees.local, "tree_manager_containers")
        got["locks"] = _old_get_obj(trees.local, "tree_manager_locks")

    for fn in (plain, ensured):
        t = threading.Thread(target=fn)
        t.start()
        t.join()
    assert got["plain"] == "assert"
    assert isinstance(got["ensured"], dict) and got["ensured"] is not _old_get_obj(trees.local, "tree_manager_containers")
    assert "locks" in got


# --- transformers: a fast tokenizer's Rust backend ------------------------------------------------------------

TEXTS = ["<|im_start|>system\nYou play Craftax.<|im_end|>\n<|im_start|>user\ntree (-1,0) x7\n", "  two  spaces\n\n",
         "", "héllo → wörld 🙂", "Action: 5<|im_end|>\n<|im_start|>assistant\n", "<think>left</think> noop"]


def _tokenizers() -> list:
    from thinkcraft.llm.testing import bundled_tokenizer
    from thinkcraft.train.llm_policy.model import train_bpe_tokenizer

    corpus = [t * 3 for t in TEXTS] * 5
    return [bundled_tokenizer(), bundled_tokenizer(thinking=True), train_bpe_tokenizer(corpus, vocab_size=400),
            train_bpe_tokenizer(corpus, vocab_size=400, thinking=True)]


@pytest.mark.parametrize("k", range(4), ids=["bundled", "bundled-thinking", "bpe-chatml", "bpe-thinking"])
def test_rust_encoder_and_decoder_give_the_tokenizers_own_ids_and_texts(k: int) -> None:
    tok = _tokenizers()[k]
    enc, dec = compat.rust_encoder(tok), compat.rust_decoder(tok)
    assert enc is not None and dec is not None, \
        compat.broken("rust_encoder", "a plain fast tokenizer is not recognised")
    want = tok(TEXTS, add_special_tokens=False)["input_ids"]
    assert [e.ids for e in enc.encode_batch_fast(TEXTS, add_special_tokens=False)] == want, \
        compat.broken("rust_encoder", "encode_batch_fast gives other ids than the tokenizer's call")
    for skip in (False, True):
        each = [tok.decode(x, skip_special_tokens=skip) for x in want]
        assert dec.decode_batch(want, skip_special_tokens=skip) == each, \
            compat.broken("rust_decoder", "decode_batch gives other texts than the tokenizer's decode")


def test_rust_encoder_and_decoder_refuse_what_the_tokenizers_call_would_change() -> None:
    import copy

    base = _tokenizers()[0]

    class Custom(type(base)):  # a subclass with its own encoding or decoding
        def _encode_plus(self, *a, **k):  # noqa: ANN002, ANN003, ANN202
            return super()._encode_plus(*a, **k)

        def _decode(self, *a, **k):  # noqa: ANN002, ANN003, ANN202
            return super()._decode(*a, **k)

    custom = copy.deepcopy(base)
    custom.__class__ = Custom
    assert compat.rust_encoder(custom) is None and compat.rust_decoder(custom) is None
    truncating = copy.deepcopy(base)
    truncating.backend_tokenizer.enable_truncation(8)  # a call turns it off before it encodes
    assert compat.rust_encoder(truncating) is None
    splitting = copy.deepcopy(base)
    splitting.split_special_tokens = True  # a call sets it on the backend before it encodes
    assert compat.rust_encoder(splitting) is None
    cleaning = copy.deepcopy(base)
    cleaning.clean_up_tokenization_spaces = True  # decode may clean the text up after the backend's
    assert compat.rust_decoder(cleaning) is None
    assert compat.rust_encoder(object()) is None and compat.rust_decoder(None) is None
