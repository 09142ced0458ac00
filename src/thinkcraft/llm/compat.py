"""Every reach into transformers / torch internals, in one module.

The in-process engine is fast because, in a few places, it goes under the public APIs: it calls the decoder
layers one by one (cascade attention, the pooled-last MLP split), swaps the attention function per call,
reads the KV a cache holds, calls torch's private fused-attention and FP8 matmul ops, and creates CUDA
green contexts. The learner (train/llm_policy) reaches in too: it reads the LM head's weight to compute token
log-probs in chunks, and hands packed sequences' boundaries to a mask-less attention function. Each such reach is an entry here, with the versions it was checked against and what to
look at when an upgrade breaks it; tests/test_llm_compat.py checks every entry and fails with a message
naming it (`broken(...)`).

Checked against: transformers 5.24.0, torch 2.13.0 (the dev venv, CPU). GPU image: (versions to be added
by the lead; the CUDA-only entries - the flash/efficient/varlen ops and green contexts - are checked there
by the GPU tests in tests/test_llm_hf.py and tests/test_llm_compat.py).

Nothing here may run per token or add work on the hot paths: the entries are thin (a renamed call, an
attribute read) and the version-dependent choices are made once, at engine construction.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, NamedTuple

import torch

from thinkcraft.llm.batching import take_rows
from thinkcraft.utils.errors import UserError

CHECKED_AGAINST = {"transformers": "5.24.0", "torch": "2.13.0"}
"""The versions every entry below was checked against (the dev venv)."""


def broken(entry: str, what: str) -> str:
    """A loud message for a compat entry that an installed version changed: what, where to look, versions."""
    import transformers

    return (f"thinkcraft.llm.compat.{entry}: {what}. Installed transformers {transformers.__version__}, "
            f"torch {torch.__version__}; checked against transformers {CHECKED_AGAINST['transformers']}, "
            f"torch {CHECKED_AGAINST['torch']}. Update that entry (and its test in tests/test_llm_compat.py).")


# --- transformers: the decoder's structure ------------------------------------------------------------------


def decoder_of(lm: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a Llama/Qwen-style causal LM: `embed_tokens`, `layers`, `norm`, `rotary_emb`
    (transformers 5.24.0 names; `get_decoder()` or `.model`). The engine runs these parts itself."""
    dec = lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if dec is None or not hasattr(dec, name):
            raise UserError(
                f"the hf engine supports Llama/Qwen-style decoders (embed_tokens, layers, norm, rotary_emb); "
                f"{type(lm).__name__} has no `{name}`"
            )
    return dec


def text_config(lm: torch.nn.Module) -> Any:
    """The text part of the model config (multimodal configs nest it): `config.get_text_config()`
    (transformers >= 4.50, 5.24.0), else the config itself."""
    cfg = lm.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def cache_kwarg(decoder: torch.nn.Module) -> str:
    """The decoder forward's name for the KV cache argument: `cache` in transformers 5.24.0 (`past_key_values`
    is deprecated there, removed in 5.40), `past_key_values` before. Read once from the signature, at engine
    construction; the engine passes it to the decoder (prefix KV) and to the causal LM (decode)."""
    params = inspect.signature(type(decoder).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) a filled `DynamicCache` holds, (B, Hkv, T, d) each: `cache.layers[i].keys`
    / `.values` (transformers >= 4.56, 5.24.0), `key_cache` / `value_cache` lists before."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def rotary(decoder: torch.nn.Module, h: torch.Tensor, pos: torch.Tensor) -> Any:
    """The decoder's (cos, sin) position embeddings for positions `pos`: `rotary_emb(x, position_ids)`
    (transformers 5.24.0), computed once and handed to every layer as `position_embeddings=`."""
    return decoder.rotary_emb(h, pos)


# --- transformers: the attention function ------------------------------------------------------------------


class AttentionConfigs(NamedTuple):
    """The distinct config objects of a decoder's attention modules, and the attribute naming their attention
    function: collected once (`attention_configs`), switched per call (`attention_implementation`)."""

    configs: tuple[Any, ...]
    attr: str


def attention_configs(decoder: torch.nn.Module) -> AttentionConfigs:
    """transformers 5.24.0 looks an attention module's function up per call from `config._attn_implementation`,
    a property over the private `_attn_implementation_internal` (4.x: `_attn_implementation` itself).
    Attention modules (those with a `layer_idx`) may hold their own config object (multimodal models): each
    distinct one is collected. Walking every module takes milliseconds on a large model, so it is done once,
    at engine construction (the module tree does not change afterwards), not per forward chunk."""
    configs = {id(m.config): m.config for m in decoder.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")}
    attr = "_attn_implementation_internal" if hasattr(decoder.config, "_attn_implementation_internal") else "_attn_implementation"
    return AttentionConfigs(tuple(configs.values()), attr)


@contextlib.contextmanager
def attention_implementation(attn: AttentionConfigs, name: str) -> Iterator[None]:
    """Route every attention module through the attention function registered as `name` for the block, by
    setting the private attribute directly (`object.__setattr__`: the public setter re-validates). The public
    `PreTrainedModel.set_attn_implementation` does the same but re-validates on every switch (it inspects the
    model's source file), and the engine switches once per forward chunk."""
    old = [getattr(c, attn.attr) for c in attn.configs]
    try:
        for c in attn.configs:
            object.__setattr__(c, attn.attr, name)
        yield
    finally:
        for c, o in zip(attn.configs, old):
            object.__setattr__(c, attn.attr, o)


def register_attention(name: str, fn: Any) -> str:
    """Register an attention function with transformers under `name` (`AttentionInterface.register`), with
    sdpa's mask function (`masking_utils.ALL_MASK_ATTENTION_FUNCTIONS`, transformers >= 4.53, 5.24.0), so that
    model code building a mask under this name gets sdpa's boolean mask. Idempotent; returns `name`."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    except ImportError:  # pragma: no cover - older transformers
        pass
    return name


def sdpa_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """transformers' own sdpa attention function (`integrations.sdpa_attention.sdpa_attention_forward`,
    transformers 5.24.0), what the registered functions fall back to for calls they do not handle."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


PREFIX_KV_KWARG = "thinkcraft_prefix_kv"
"""Extra keyword argument a decoder layer's forward passes down, through `self_attn(**kwargs)`, to the
attention function (transformers 5.24.0 forwards unknown layer kwargs to the attention interface): the
cascade attention reads the shared prefix's (k, v) from it, so nothing layer-specific is captured and one
compiled layer serves every layer."""


# --- transformers: the decoder layer, re-implemented -----------------------------------------------------------


def call_layer(
    layer: torch.nn.Module, h: torch.Tensor, pos: torch.Tensor, pe: Any, prefix_kv: Any, last: torch.Tensor | None = None
) -> torch.Tensor:
    """One decoder layer, no mask (causal), optionally attending to a shared prefix's (k, v).

    With `last` ((B,) position per row; only for `splits_at_mlp` layers) only those tokens come out, (B, H):
    the attention half runs on every token (its keys and values are what the kept tokens read), the MLP on
    the kept ones alone - a pooled read of the final layer skips ~3/4 of that layer's matmuls. That half is
    a re-implementation of transformers 5.24.0's `LlamaDecoderLayer.forward` (Qwen2/3, Mistral alike):
    `h + attn(input_layernorm(h))`, then `x + mlp(post_attention_layernorm(x))`; `self_attn` returns
    (out, weights). A layer returning a tuple (transformers 4.x) is unwrapped."""
    extra = {PREFIX_KV_KWARG: prefix_kv} if prefix_kv is not None else {}
    if last is None:
        o = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe, **extra)
        return o[0] if isinstance(o, tuple) else o
    a = layer.self_attn(hidden_states=layer.input_layernorm(h), attention_mask=None, position_ids=pos,
                        position_embeddings=pe, **extra)[0]
    x = take_rows(h, last) + take_rows(a, last)
    return x + layer.mlp(layer.post_attention_layernorm(x))


PLAIN_DECODERS = ("llama", "qwen2", "qwen3", "mistral")
"""Model types whose decoder forward is exactly embed_tokens -> rotary_emb -> each layer -> norm (transformers
5.24.0's LlamaModel / Qwen2Model / Qwen3Model / MistralModel; SmolLM2 is a llama): `plain_decoder`."""


def plain_decoder(decoder: torch.nn.Module) -> bool:
    """Can the decoder's forward be run as embed_tokens, rotary_emb, its layers one by one (`call_decoder_layer`)
    and norm, with nothing else in between? Judged by its model type (`PLAIN_DECODERS`: no embedding scale, no
    per-layer extras) and its parts; anything else keeps its own forward."""
    cfg = getattr(decoder, "config", None)
    return (getattr(cfg, "model_type", None) in PLAIN_DECODERS
            and all(hasattr(decoder, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")))


def call_decoder_layer(layer: torch.nn.Module, h: torch.Tensor, pos: torch.Tensor, pe: Any,
                       kwargs: dict[str, Any]) -> torch.Tensor:
    """One decoder layer as the decoder's own loop calls it for a maskless attention function (no mask, no cache),
    with the attention function's keyword arguments `kwargs` (e.g. `varlen_kwargs`)."""
    o = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe, use_cache=False, **kwargs)
    return o[0] if isinstance(o, tuple) else o


def splits_at_mlp(layer: torch.nn.Module) -> bool:
    """Is this decoder layer the pre-norm `h + attn(norm(h))`, then `h + mlp(norm(h))` block (Llama, Qwen2/3,
    Mistral, SmolLM) that `call_layer(last=...)` re-implements? Judged by its exact set of sub-modules
    (transformers 5.24.0 names): layers with other norms or residual paths (Gemma, OLMo2, Cohere, Phi-3) keep
    the full path."""
    return {n for n, _ in layer.named_children()} == {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}


def lm_head(lm: torch.nn.Module) -> torch.nn.Module:
    """The causal LM's output projection, `get_output_embeddings()` (transformers 5.24.0; `lm_head` for
    Llama/Qwen): the continuous-batching decode runs the decoder layers itself (`call_layer`), then the final
    norm and this head. Models that post-process logits (Gemma-2's soft-capping) are not supported there."""
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None:
        raise UserError(broken("lm_head", f"{type(lm).__name__} exposes no output embeddings (LM head)"))
    return head


LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config attributes of models whose forward changes the logits after the head (Gemma-2's soft-capping,
Cohere's scale, Granite's divisor; transformers 5.24.0 names): `plain_lm_head` refuses them."""


def plain_lm_head(lm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (V, H), bias or None) of the LM head as a plain linear map, so the learner can compute token
    log-probs from the decoder's final hidden states (`decoder(...).last_hidden_state`, already normed in
    transformers 5.24.0) in chunks, never building the (tokens x V) logits the causal LM's forward returns.
    Refuses a head that is not an `nn.Linear` (an adapter on the head) and models that post-process logits."""
    head = lm_head(lm)
    cfg = text_config(lm)
    post = [a for a in LOGIT_POSTPROCESSING if getattr(cfg, a, None) not in (None, 1, 1.0)]
    cls = type(head)
    if getattr(cls, "_tc_same_forward", False):  # an engine's derived copy of the same map (autocast_shadow)
        cls = cls._tc_unmixed
    if cls is not torch.nn.Linear or post:  # a subclass (an adapter layer) adds terms
        why = f"its config sets {post[0]}" if post else f"its head is a {type(head).__name__}, not a plain Linear"
        raise UserError(f"the learner computes token log-probs from the LM head's weight; {type(lm).__name__}: {why}")
    return head.weight, head.bias


# --- transformers: packed (varlen) training forwards ----------------------------------------------------------

VARLEN_KWARG_NAMES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""transformers 5.24.0's `FlashAttentionKwargs`: the decoder's forward hands them, through every layer and
`self_attn(**kwargs)`, to the attention function."""


def varlen_kwargs(cu_seqlens: torch.Tensor, max_len: int, cu_k: torch.Tensor | None = None,
                  max_k: int | None = None) -> dict[str, Any]:
    """Forward kwargs carrying a packed batch's boundaries (one (1, T) row holding sequences
    cu_seqlens[i]:cu_seqlens[i+1], int32) to the attention function registered by `register_maskless_attention`;
    `cu_k`/`max_k` when the keys are laid out otherwise (a shared prefix copied per sequence)."""
    return dict(zip(VARLEN_KWARG_NAMES, (cu_seqlens, cu_seqlens if cu_k is None else cu_k, max_len,
                                         max_len if max_k is None else max_k)))


def varlen_from_kwargs(kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """(cu_q, cu_k, max_q, max_k) that `varlen_kwargs` put in an attention function's kwargs, or None."""
    cu, cu_k, max_q, max_k = (kwargs.get(n) for n in VARLEN_KWARG_NAMES)
    if cu is None or max_q is None:
        return None
    return cu, (cu if cu_k is None else cu_k), int(max_q), int(max_q if max_k is None else max_k)


def register_maskless_attention(name: str, fn: Any) -> str:
    """Register an attention function that needs no mask (it reads the boundaries from `varlen_kwargs`):
    `AttentionInterface.register` alone. transformers 5.24.0's `create_causal_mask` returns None at once for an
    implementation absent from `masking_utils.ALL_MASK_ATTENTION_FUNCTIONS` (`_preprocess_mask_arguments`'
    early exit), so a packed (1, T) row costs no (T, T) mask and no packed-sequence detection from the position
    ids (which reads a device value on the host). Idempotent; returns `name`."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    return name


# --- transformers: a fast tokenizer's Rust backend ----------------------------------------------------------


def _plain_fast_tokenizer(tokenizer: Any, *methods: str) -> Any:
    """The `tokenizers.Tokenizer` behind a transformers 5.24.0 fast tokenizer (`TokenizersBackend`) whose `methods`
    are the library's own (no subclass overrides them), else None (transformers 4, slow or custom tokenizers)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if not isinstance(tokenizer, TokenizersBackend):
        return None
    if any(getattr(type(tokenizer), name) is not getattr(TokenizersBackend, name) for name in methods):
        return None
    return tokenizer.backend_tokenizer


def rust_encoder(tokenizer: Any) -> Any:
    """The Rust tokenizer whose `encode_batch_fast(texts, add_special_tokens=False)` gives the ids of
    `tokenizer(texts, add_special_tokens=False)["input_ids"]`, or None. transformers 5.24.0's call of a batch of
    texts (no padding, truncation or special tokens asked for) sets no truncation or padding and the special
    tokens' splitting on the backend, then is its `encode_batch` (`TokenizersBackend._encode_plus`); the fast
    variant skips the character offsets, which the ids do not depend on. So: the library's own `__call__` and
    `_encode_plus`, no source/target modes (`_switch_to_input_mode`, transformers' own test), and none of those
    settings left on the backend (a call would change them first). Per call of a batch, never per token."""
    rust = _plain_fast_tokenizer(tokenizer, "__call__", "_encode_plus")
    if rust is None or hasattr(tokenizer, "_switch_to_input_mode"):
        return None
    if (rust.truncation is not None or rust.padding is not None
            or rust.encode_special_tokens != tokenizer.split_special_tokens):
        return None
    return rust


def rust_decoder(tokenizer: Any) -> Any:
    """The Rust tokenizer whose `decode_batch(lists, skip_special_tokens=s)` gives `[tokenizer.decode(ids,
    skip_special_tokens=s) for ids in lists]` for lists of ints, or None. transformers 5.24.0's `decode` of one
    list is `_decode`: the backend's `decode`, then `clean_up_tokenization` only where
    `clean_up_tokenization_spaces` is set (None then). Per call of a batch, never per token."""
    rust = _plain_fast_tokenizer(tokenizer, "decode", "_decode")
    return None if rust is None or tokenizer.clean_up_tokenization_spaces else rust


def decode_batch(tokenizer: Any, seqs: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """`[tokenizer.decode(ids, skip_special_tokens=...) for ids in seqs]`: one Rust `decode_batch` where it gives the
    same texts (`rust_decoder`; ~5 us a 32-token row on the CPU against ~12 through `decode`), else row by row."""
    if not seqs:
        return []
    rust = rust_decoder(tokenizer)
    if rust is not None:
        return rust.decode_batch(seqs, skip_special_tokens=skip_special_tokens)
    return [tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in seqs]


# --- torch: private attributes and ops -----------------------------------------------------------------------


def mark_static_address(t: torch.Tensor) -> None:
    """Tell torch.compile that `t` keeps its storage for the process's life (`torch._dynamo.mark_static_address`,
    torch 2.1-2.13.0, what transformers' StaticCache does): a compiled decode step with CUDA graphs then mutates
    the slot KV buffers in place instead of copying them into the graph's own inputs (or skipping the graph)."""
    import torch._dynamo

    torch._dynamo.mark_static_address(t)


def autocast(dtype: torch.dtype, device_type: str = "cuda") -> torch.autocast:
    """`torch.autocast` without its weight-cast cache: every autocast region of ours (the learner, the engines'
    generation) goes through here. Why: torch keeps the cache of fp32 -> bf16 casts of leaf tensors in one
    process-wide map under one mutex (aten autocast_mode.cpp, torch 2.x-2.13.0), and the outermost autocast exit
    of *any* thread clears it. A thread tracing with torch.compile under autocast (an engine compiling its decode
    step over the learner's fp32 parameters, or the compiled learner) puts FakeTensor casts in that map; another
    thread's exit then destroys them holding the mutex, and a FakeTensor's destructor needs the GIL - which the
    tracing thread holds while it waits for the mutex at its next cast. A deadlock with no Python frame moving:
    the 2-GPU async runs that never took a step (H200, 2026-11-27: one engine in a Dynamo trace, the other in
    `autocast.__exit__`, `bench/results/logs/s32_h200x2_async_2gpu_hang.log`), reproduced on the CPU in
    tests/test_autocast_deadlock.py. Without the cache nothing is put in the map (its clear takes the mutex over
    an empty map). Cost: a weight used twice inside one region is cast twice; generation clears the cache after
    every decode step anyway."""
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def ensure_cudagraph_thread_state() -> None:
    """Give the calling thread its own CUDA-graph-tree managers (`torch._inductor.cudagraph_trees`), as torch
    2.13 does by itself. Up to torch 2.11 at least (the GPU image), the managers live in thread-local state
    set up only on the thread that imported the module; a compiled "reduce-overhead" step called from any other
    thread (the async pools' engine slot threads) fails with a bare AssertionError in `get_obj`, and the decode
    step fell back to eager: 6x slower on an H100 (bench/async_llm_policy.py, 2026-11-27). A no-op where the
    thread already has them; called before each compiled step (an attribute check)."""
    try:
        from torch._inductor import cudagraph_trees as trees
    except ImportError:  # a torch without inductor: nothing compiled uses CUDA graph trees
        return
    local = trees.local
    if hasattr(local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    init = getattr(trees, "_initialize_tls", None)
    if init is not None:
        init(local)
        return
    import collections
    import threading

    local.tree_manager_containers = {}
    local.tree_manager_locks = collections.defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)


_FX_PER_THREAD: dict[str, Any] = {}


def fx_patches_per_thread() -> bool:
    """Make torch.fx's tracing patches of `torch.nn.Module.__call__` / `__getattr__` act only in the thread that
    traces. Why: `torch.fx.Tracer.trace` (run by every torch.compile through AOTAutograd's make_fx) replaces both
    on the class itself for the trace's duration (torch.fx._symbolic_trace `_Patcher.patch_method`, torch
    2.x-2.13.0), so a module called in *another* thread meanwhile goes to the tracer, which does not know it:
    "NameError: module is not installed as a submodule" - an engine's eager prefill on one GPU while another
    engine compiled its decode step on the other (2 x H200, 2026-11-29, bench/results/logs/s45_*async_2gpu*; a
    decode step failed, its group played again), reproduced on the CPU in tests/test_fx_threads.py. With this,
    each trace's patch goes on a per-thread stack and the class holds, while any trace runs, one dispatcher that
    gives a thread its own top patch or else the original method; the class gets the original back when the
    last trace ends. Nothing changes outside traces (no cost on any forward). Installed once per process
    (engines and learners call it); False, with a warning, where torch's internals differ."""
    import logging
    import threading

    if _FX_PER_THREAD:
        return True
    try:
        from torch.fx import _symbolic_trace as st

        originals = {"__call__": st._orig_module_call, "__getattr__": st._orig_module_getattr}
        patcher, plain_patch_method = st._Patcher, st._Patcher.patch_method
    except AttributeError as e:
        logging.getLogger(__name__).warning(broken("fx_patches_per_thread", f"torch.fx internals moved ({e}); "
                                                   "tracing in one thread can break modules called in another"))
        return False
    lock = threading.Lock()
    stacks: dict[str, dict[int, list[Any]]] = {name: {} for name in originals}

    def dispatcher(name: str) -> Any:
        original, table = originals[name], stacks[name]

        def dispatch(mod: Any, *args: Any, **kwargs: Any) -> Any:
            mine = table.get(threading.get_ident())
            return (mine[-1] if mine else original)(mod, *args, **kwargs)

        return dispatch

    dispatchers = {name: dispatcher(name) for name in originals}

    class ThreadPatch(NamedTuple):  # the fields of torch's _PatchedFn, which `_Patcher` reads
        frame_dict: Any
        fn_name: str
        orig_fn: Any
        new_fn: Any
        thread: int

        def patch(self) -> None:
            with lock:
                stacks[self.fn_name].setdefault(self.thread, []).append(self.new_fn)
                setattr(torch.nn.Module, self.fn_name, dispatchers[self.fn_name])

        def revert(self) -> None:
            with lock:
                mine = stacks[self.fn_name].get(self.thread, [])
                for i in range(len(mine) - 1, -1, -1):
                    if mine[i] is self.new_fn:
                        del mine[i]
                        break
                if not mine:
                    stacks[self.fn_name].pop(self.thread, None)
                if not stacks[self.fn_name]:
                    setattr(torch.nn.Module, self.fn_name, originals[self.fn_name])

    def patch_method(self: Any, cls: type, name: str, new_fn: Any, deduplicate: bool = True) -> None:
        if cls is not torch.nn.Module or name not in originals:
            return plain_patch_method(self, cls, name, new_fn, deduplicate)
        new_fn.__fx_already_patched = deduplicate
        mine = stacks[name].get(threading.get_ident())
        if mine and getattr(mine[-1], "__fx_already_patched", False):
            return None  # torch's deduplication, per thread
        self.patches_made.append(ThreadPatch(cls, name, originals[name], new_fn, threading.get_ident()))
        self.patches_made[-1].patch()
        return None

    patcher.patch_method = patch_method
    _FX_PER_THREAD["installed"] = True
    return True


def weights_version(params: Any) -> int:
    """A number that changes whenever one of `params` is modified in place (optimizer steps,
    `load_state_dict`): the sum of the private per-tensor counter `Tensor._version` (torch 1.x-2.13.0;
    bumped by every in-place op, read without a device sync)."""
    return sum(p._version for p in params)


_PARAM_EPOCH = [0]
_PARAM_HOOK: list[Any] = []


def parameter_epoch() -> int:
    """A process-wide counter that moves whenever any module registers a Parameter (`register_parameter`, and
    so `module.weight = nn.Parameter(...)`), through torch's global parameter-registration hook (installed at
    the first call). A per-step check that holds resolved Parameter objects re-resolves them only when it moves,
    instead of walking every module's `_parameters` each step; a storage swapped under the same Parameter
    (`p.data = t`) changes its `data_ptr`, which such a check reads itself."""
    if not _PARAM_HOOK:
        def bump(module: Any, name: str, param: Any) -> None:
            _PARAM_EPOCH[0] += 1

        _PARAM_HOOK.append(torch.nn.modules.module.register_module_parameter_registration_hook(bump))
    return _PARAM_EPOCH[0]


def flash_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA FlashAttention-2 with its log-sum-exp: `aten::_scaled_dot_product_flash_attention` (torch
    2.13.0: returns (out, lse, ...); takes GQA-shaped k/v). The public sdpa returns no LSE."""
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1]


def efficient_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA memory-efficient attention with its LSE: `aten::_scaled_dot_product_efficient_attention`
    (torch 2.13.0; no GQA: k/v must have q's heads; its LSE may be padded along the query axis, cut here)."""
    r = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return r[0], r[1][..., : q.shape[-2]]


def cpu_flash_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention with its LSE: `aten::_scaled_dot_product_flash_attention_for_cpu` (torch 2.13.0;
    takes GQA-shaped k/v since torch 2.5)."""
    r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return r[0], r[1]


def flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
    scale: float,
) -> torch.Tensor:
    """CUDA FlashAttention-2 varlen forward, causal aligned bottom-right, GQA heads mapped by the kernel:
    `aten::_flash_attention_forward(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    return_debug_mask, *, scale)` (torch 2.13.0). q (Tq, H, d), k/v (Tk, Hkv, d) packed; returns (Tq, H, d).
    The public `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10) wraps the same kernel; see
    `attention.VARLEN_KERNELS`."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]


def flash_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
    scale: float, used_k: torch.Tensor, causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA FlashAttention-2 varlen forward over keys read in place: sequence i's keys are
    k[cu_k[i] : cu_k[i] + used_k[i]] (`seqused_k`: cu_k only gives where each starts, so the rows of a larger
    buffer serve as sequences without a gather; k may be a strided view whose rows overlap). Not causal (the
    decode step), or `causal`, aligned bottom-right to the used keys (the prefill over a slot). q (Tq, H, d),
    k/v (Tk, Hkv, d); returns (out (Tq, H, d), lse (H, Tq) float32). Same private op as `flash_varlen` (its
    `seqused_k` keyword: torch >= 2.5; checked on 2.13.0 here, 2.11.0+cu130 on the GPU image)."""
    r = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
                                                seqused_k=used_k)
    return r[0], r[1]


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 matmul with per-row (a: (M, 1)) and per-column (b: (1, N)) float32 scales applied in the
    epilogue: the private `torch._scaled_mm` (torch 2.13.0; `b` must be column-major; runs on CPU too).
    torch 2.13's public `torch.nn.functional.scaled_mm(a, b, scale_a, ScalingType.RowWise, scale_b,
    ScalingType.RowWise, output_dtype=...)` also runs here; not switched to until bench/probes/fp8_probe.py
    measures it as fast inside the compiled prefill on an H100."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def green_context(sm_count: int, device_index: int) -> tuple[Any, torch.cuda.Stream]:
    """(context, stream): a CUDA green context of `sm_count` SMs on the device and a stream in it, via
    `torch.cuda.green_contexts.GreenContext.create(num_sms=, device_id=)` and `.Stream()` (torch >= 2.10,
    2.13.0; CUDA >= 12.4). Raises ImportError when this torch has no green contexts."""
    from torch.cuda import green_contexts

    ctx = green_contexts.GreenContext.create(num_sms=sm_count, device_id=device_index)
    return ctx, ctx.Stream()


def no_duck_shapes() -> Any:
    """A context in which torch.compile gives every dynamic dimension its own symbol, even dimensions equal at
    the first trace ("duck sizing" shares one symbol between them and guards on the equality; private config,
    torch >= 2.1: a no-op context where it is missing)."""
    try:
        from torch.fx.experimental import _config
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    if not hasattr(_config, "use_duck_shape"):  # pragma: no cover
        return contextlib.nullcontext()
    return _config.patch(use_duck_shape=False)
