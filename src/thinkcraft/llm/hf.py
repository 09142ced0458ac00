"""`hf` engine: transformers in-process (bf16 on GPU, fp32 on CPU).

Hidden states: batched with right padding and a last-real-token gather, any layer (0 = embeddings,
L or -1 = final-normed output, what the LM head reads), "last" or "mean" pooling over the item's own
tokens. With a shared prefix, the prefix is prefilled once (batch 1) and its per-layer KV kept while it
is unchanged; the suffixes then run through the decoder layers with cascade attention
(`attention.shared_prefix_attention`) that reads that one copy of the prefix KV. The plain path
(prefix + item as one sequence, HF forward) is kept as the reference and is tested allclose.

Generation: own decode loop over the HF model (token-in/token-out) with temperature / top-p, stop
strings, max tokens, n samples per item, sampled-token logprobs (unmodified softmax), seeds, and a
thinking budget for `<think>` models (after B thinking tokens the thought is closed with
`thinking_close_text` and the model answers). KV cache: dynamic, or static (preallocated, fixed
shapes) with optional `torch.compile` of the decode step (CUDA graphs) for speed on GPU. A shared
prefix is prefilled once (batch 1, cached) and its KV copied into every row's cache; rows are laid out
[prefix][pads][suffix] with contiguous positions, so results equal the concatenated prompts.

Works on any Llama/Qwen-style decoder (embed_tokens, layers, norm, rotary_emb), including a PEFT
(LoRA) wrapped model shared with a learner: `HFEngine.from_model(model, tokenizer)` copies nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Sequence

import numpy as np
import torch

from thinkcraft.llm.attention import (
    PREFIX_KV_KWARG, probe_gqa_native, probe_varlen, register_cascade_attention, register_decode_attention,
)
from thinkcraft.llm.batching import plan_chunks
from thinkcraft.llm.constrained import start_guide
from thinkcraft.llm.protocol import Batch, Capabilities, Completion, EngineCapabilityError, SamplingParams
from thinkcraft.llm.quant import check_fp8_device, quantize_fp8_
from thinkcraft.llm.sm_partition import SMPartition
from thinkcraft.utils.errors import UserError

log = logging.getLogger(__name__)

Pooling = Literal["last", "mean"]

_STATIC_PROMPT_BUCKET = 64
"""Static-cache prompt widths are rounded up to a multiple of this (fixed shapes across calls)."""


@dataclass
class _SeqState:
    """Per-sequence decode bookkeeping (host side)."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    forced: list[int] = field(default_factory=list)
    """Indices (into `tokens`) of tokens the engine forced (thinking-budget close), not sampled."""
    queue: list[int] = field(default_factory=list)
    in_think: bool = False
    thinking_tokens: int = 0
    think_truncated: bool = False
    done: bool = False
    finish: str = "length"
    stop_at: int | None = None
    """Character index in the decoded text where a stop string starts."""


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM under a PEFT wrapper (LoRA layers are injected in place, so it includes them)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _decoder_of(lm: torch.nn.Module) -> torch.nn.Module:
    dec = lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if dec is None or not hasattr(dec, name):
            raise UserError(
                f"the hf engine supports Llama/Qwen-style decoders (embed_tokens, layers, norm, rotary_emb); "
                f"{type(lm).__name__} has no `{name}`"
            )
    return dec


class HFEngine:
    """In-process transformers engine (see module docstring)."""

    def __init__(
        self,
        model: str = "default",
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_batch_tokens: int | None = None,
        max_batch_size: int = 1024,
        prefix_reuse: bool = True,
        prefix_cache_size: int = 4,
        kv_cache: Literal["dynamic", "static"] = "dynamic",
        compile_decode: bool = False,
        thinking_close_text: str = "\n</think>\n\n",
        attn_implementation: str = "sdpa",
        compile_prefill: bool | None = None,
        sm_limit: int | None = None,
        chunk_overhead_tokens: int = 512,
        quantize: Literal["none", "fp8"] = "none",
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from thinkcraft.llm.models import resolve_model

        path = resolve_model(model)
        dev = torch.device(device) if device is not None else _default_device()
        if dtype is None:
            dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
        else:
            dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        tok = AutoTokenizer.from_pretrained(str(path))
        lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt, attn_implementation=attn_implementation)
        lm.to(dev).eval()
        lm.requires_grad_(False)
        self._setup(
            lm, tok, max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size, prefix_reuse=prefix_reuse,
            prefix_cache_size=prefix_cache_size, kv_cache=kv_cache, compile_decode=compile_decode,
            thinking_close_text=thinking_close_text, weight_update=False, compile_prefill=compile_prefill,
            sm_limit=sm_limit, chunk_overhead_tokens=chunk_overhead_tokens, quantize=quantize,
        )
        self.model_path = path

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any, **options: Any) -> "HFEngine":
        """Wrap an existing (possibly PEFT-wrapped, possibly training) model without copying weights:
        the engine samples with whatever weights the model holds at call time."""
        self = cls.__new__(cls)
        self._setup(model, tokenizer, weight_update=True, **options)
        self.model_path = None
        return self

    def _setup(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_batch_tokens: int | None = None,
        max_batch_size: int = 1024,
        prefix_reuse: bool = True,
        prefix_cache_size: int = 4,
        kv_cache: str = "dynamic",
        compile_decode: bool = False,
        thinking_close_text: str = "\n</think>\n\n",
        weight_update: bool = False,
        compile_prefill: bool | None = None,
        sm_limit: int | None = None,
        chunk_overhead_tokens: int = 512,
        quantize: str = "none",
    ) -> None:
        if kv_cache not in ("dynamic", "static"):
            raise UserError(f"kv_cache must be 'dynamic' or 'static', got {kv_cache!r}")
        if quantize not in ("none", "fp8"):
            raise UserError(f"quantize must be 'none' or 'fp8', got {quantize!r}")
        self.model = model
        self.tokenizer = tokenizer
        self._lm = _unwrap(model)
        self._dec = _decoder_of(self._lm)
        p = next(self._lm.parameters())
        self.device = p.device
        self.dtype = p.dtype
        cfg = self._lm.config.get_text_config() if hasattr(self._lm.config, "get_text_config") else self._lm.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.max_batch_tokens = max_batch_tokens or (65536 if self.device.type == "cuda" else 8192)
        self.max_batch_size = max_batch_size
        if chunk_overhead_tokens < 0:
            raise UserError(f"chunk_overhead_tokens must be >= 0, got {chunk_overhead_tokens}")
        self.chunk_overhead_tokens = chunk_overhead_tokens
        """Padding tokens a hidden-state forward chunk must save to be worth its own launch (batching.py)."""
        self._sm: SMPartition | None = None
        self.set_sm_limit(sm_limit)
        self.prefix_reuse = prefix_reuse
        self._prefix_cache: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._prefix_cache_size = prefix_cache_size
        # a compiled decode step needs fixed shapes: it always runs on the static cache
        self.kv_cache = "static" if compile_decode else kv_cache
        self.compile_decode = compile_decode
        self._compiled_forward = None
        self._static_cache: tuple[tuple[int, int], Any] | None = None
        self.last_generate_timing: dict[str, float] = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
        """Phase times of the last `generate` call (prefill = prompt forward; decode = the token loop)."""
        self.thinking_close_text = thinking_close_text
        self._weight_update = weight_update
        # Hidden-state prefill through torch.compile'd decoder layers (one compiled graph shared by every
        # layer, dynamic batch/length): fuses the norms, RoPE, SiLU and the cascade merge that otherwise
        # cost as much GPU time as the matmuls. Default: on for a frozen model (no parameter requires grad)
        # on CUDA; off for a model being trained (its compiled graphs would guard on changing weights).
        if compile_prefill is None:
            frozen = not any(q.requires_grad for q in self._lm.parameters())
            compile_prefill = self.device.type == "cuda" and frozen
        self.compile_prefill = compile_prefill
        self.quantize = quantize
        if quantize == "fp8":
            # decoder linears only (embeddings and the LM head stay): the prefill's matmuls on FP8 cores
            check_fp8_device(self.device)
            quantize_fp8_(self._dec.layers)
        self._layer_fn: Any = _CompiledLayer() if compile_prefill else _call_layer
        self._embed_hook: Any = None  # see _autocast_embeddings
        self._embed_cast: torch.dtype | None = None
        params = inspect.signature(type(self._dec).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._cascade_name = register_cascade_attention()
        # kernel choices decided here, eagerly: the compiled layers then only read the answers
        probe_gqa_native(self.device)
        probe_varlen(self.device)
        self._decode_name = register_decode_attention()
        # pad with the pad token if there is one, else EOS (pads are never attended nor gathered)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.eos_ids = self._eos_ids()
        vocab = tokenizer.get_vocab()
        self.think_open_id = vocab.get("<think>")
        self.think_close_id = vocab.get("</think>")

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self._lm, "generation_config", None), self._lm.config):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, (list, tuple)):
                ids.update(int(x) for x in e)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # --- protocol -------------------------------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            hidden_states=True, generate=True, logprobs=True, prefix_reuse=True,
            weight_update=self._weight_update, hidden_size=self.hidden_size, num_layers=self.num_layers,
        )

    def close(self) -> None:
        self._prefix_cache.clear()
        self._compiled_forward = None
        self._static_cache = None

    def invalidate_prefix_cache(self) -> None:
        """Forget cached prefix KV (call after changing the weights the engine reads)."""
        self._prefix_cache.clear()

    # --- tokenization -----------------------------------------------------------------------------------

    def _encode(self, text: str, first: bool) -> list[int]:
        # Add BOS etc. only at the very start of a sequence, and not when a chat template already did.
        bos = getattr(self.tokenizer, "bos_token", None)
        special = first and not (bos and text.startswith(bos))
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def tokenize_batch(self, batch: Batch) -> tuple[list[int], list[list[int]]]:
        """(prefix ids, item ids). Texts: prefix and items are tokenized separately and concatenated as
        token ids (so the prefix KV is reusable); the first piece gets the tokenizer's special tokens."""
        if len(batch) == 0:
            return [], []
        if batch.is_tokens:
            prefix = [int(t) for t in batch.prefix] if batch.prefix is not None else []
            items = [[int(t) for t in it] for it in batch.items]
        else:
            if batch.prefix is not None and not isinstance(batch.prefix, str):
                raise UserError("a text batch needs a text prefix (got token ids)")
            prefix = self._encode(batch.prefix, first=True) if batch.prefix else []
            items = [self._encode(t, first=not prefix) for t in batch.items]
        return prefix, items

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True, tokenize: bool = False, **kwargs: Any
    ) -> str | list[int]:
        """The tokenizer's chat template (kwargs such as `enable_thinking=` pass through to it)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise UserError("this tokenizer has no chat template; pass raw prompts instead")
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return self._encode(text, first=True) if tokenize else text

    # --- hidden states ------------------------------------------------------------------------------------

    def _layer_index(self, layer: int) -> int:
        n = self.num_layers
        if not -(n + 1) <= layer <= n:
            raise UserError(f"layer {layer} out of range for a {n}-layer model (use 0..{n} or -1..-{n + 1})")
        return layer if layer >= 0 else n + 1 + layer

    @property
    def sm_limit(self) -> int | None:
        return self._sm.sm_count if self._sm is not None else None

    def set_sm_limit(self, sm_count: int | None) -> int | None:
        """Run this engine's GPU work on `sm_count` SMs only (a CUDA green context; None = the whole GPU),
        so that other GPU work - ppo-hidden's env steps under --overlap - keeps the other SMs. Returns
        the previous limit. Results are handed back ordered after the engine's work on the caller's
        current stream, as without a limit."""
        old = self.sm_limit
        if sm_count != old:
            if self.device.type == "cuda":
                # cached tensors (prefix KV, static cache) move to another stream's use: let the old one drain
                torch.cuda.synchronize(self.device)
            self._sm = SMPartition(self.device, sm_count) if sm_count is not None else None
        return old

    @contextlib.contextmanager
    def _inference(self) -> Iterator[Any]:
        """No grad, eval mode (LoRA dropout off) for the call, on the SM partition's stream if there is
        one (yields the caller's stream then, else None); the learner's mode is restored after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self._on_partition() as caller:
                yield caller
        finally:
            if was_training:
                self.model.train()

    @contextlib.contextmanager
    def _on_partition(self) -> Iterator[Any]:
        """Run the block on the SM partition's stream, ordered after the caller's stream and before what the
        caller queues next; yields the caller's stream (None without a partition)."""
        if self._sm is None:
            yield None
            return
        caller = torch.cuda.current_stream(self.device)
        stream = self._sm.stream
        stream.wait_stream(caller)  # inputs the caller queued before the call
        with torch.cuda.stream(stream):
            yield caller
        caller.wait_stream(stream)  # results: ordered for the caller as if computed on its stream

    @contextlib.contextmanager
    def _autocast_embeddings(self) -> Iterator[None]:
        """Under autocast with higher-precision weights (full fine-tuning keeps fp32 master weights), cast
        the token embeddings to the autocast dtype for the call. Otherwise the residual stream stays fp32,
        RoPE'd keys come out fp32 while values come out of autocast's matmuls in bf16, and a static KV
        cache (one dtype) cannot hold both. The hook is registered once and reads a flag, so that a
        compiled decode step sees the same module hooks on every call (no recompiles)."""
        kind = self.device.type
        dt = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        if dt is None or self.dtype == dt:
            yield
            return
        if self._embed_hook is None:
            def cast(_m, _i, out):  # noqa: ANN001, ANN202
                return out if self._embed_cast is None else out.to(self._embed_cast)

            self._embed_hook = self._dec.embed_tokens.register_forward_hook(cast)
        self._embed_cast = dt
        try:
            yield
        finally:
            self._embed_cast = None

    @contextlib.contextmanager
    def _attn_impl(self, name: str) -> Iterator[None]:
        """Temporarily switch the attention function of every attention module's config."""
        configs = {id(m.config): m.config for m in self._dec.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")}
        attr = "_attn_implementation_internal" if hasattr(self._dec.config, "_attn_implementation_internal") else "_attn_implementation"
        old = {k: getattr(c, attr) for k, c in configs.items()}
        try:
            for c in configs.values():
                object.__setattr__(c, attr, name)
            yield
        finally:
            for k, c in configs.items():
                object.__setattr__(c, attr, old[k])

    def hidden_states(self, batch: Batch, layer: int = -1, pooling: Pooling = "last") -> np.ndarray:
        return self.hidden_states_torch(batch, layer, pooling).cpu().numpy()

    def hidden_states_torch(
        self,
        batch: Batch,
        layer: int = -1,
        pooling: Pooling = "last",
        prefix_reuse: bool | None = None,
        padding_side: Literal["left", "right"] = "right",
    ) -> torch.Tensor:
        """(N, H) float32 tensor on the model's device (hand to JAX with `dlpack.torch_to_jax`).
        `prefix_reuse=False` forces the plain path (prefix + item as one sequence) - the reference."""
        if pooling not in ("last", "mean"):
            raise UserError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        idx = self._layer_index(layer)
        prefix, items = self.tokenize_batch(batch)
        if not items:
            return torch.zeros((0, self.hidden_size), dtype=torch.float32, device=self.device)
        if any(len(it) == 0 for it in items) and (pooling == "mean" or not prefix):
            raise UserError("every item needs at least one token (empty item in the batch)")
        reuse = self.prefix_reuse if prefix_reuse is None else prefix_reuse
        with self._inference() as caller:
            out = torch.empty((len(items), self.hidden_size), dtype=torch.float32, device=self.device)
            if reuse and prefix and all(len(it) > 0 for it in items):
                kv = self._prefix_kv(prefix)
                for rows in self._chunks([len(it) for it in items]):
                    out[rows] = self._pooled_cascade([items[i] for i in rows], len(prefix), kv, idx, pooling)
            else:
                seqs = [prefix + it for it in items]
                for rows in self._chunks([len(s) for s in seqs]):
                    out[rows] = self._pooled_plain(
                        [seqs[i] for i in rows], [len(items[i]) for i in rows], idx, pooling, padding_side
                    )
            if caller is not None:
                out.record_stream(caller)  # allocated on the partition's stream, read on the caller's
        return out

    def token_hidden_states(self, token_ids: Sequence[int], layer: int = -1) -> torch.Tensor:
        """(T, H) float32 per-token hidden states of one sequence (what SGLang's /generate returns)."""
        idx = self._layer_index(layer)
        with self._inference():
            ids, mask = self._pad([list(token_ids)], "right")
            return self._run_decoder(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), idx)[0].float()

    def _chunks(self, lengths: Sequence[int]) -> Iterator[torch.Tensor]:
        """Row index groups of length-sorted rows, cut where the padding saved pays for another forward
        (batching.plan_chunks), each ≤ max_batch_tokens padded tokens and ≤ max_batch_size rows."""
        order = np.argsort(np.asarray(lengths), kind="stable")
        sorted_lengths = np.asarray(lengths)[order]
        for a, b in plan_chunks(sorted_lengths, self.chunk_overhead_tokens, self.max_batch_tokens, self.max_batch_size):
            yield torch.as_tensor(order[a:b], device=self.device)

    def _pad(self, seqs: Sequence[Sequence[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask) of the rows padded to the longest, built in numpy (one host->device copy each:
        this runs once per forward chunk, i.e. on every ppo-hidden refresh)."""
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        t = int(lens.max())
        col = np.arange(t)[None, :]
        mask = col < lens[:, None] if side == "right" else col >= (t - lens)[:, None]
        ids = np.full((len(seqs), t), self.pad_id, dtype=np.int64)
        ids[mask] = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lens.sum()))
        return torch.from_numpy(ids).to(self.device), torch.from_numpy(mask.astype(np.int64)).to(self.device)

    @staticmethod
    def _pool(h: torch.Tensor, start: torch.Tensor, end: torch.Tensor, pooling: str) -> torch.Tensor:
        """Pool h (B, T, H) over positions [start, end) per row: the last one, or the mean."""
        if pooling == "last":
            return take_rows(h, end - 1).float()
        pos = torch.arange(h.shape[1], device=h.device)[None, :]
        w = ((pos >= start[:, None]) & (pos < end[:, None])).to(torch.float32)
        return torch.einsum("bt,bth->bh", w, h.float()) / w.sum(1, keepdim=True)

    def _pooled_plain(
        self, seqs: list[list[int]], item_lens: list[int], idx: int, pooling: str, side: str
    ) -> torch.Tensor:
        lens = torch.tensor([len(s) for s in seqs], device=self.device)
        ilens = torch.tensor(item_lens, device=self.device)
        if side == "right":
            # Right padding + causal attention is exact for every real token (pads come after them):
            # no mask needed, so the same (compiled) layer loop as the cascade path runs it.
            ids, _ = self._pad(seqs, "right")
            return self._layers_pooled(ids, torch.zeros_like(lens[:1]), idx, None, lens - ilens, lens, pooling)
        ids, mask = self._pad(seqs, side)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        h = self._run_decoder(ids, mask, pos, idx)
        end = torch.full_like(lens, ids.shape[1])
        return self._pool(h, end - ilens, end, pooling)

    def _run_decoder(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, idx: int) -> torch.Tensor:
        want_all = idx != self.num_layers
        out = self._dec(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, output_hidden_states=want_all)
        return out.hidden_states[idx] if want_all else out.last_hidden_state

    def _layers(
        self, ids: torch.Tensor, start: torch.Tensor, idx: int, kv: list | None, last: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states after `idx` layers (idx = num_layers: after the final norm) of right-padded rows
        whose positions start at `start` (the prefix length), causal within the rows; with `kv` each layer
        also attends to the shared prefix KV (cascade attention). (B, S, H); with `last` ((B,) one position
        per row) only those tokens, (B, H), and the last layer's MLP runs on them alone."""
        b, s = ids.shape
        dec = self._dec
        h = dec.embed_tokens(ids)
        if idx == 0:
            return h if last is None else take_rows(h, last)
        pos = (start + torch.arange(s, device=self.device))[None, :].expand(b, s)
        pe = dec.rotary_emb(h, pos)
        layers = dec.layers[: min(idx, self.num_layers)]
        split = last is not None and splits_at_mlp(layers[-1])
        with self._attn_impl(self._cascade_name):
            for i, layer in enumerate(layers):
                pkv = kv[i] if kv is not None else None
                if split and i == len(layers) - 1:
                    h = self._layer_fn(layer, h, pos, pe, pkv, last)
                else:
                    h = self._layer_fn(layer, h, pos, pe, pkv)
        if last is not None and not split:
            h = take_rows(h, last)
        return dec.norm(h) if idx == self.num_layers else h

    def _layers_pooled(
        self, ids: torch.Tensor, start: torch.Tensor, idx: int, kv: list | None, begin: torch.Tensor, end: torch.Tensor,
        pooling: str,
    ) -> torch.Tensor:
        """`_layers` pooled over each row's positions [begin, end), (B, H) float32: a last-token read
        passes the positions down (the read layer's MLP then runs on those tokens alone)."""
        if pooling == "last":
            return self._layers(ids, start, idx, kv, last=end - 1).float()
        return self._pool(self._layers(ids, start, idx, kv), begin, end, pooling)

    def _weights_version(self) -> int:
        """Changes whenever a parameter is modified in place (optimizer steps, load_state_dict), so a
        learner-shared model never reads prefix KV computed with older weights. Frozen engines: 0."""
        if not self._weight_update:
            return 0
        return sum(p._version for p in self._lm.parameters())

    def _prefix_kv(self, prefix: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k, v) of the prefix, (1, Hkv, P, d) each, RoPE'd at positions 0..P-1; cached."""
        key = (self._weights_version(), *prefix)
        if key in self._prefix_cache:
            self._prefix_cache.move_to_end(key)
            return self._prefix_cache[key]
        from transformers import DynamicCache

        cache = DynamicCache(config=self._lm.config)
        ids = torch.tensor([prefix], dtype=torch.long, device=self.device)
        self._dec(input_ids=ids, use_cache=True, **{self._cache_kw: cache})
        if hasattr(cache, "layers"):
            kv = [(layer.keys, layer.values) for layer in cache.layers]
        else:  # transformers 4.x
            kv = list(zip(cache.key_cache, cache.value_cache))
        self._prefix_cache[key] = kv
        while len(self._prefix_cache) > self._prefix_cache_size:
            self._prefix_cache.popitem(last=False)
        return kv

    def _pooled_cascade(
        self, items: list[list[int]], p: int, kv: list, idx: int, pooling: str
    ) -> torch.Tensor:
        ids, _ = self._pad(items, "right")
        end = torch.tensor([len(it) for it in items], device=self.device)
        return self._layers_pooled(ids, torch.tensor([p], device=self.device), idx, kv, torch.zeros_like(end), end, pooling)

    # --- generation -----------------------------------------------------------------------------------------

    def generate(self, batch: Batch, sampling: SamplingParams) -> list[Completion]:
        """Completions item-major (item0 × n, item1 × n, ...). Prompt = prefix + item token ids."""
        if sampling.n < 1 or sampling.max_new_tokens < 1:
            raise UserError("sampling.n and sampling.max_new_tokens must be ≥ 1")
        if sampling.thinking_budget is not None and (self.think_open_id is None or self.think_close_id is None):
            raise EngineCapabilityError("thinking_budget needs a model whose tokenizer has <think> and </think> tokens")
        prefix, items = self.tokenize_batch(batch)
        prompts = [prefix + it for it in items for _ in range(sampling.n)]
        if any(len(p) == 0 for p in prompts):
            raise UserError("every prompt needs at least one token")
        gen = None
        if sampling.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(sampling.seed))
        # A shared prefix is prefilled once (batch 1, cached like the hidden-states prefix KV) and copied
        # into each row's cache; only the suffixes are prefilled per row.
        prefix_len = len(prefix) if self.prefix_reuse and prefix and all(len(it) > 0 for it in items) else 0
        out: list[Completion] = []
        self.last_generate_timing = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
        # decode steps read the KV cache once, GQA heads folded (sdpa would copy it 4x for the padding mask)
        with self._inference(), self._autocast_embeddings(), self._attn_impl(self._decode_name):
            for a in range(0, len(prompts), self.max_batch_size):
                out.extend(self._generate_chunk(prompts[a : a + self.max_batch_size], sampling, gen, prefix_len))
        return out

    def _model_forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any, decode: bool) -> torch.Tensor:
        kwargs = {self._cache_kw: cache}
        fwd = self._lm.forward
        if decode and self.compile_decode:
            if self._compiled_forward is None:
                self._compiled_forward = torch.compile(self._lm.forward, mode="reduce-overhead", fullgraph=False)
            fwd = self._compiled_forward
        out = fwd(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[:, -1, :].float()

    def _choose(
        self, logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token (B,), full log-softmax (B, V)) — logprobs are under the unmodified softmax."""
        logp = torch.log_softmax(logits, dim=-1)
        if sampling.temperature <= 0:
            return logits.argmax(-1), logp
        z = logits / sampling.temperature
        if sampling.top_p < 1.0:
            z = top_p_filter(z, sampling.top_p)
        probs = torch.softmax(z, dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1), logp

    def _clock(self) -> float:
        """Wall time after the device finished its queued work (one sync per phase, not per step)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _generate_chunk(
        self, prompts: list[list[int]], sampling: SamplingParams, gen: torch.Generator | None, prefix_len: int = 0
    ) -> list[Completion]:
        """Decode one batch. Row layout: [left pads][prompt], or with a reused prefix of `prefix_len`
        tokens [prefix][pads][suffix] (pads masked, positions contiguous over real tokens either way)."""
        from transformers import DynamicCache, StaticCache

        b = len(prompts)
        new = sampling.max_new_tokens
        p = prefix_len
        if p:
            ids, smask = self._pad([q[p:] for q in prompts], "left")
            mask = torch.cat([torch.ones((b, p), dtype=torch.long, device=self.device), smask], 1)
        else:
            ids, mask = self._pad(prompts, "left")
        if self.kv_cache == "static":
            # Round the prompt width up (extra left pads, masked) so that batches of slightly different
            # prompt lengths share one static cache shape: no recompile / CUDA-graph re-capture per call.
            extra = (-mask.shape[1]) % _STATIC_PROMPT_BUCKET
            if extra:
                ids = torch.cat([torch.full((b, extra), self.pad_id, dtype=ids.dtype, device=ids.device), ids], 1)
                zeros = torch.zeros((b, extra), dtype=mask.dtype, device=mask.device)
                mask = torch.cat([mask[:, :p], zeros, mask[:, p:]], 1)
        t = mask.shape[1]
        states = [_SeqState(prompt=p) for p in prompts]
        budget = sampling.thinking_budget
        # Stop strings and the thinking budget need per-sequence host logic every step; without them the
        # loop stays on the device (no per-step sync, EOS handled by a mask) so the GPU can run ahead.
        host = budget is not None or bool(sampling.stop)
        close_ids = self._encode(self.thinking_close_text, first=False) if budget is not None else []
        if budget is not None:
            for st in states:
                st.in_think = _last_index(st.prompt, self.think_open_id) > _last_index(st.prompt, self.think_close_id)
        max_stop = max((len(s) for s in sampling.stop), default=0)
        total = t + new
        full_mask = torch.ones((b, total), dtype=torch.long, device=self.device)
        full_mask[:, :t] = mask
        if self.kv_cache == "static":
            if self.compile_decode and self._static_cache is not None and self._static_cache[0] == (b, total):
                # Same buffers as last call: the compiled step's CUDA graphs stay valid (a new cache
                # would mean new static addresses and a re-capture).
                cache = self._static_cache[1]
                cache.reset()
            else:
                cache = StaticCache(config=self._lm.config, max_cache_len=total)
                if self.compile_decode:
                    self._static_cache = ((b, total), cache)
            # Fixed-shape mask over the whole cache: left pads 0, everything else 1 (causality hides the
            # future), so the decode step's inputs never change shape (CUDA-graph friendly).
            step_mask = lambda n: full_mask  # noqa: E731
        else:
            cache = DynamicCache(config=self._lm.config)
            step_mask = lambda n: full_mask[:, :n]  # noqa: E731
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, p:]
        t0 = self._clock()
        if p:
            for i, (pk, pv) in enumerate(self._prefix_kv(prompts[0][:p])):
                cache.update(pk.expand(b, -1, -1, -1).contiguous(), pv.expand(b, -1, -1, -1).contiguous(), i)
        logits = self._model_forward(ids, step_mask(t), pos, cache, decode=False)
        t1 = self._clock()
        next_pos = pos[:, -1:] + 1
        toks = torch.full((b, new), self.pad_id, dtype=torch.long, device=self.device)
        lps = torch.zeros((b, new), dtype=torch.float32, device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        eos = torch.tensor(sorted(self.eos_ids) or [-1], device=self.device)
        steps = 0
        guide = start_guide(sampling, self.tokenizer, self.eos_ids, logits)  # structured outputs (constrained.py)
        for step in range(new):
            if guide is not None:  # structured outputs: mask disallowed tokens, then sample
                tok, logp = guide.choose(logits, lambda z: self._choose(z, sampling, gen), sampling.logprobs)
            else:
                tok, logp = self._choose(logits, sampling, gen)
            if host:  # one device->host copy per step, edited on the host, copied back
                tok_list = tok.tolist()
                self._host_step(states, tok_list, budget, close_ids)
                tok = torch.tensor(tok_list, dtype=torch.long, device=self.device)
            else:
                tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            toks[:, step] = tok
            if guide is not None:  # structured outputs: matchers accept the tokens (before the next forward)
                guide.advance(tok)
                if guide.finished:  # every answer ended by the previous step: this one is all padding
                    break
            if sampling.logprobs:
                lps[:, step] = logp.gather(1, tok[:, None]).squeeze(1)
            steps = step + 1
            if host:
                self._host_after(states, tok_list, budget, sampling.stop, max_stop)
                if all(st.done for st in states):
                    break
            else:
                done = done | torch.isin(tok, eos)
                if step % 16 == 15 and bool(done.all()):
                    break
            if step == new - 1:
                break
            # the cache holds t + step tokens; this step adds one
            logits = self._model_forward(tok[:, None], step_mask(t + step + 1), next_pos, cache, decode=True)
            next_pos = next_pos + 1
        toks_host = toks[:, :steps].tolist()
        t2 = self._clock()
        timing = self.last_generate_timing
        timing["prefill_s"] += t1 - t0
        timing["decode_s"] += t2 - t1
        timing["decode_steps"] += steps
        lps_host = lps[:, :steps].tolist() if sampling.logprobs else None
        for i, st in enumerate(states):
            if host:
                n = len(st.tokens)
            else:
                row = toks_host[i]
                n = next((j + 1 for j, x in enumerate(row) if x in self.eos_ids), len(row))
                st.tokens = row[:n]
                st.finish = "stop" if n < len(row) or (row and row[n - 1] in self.eos_ids) else "length"
            st.logprobs = lps_host[i][:n] if lps_host is not None else []
        return [self._finish(st, sampling) for st in states]

    def _host_step(self, states: list[_SeqState], tok: list[int], budget: int | None, close_ids: list[int]) -> None:
        """Before a step's tokens are recorded: pad finished rows, force the thinking-close tokens."""
        for i, st in enumerate(states):
            if st.done:
                tok[i] = self.pad_id
                continue
            if budget is not None and st.in_think and not st.queue and st.thinking_tokens >= budget:
                st.queue = list(close_ids)
                st.in_think = False
                st.think_truncated = True
            if st.queue:
                tok[i] = st.queue.pop(0)
                st.forced.append(len(st.tokens))

    def _host_after(
        self, states: list[_SeqState], tok_host: list[int], budget: int | None, stop: Sequence[str], max_stop: int
    ) -> None:
        """After a step: record tokens, count thinking tokens, detect EOS and stop strings."""
        for i, st in enumerate(states):
            if st.done:
                continue
            x = tok_host[i]
            forced = bool(st.forced) and st.forced[-1] == len(st.tokens)
            st.tokens.append(x)
            if budget is not None and not forced:
                if x == self.think_open_id:
                    st.in_think = True
                elif x == self.think_close_id:
                    st.in_think = False
                elif st.in_think:
                    st.thinking_tokens += 1
            if x in self.eos_ids and not st.queue:
                st.done, st.finish = True, "stop"
            elif max_stop and not st.queue:
                tail = self.tokenizer.decode(st.tokens[-(max_stop + 1) :], skip_special_tokens=True)
                if any(s in tail for s in stop):
                    st.done, st.finish = True, "stop"

    def _finish(self, st: _SeqState, sampling: SamplingParams) -> Completion:
        text = self.tokenizer.decode(st.tokens, skip_special_tokens=True)
        cut = [text.find(s) for s in sampling.stop if s and s in text]
        if cut:
            text = text[: min(cut)]
        finish = st.finish
        if finish != "length" and st.think_truncated:
            finish = "budget"
        return Completion(
            token_ids=list(st.tokens),
            text=text,
            logprobs=list(st.logprobs) if sampling.logprobs else None,
            finish_reason=finish,
            prompt_token_ids=list(st.prompt),
            thinking_tokens=st.thinking_tokens,
            forced_token_indices=list(st.forced),
        )


def _call_layer(
    layer: torch.nn.Module, h: torch.Tensor, pos: torch.Tensor, pe: Any, prefix_kv: Any, last: torch.Tensor | None = None
) -> torch.Tensor:
    """One decoder layer, no mask (causal), optionally attending to a shared prefix's (k, v).

    With `last` ((B,) position per row; only for `splits_at_mlp` layers) only those tokens come out, (B, H):
    the attention half runs on every token (its keys and values are what the kept tokens read), the MLP on
    the kept ones alone - a pooled read of the final layer skips ~3/4 of that layer's matmuls."""
    extra = {PREFIX_KV_KWARG: prefix_kv} if prefix_kv is not None else {}
    if last is None:
        o = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe, **extra)
        return o[0] if isinstance(o, tuple) else o
    a = layer.self_attn(hidden_states=layer.input_layernorm(h), attention_mask=None, position_ids=pos,
                        position_embeddings=pe, **extra)[0]
    x = take_rows(h, last) + take_rows(a, last)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def take_rows(h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(B, T, H) -> (B, H): row b's hidden state at position pos[b]."""
    return h[torch.arange(h.shape[0], device=h.device), pos]


def splits_at_mlp(layer: torch.nn.Module) -> bool:
    """Is this decoder layer the pre-norm `h + attn(norm(h))`, then `h + mlp(norm(h))` block (Llama, Qwen2/3,
    Mistral, SmolLM) that `_call_layer(last=...)` re-implements? Judged by its exact set of sub-modules:
    layers with other norms or residual paths (Gemma, OLMo2, Cohere, Phi-3) keep the full path."""
    return {n for n, _ in layer.named_children()} == {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}


class _CompiledLayer:
    """`_call_layer` through torch.compile (dynamic shapes; the layer's weights are graph inputs, so one
    compiled graph serves every layer). Falls back to eager, once and with a warning, if compiling fails
    (no Triton / no C++ compiler)."""

    def __init__(self) -> None:
        self._fn: Any = torch.compile(_call_layer, dynamic=True)
        self._failed = False

    def __call__(self, *args: Any) -> torch.Tensor:
        if not self._failed:
            try:
                return self._fn(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: eager is always correct
                self._failed = True
                log.warning("compiled prefill unavailable (%s); running eager", e)
        return _call_layer(*args)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of tokens whose probability reaches top_p (the most
    likely token is always kept); the rest get -inf."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    drop_sorted = before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _last_index(seq: Sequence[int], x: int | None) -> int:
    if x is None:
        return -1
    for i in range(len(seq) - 1, -1, -1):
        if seq[i] == x:
            return i
    return -1
