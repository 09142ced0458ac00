"""Serving options passed through to the real engines (vLLM, SGLang), in one documented place.

| option | vLLM (`LLM(...)` / `vllm serve`) | SGLang (`python -m sglang.launch_server`) |
|---|---|---|
| `prefix_caching` | `enable_prefix_caching` / `--enable-prefix-caching` | on by default (RadixAttention); off: `--disable-radix-cache` |
| `speculative_model` + `speculative_num_tokens` (EAGLE-3 draft) | `speculative_config={"method": "eagle3", "model": M, "num_speculative_tokens": K}` | `--speculative-algorithm EAGLE3 --speculative-draft-model-path M --speculative-num-draft-tokens K` |
| `quantization` ("fp8", "awq") | `quantization=` / `--quantization` | `--quantization` |
| `memory_fraction` | `gpu_memory_utilization` / `--gpu-memory-utilization` | `--mem-fraction-static` |
| `tensor_parallel` | `tensor_parallel_size` / `--tensor-parallel-size` | `--tp-size` |

The in-process `hf` engine has its own prefix reuse (cascade attention) and ignores the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from thinkcraft.utils.errors import check


@dataclass(frozen=True)
class ServingOptions:
    prefix_caching: bool = True
    """Reuse the KV of shared prompt prefixes across requests."""
    speculative_model: str | None = None
    """EAGLE-3 draft model (local path) for speculative decoding; None = off."""
    speculative_num_tokens: int = 3
    """Draft tokens proposed per step when speculative decoding is on."""
    quantization: str | None = None
    """Weight quantization: "fp8" or "awq" (None = the checkpoint's dtype)."""
    memory_fraction: float = 0.85
    """Fraction of GPU memory the engine may take (weights + KV cache); leave room for JAX."""
    tensor_parallel: int = 1
    """GPUs to shard the model over."""

    def __post_init__(self) -> None:
        check(self.quantization in (None, "fp8", "awq"), "quantization", "must be fp8, awq or unset")
        check(0.05 <= self.memory_fraction <= 0.99, "memory_fraction", "must be in [0.05, 0.99]")
        check(self.tensor_parallel >= 1, "tensor_parallel", "must be ≥ 1")
        check(self.speculative_num_tokens >= 1, "speculative_num_tokens", "must be ≥ 1")


def vllm_llm_kwargs(model: str, o: ServingOptions) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM(...)`."""
    kw: dict[str, Any] = {
        "model": model, "enable_prefix_caching": o.prefix_caching,
        "gpu_memory_utilization": o.memory_fraction, "tensor_parallel_size": o.tensor_parallel,
    }
    if o.quantization:
        kw["quantization"] = o.quantization
    if o.speculative_model:
        kw["speculative_config"] = {
            "method": "eagle3", "model": o.speculative_model, "num_speculative_tokens": o.speculative_num_tokens,
        }
    return kw


def vllm_serve_args(model: str, o: ServingOptions, port: int = 8000) -> list[str]:
    """argv of `vllm serve` with these options."""
    import json

    args = ["vllm", "serve", model, "--port", str(port), "--gpu-memory-utilization", str(o.memory_fraction),
            "--tensor-parallel-size", str(o.tensor_parallel)]
    args.append("--enable-prefix-caching" if o.prefix_caching else "--no-enable-prefix-caching")
    if o.quantization:
        args += ["--quantization", o.quantization]
    if o.speculative_model:
        spec = {"method": "eagle3", "model": o.speculative_model, "num_speculative_tokens": o.speculative_num_tokens}
        args += ["--speculative-config", json.dumps(spec)]
    return args


def sglang_server_args(model: str, o: ServingOptions, port: int = 30000, hidden_states: bool = True) -> list[str]:
    """argv of `python -m sglang.launch_server` with these options."""
    args = ["python", "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
            "--mem-fraction-static", str(o.memory_fraction), "--tp-size", str(o.tensor_parallel)]
    if not o.prefix_caching:
        args.append("--disable-radix-cache")
    if hidden_states:
        args.append("--enable-return-hidden-states")
    if o.quantization:
        args += ["--quantization", o.quantization]
    if o.speculative_model:
        args += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", o.speculative_model,
                 "--speculative-num-draft-tokens", str(o.speculative_num_tokens)]
    return args
