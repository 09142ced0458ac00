"""The `HFEngine` façade: construction, capabilities, tokenization, chat template, the SM limit, and the
contexts every call runs in (no grad / eval mode on the SM partition's stream, embeddings cast under
autocast, a swapped attention function). Hidden states live in `prefill.py`, generation in `decode.py`
(mixed in here); reaches into transformers/torch internals in `thinkcraft.llm.compat`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Literal, Sequence

import torch

from thinkcraft.llm import compat
from thinkcraft.llm.batching import encode_text, pad_rows, tokenize_batch
from thinkcraft.llm.hf import fused_mlp, fused_proj, fused_rope, lora_fast
from thinkcraft.llm.hf.triton_device import runs_on
from thinkcraft.llm.hf.decode import DecodeMixin
from thinkcraft.llm.hf.prefill import PrefillMixin
from thinkcraft.llm.protocol import Batch, Capabilities
from thinkcraft.llm.sm_partition import SMPartition
from thinkcraft.utils.errors import UserError


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM under a PEFT wrapper (LoRA layers are injected in place, so it includes them)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def random_init_model(path: Any, seed: int, dtype: torch.dtype = torch.float32, **kwargs: Any) -> torch.nn.Module:
    """The causal LM of the HF folder `path` (its config: same architecture and shapes) with weights drawn
    by the model's own initialiser (transformers' `_init_weights`: e.g. normal(0, initializer_range) for
    Llama), seeded: the same seed gives the same weights on any device (drawn on the CPU, in float32, then
    cast). The torch global RNG is left as it was."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserError(f"random_weights must be an integer seed, got {seed!r}")
    config = AutoConfig.from_pretrained(str(path))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    return lm.to(dtype)


class HFEngine(PrefillMixin, DecodeMixin):
    """In-process transformers engine (see the package docstring). Hidden states: `PrefillMixin`;
    generation: `DecodeMixin`; both read the model facts `_setup` records here.

    Generation options: `kv_cache` "static" (the decode step reads the whole slot: one shape) or "dynamic" (a
    bucket of the longest running sequence); `compile_decode` (torch.compile of the one-token step, CUDA graphs
    on a GPU); `max_slots` (sequences decoded at once; default `max_batch_size`), `max_seq_len` (KV columns one
    sequence may use after its shared prefix; None: unbounded, a longer request is a clear error otherwise),
    `kv_cache_gb` (the slots' memory budget; default half the free GPU memory at the first allocation, unbounded on
    CPU), `evict` ("oldest" / "longest": which parked episode's KV goes when a request needs its slot)."""

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
        max_slots: int | None = None,
        max_seq_len: int | None = None,
        evict: Literal["oldest", "longest"] = "oldest",
        kv_cache_gb: float | None = None,
        random_weights: int | None = None,
    ) -> None:
        """`random_weights`: a seed - the model's architecture and tokenizer with freshly initialised weights
        (a control with no pretrained knowledge; see `random_init_model`)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from thinkcraft.llm.models import resolve_model

        path = resolve_model(model)
        dev = torch.device(device) if device is not None else _default_device()
        if dtype is None:
            dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
        else:
            dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        tok = AutoTokenizer.from_pretrained(str(path))
        if random_weights is None:
            lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt, attn_implementation=attn_implementation)
        else:
            lm = random_init_model(path, random_weights, dtype=dt, attn_implementation=attn_implementation)
        lm.to(dev).eval()
        lm.requires_grad_(False)
        self._setup(
            lm, tok, max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size, prefix_reuse=prefix_reuse,
            prefix_cache_size=prefix_cache_size, kv_cache=kv_cache, compile_decode=compile_decode,
            thinking_close_text=thinking_close_text, weight_update=False, compile_prefill=compile_prefill,
            sm_limit=sm_limit, chunk_overhead_tokens=chunk_overhead_tokens, quantize=quantize,
            max_slots=max_slots, max_seq_len=max_seq_len, evict=evict, kv_cache_gb=kv_cache_gb,
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
        max_slots: int | None = None,
        max_seq_len: int | None = None,
        evict: str = "oldest",
        kv_cache_gb: float | None = None,
    ) -> None:
        """Model facts, then the prefill's and the decode's own state (each mixin's `_init_*`)."""
        if kv_cache not in ("dynamic", "static"):
            raise UserError(f"kv_cache must be 'dynamic' or 'static', got {kv_cache!r}")
        if quantize not in ("none", "fp8"):
            raise UserError(f"quantize must be 'none' or 'fp8', got {quantize!r}")
        if chunk_overhead_tokens < 0:
            raise UserError(f"chunk_overhead_tokens must be >= 0, got {chunk_overhead_tokens}")
        self.model = model
        self.tokenizer = tokenizer
        self._lm = _unwrap(model)
        self._dec = compat.decoder_of(self._lm)
        compat.fx_patches_per_thread()  # engines compile in their own threads beside others' eager forwards
        # a learner's bf16 LoRA model: no-grad forwards without PEFT's dtype casts (lora_fast says why)
        self._lora_fast = lora_fast.install(model)
        # PEFT's LoRA layers, whose adapter switch (`disable_adapter()`: the adapter-off judge) a replayed decode
        # graph cannot see: the hand-captured step keys its graphs on it (cache.py)
        self._lora_layers = lora_fast.lora_layers(model)
        p = next(self._lm.parameters())
        self.device = p.device
        self.dtype = p.dtype
        cfg = compat.text_config(self._lm)
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self._sm: SMPartition | None = None
        self.set_sm_limit(sm_limit)
        self._weight_update = weight_update
        self._embed_hook: Any = None  # see _autocast_embeddings
        self._embed_cast: torch.dtype | None = None
        self._cache_kw = compat.cache_kwarg(self._dec)
        self._attn_configs = compat.attention_configs(self._dec)
        # pad with the pad token if there is one, else EOS (pads are never attended nor gathered)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self._init_prefill(max_batch_tokens, max_batch_size, prefix_reuse, prefix_cache_size, compile_prefill,
                           chunk_overhead_tokens, quantize)
        self._init_decode(kv_cache, compile_decode, thinking_close_text, max_slots, max_seq_len, evict, kv_cache_gb)
        # q/k/v and gate/up as one GEMM each in no-grad forwards, LoRA's A inside it, the other adapted linears as
        # groups of one (fused_proj says why); after any quantisation
        self._fused_proj = fused_proj.install(model)
        # and each MLP's silu(gate) * up as one kernel over that group's output in no-grad forwards of any size (the
        # decode graphs capture it; THINKCRAFT_FUSED_MLP=0: torch's ops; fused_mlp says why)
        self._fused_mlps = fused_mlp.install(model) if self._fused_proj and runs_on(self.device) else 0
        if self._fused_mlps:  # its first-use check now, never inside a CUDA-graph capture (the check synchronises)
            fused_mlp.serves(self.device, self.dtype)
            fused_mlp.lora_serves(self.device, self.dtype)  # the LoRA kernel's too (a compiled step reads it)
        # q's and k's rotary embedding as one kernel each in no-grad forwards (fused_rope.py: HF's values
        # bit for bit), where the engine's Triton kernels run; its first-use check now, as the MLP's
        self._fused_ropes = fused_rope.install(model) if runs_on(self.device) else 0
        if self._fused_ropes:
            fused_rope.serves(self.device, self.dtype)

    # --- protocol -------------------------------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            hidden_states=True, generate=True, logprobs=True, prefix_reuse=True,
            weight_update=self._weight_update, hidden_size=self.hidden_size, num_layers=self.num_layers,
            token_ids_in=True, token_ids_out=True, tokenizer=True, device_tensors=True, device=str(self.device),
            per_token_hidden_states=True, sm_partition=self.device.type == "cuda", continuous_batching=True,
            turn_kv_reuse=True, versioned_weights=True,
        )

    def close(self) -> None:
        self._batcher.stop()
        self._batcher.free()
        self._prefix_cache.clear()

    def invalidate_prefix_cache(self) -> None:
        """Forget cached prefix KV (call after changing the weights the engine reads)."""
        self._prefix_cache.clear()

    # --- tokenization -----------------------------------------------------------------------------------

    def _encode(self, text: str, first: bool) -> list[int]:
        return encode_text(self.tokenizer, text, first)

    def tokenize_batch(self, batch: Batch) -> tuple[list[int], list[list[int]]]:
        """(prefix ids, item ids): `batching.tokenize_batch` with this engine's tokenizer."""
        return tokenize_batch(self.tokenizer, batch)

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

    def _pad(self, seqs: Sequence[Sequence[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask) of the rows padded to the longest (`batching.pad_rows`), on the model's device."""
        ids, mask = pad_rows(seqs, side, self.pad_id)
        return torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device)

    # --- SM limit and the per-call contexts -------------------------------------------------------------------

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

    def _attn_impl(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Temporarily switch the attention function of every attention module (`compat`)."""
        return compat.attention_implementation(self._attn_configs, name)
