"""`vllm:<path>` — vLLM in-process (optional extra: `pip install 'thinkcraft[vllm]'`).

Generation through `vllm.LLM.generate`; hidden states through a second `LLM` in the pooling runner
(`runner="pooling"`, last-token or mean pooling, no normalisation), created on first use. Serving options
(prefix caching, EAGLE-3 speculative decoding, fp8/awq, memory fraction, tensor parallelism) pass through
from `ServingOptions` (see `thinkcraft.llm.options`). Not exercised in CI (no vLLM on CPU runners).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from thinkcraft.llm.options import ServingOptions, vllm_llm_kwargs
from thinkcraft.llm.protocol import Batch, Capabilities, Completion, EngineCapabilityError, SamplingParams
from thinkcraft.utils.errors import UserError


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise UserError(
            "the vllm engine needs vLLM: pip install 'thinkcraft[vllm]' (GPU machines only); "
            "or serve the model elsewhere and use openai+http://host:port/v1"
        ) from e
    return vllm


class VLLMEngine:
    def __init__(self, model: str, options: ServingOptions | None = None, **option_fields: Any) -> None:
        from thinkcraft.llm.models import resolve_model

        self.vllm = _import_vllm()
        self.path = str(resolve_model(model))
        self.options = options or ServingOptions(**option_fields)
        self.llm = self.vllm.LLM(**vllm_llm_kwargs(self.path, self.options))
        self._pooler: dict[str, Any] = {}

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(hidden_states=True, generate=True, logprobs=True, prefix_reuse=self.options.prefix_caching,
                            token_ids_in=True, token_ids_out=True)

    def _prompts(self, batch: Batch) -> list[Any]:
        if batch.is_tokens:
            pre = list(batch.prefix or [])
            return [{"prompt_token_ids": pre + list(it)} for it in batch.items]
        return [(batch.prefix or "") + it for it in batch.items]

    def generate(self, batch: Batch, sampling: SamplingParams) -> list[Completion]:
        if sampling.thinking_budget is not None:
            raise EngineCapabilityError("thinking_budget is implemented by the hf engine only")
        sp = self.vllm.SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens,
            stop=list(sampling.stop) or None, seed=sampling.seed, logprobs=0 if sampling.logprobs else None,
            **structured_kwargs(self.vllm, sampling),
        )
        out = []
        for r in self.llm.generate(self._prompts(batch), sp):
            for o in r.outputs:
                lps = None
                if sampling.logprobs and o.logprobs is not None:
                    lps = [float(step[t].logprob) for step, t in zip(o.logprobs, o.token_ids)]
                out.append(Completion(
                    token_ids=list(o.token_ids), text=o.text, logprobs=lps,
                    finish_reason="length" if o.finish_reason == "length" else "stop",
                    prompt_token_ids=list(r.prompt_token_ids or []),
                ))
        return out

    def hidden_states(self, batch: Batch, layer: int = -1, pooling: Literal["last", "mean"] = "last") -> np.ndarray:
        if layer != -1:
            raise EngineCapabilityError("vLLM's pooling runner returns the last layer only (layer=-1)")
        if pooling not in self._pooler:
            # A pooling-runner LLM sharing the GPU with the generation one: give it a slice of memory.
            kw = vllm_llm_kwargs(self.path, self.options)
            kw["gpu_memory_utilization"] = max(0.05, min(0.3, 1.0 - self.options.memory_fraction))
            kw["runner"] = "pooling"
            kw["override_pooler_config"] = {"pooling_type": pooling.upper(), "normalize": False}
            self._pooler[pooling] = self.vllm.LLM(**kw)
        outs = self._pooler[pooling].embed(self._prompts(batch))
        return np.stack([np.asarray(o.outputs.embedding, dtype=np.float32) for o in outs])

    def close(self) -> None:
        self._pooler.clear()
        self.llm = None


def structured_kwargs(vllm: Any, sampling: SamplingParams) -> dict[str, Any]:
    """`SamplingParams.structured` as vLLM's own structured outputs (xgrammar / guidance inside vLLM):
    `structured_outputs=StructuredOutputsParams(json=...)` (vLLM >= 0.10.2; the only form from 0.12), else the
    older `guided_decoding=GuidedDecodingParams(json=...)`. vLLM reports the model's log-probs, never those of
    the constrained distribution: a request for "constrained" log-probs is refused (the hf engine has them)."""
    st = sampling.structured
    if st is None:
        return {}
    if st.logprobs == "constrained" and sampling.logprobs:
        raise EngineCapabilityError("vLLM reports the model's log-probs, not the constrained distribution's "
                                    "(StructuredOutput.logprobs='constrained'): use the hf engine")
    params = getattr(vllm, "sampling_params", None)
    if hasattr(params, "StructuredOutputsParams"):
        return {"structured_outputs": params.StructuredOutputsParams(json=st.json_schema)}
    if hasattr(params, "GuidedDecodingParams"):
        return {"guided_decoding": params.GuidedDecodingParams(json=st.json_schema)}
    raise EngineCapabilityError(f"this vLLM ({getattr(vllm, '__version__', '?')}) has no structured outputs; "
                                "upgrade vLLM or use the hf engine")
