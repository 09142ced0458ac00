"""Engines by spec string:

    hf:<path-or-default>          in-process transformers (options: device=, dtype=, max_batch_tokens=,
                                  kv_cache=, compile_decode=, compile_prefill=, prefix_reuse=,
                                  sm_limit=, chunk_overhead_tokens=, quantize=, ...)
    vllm:<path>                   vLLM in-process (optional extra; options: ServingOptions fields)
    sglang+http://host:port       SGLang server (options: HTTPOptions fields)
    openai+http://host:port/v1    any OpenAI-compatible endpoint, generation only (options: model=, HTTPOptions fields)
"""

from __future__ import annotations

from typing import Any

from thinkcraft.llm.protocol import Engine
from thinkcraft.utils.errors import UserError

SPEC_FORMS = "hf:<path-or-default>, vllm:<path>, sglang+http://host:port, openai+http://host:port/v1"


def make_engine(spec: str, **options: Any) -> Engine:
    s = spec.strip()
    if s == "hf" or s.startswith("hf:"):
        from thinkcraft.llm.hf import HFEngine

        return HFEngine(s[3:] or "default", **options)
    if s.startswith("vllm:"):
        from thinkcraft.llm.vllm_engine import VLLMEngine

        if not s[5:]:
            raise UserError(f"engine spec {spec!r} needs a model path: vllm:<path>")
        return VLLMEngine(s[5:], **options)
    if s.startswith(("sglang+http://", "sglang+https://")):
        from thinkcraft.llm.clients import SGLangEngine

        _need("httpx", "sglang+http engines")
        return SGLangEngine(s[len("sglang+"):], **options)
    if s.startswith(("openai+http://", "openai+https://")):
        from thinkcraft.llm.clients import OpenAIEngine

        _need("httpx", "openai+http engines")
        return OpenAIEngine(s[len("openai+"):], **options)
    raise UserError(f"unknown engine spec {spec!r}; expected one of: {SPEC_FORMS}")


def _need(module: str, what: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UserError(f"{what} need `{module}`: pip install {module}")
