"""Which engine a `thinkcraft label` run uses: local specs (auto/hf/vllm), HTTP servers as chat endpoints,
the model name its item keys carry, and its tokenizer (read before the model: it decides the prompt format)."""

from __future__ import annotations

from typing import Any

from thinkcraft.utils.errors import ConfigError


def resolve_engine_spec(spec: str) -> str:
    """`auto:<model>` -> `vllm:<folder>` when vLLM is installed and CUDA is present, else `hf:<model>`
    (`llm.registry.resolve_auto`); other specs as they are."""
    from thinkcraft.llm.registry import parse_spec, resolve_auto

    es = parse_spec(spec)
    return str(resolve_auto(es)) if es.scheme == "auto" else spec


def make_local_engine(spec: str) -> Any:
    from thinkcraft.llm import make_engine

    return make_engine(resolve_engine_spec(spec))


def is_http_spec(spec: str) -> bool:
    from thinkcraft.llm.registry import parse_spec

    return parse_spec(spec).is_http


def http_endpoints(spec: str) -> Any:
    """An HTTP engine spec as one chat-completions endpoint: `openai+<base>/v1` as is; `sglang+http://host:port`
    -> its OpenAI-compatible `/v1`. The model name comes from the server's `/models`."""
    import httpx

    from thinkcraft.label.providers import EndpointConfig, EndpointsFile

    base = spec.split("+", 1)[1].rstrip("/")
    if spec.startswith("sglang+") and not base.endswith("/v1"):
        base += "/v1"
    try:
        r = httpx.get(base + "/models", timeout=30.0)
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ConfigError("engine", f"cannot list the models of {base} ({e}); is the server up? "
                          "(or describe it in an --endpoints file)") from None
    return EndpointsFile((EndpointConfig(name="engine", base_url=base, model=model),), model)


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of a local engine spec's model (small and fast: read before the model loads, it decides
    the prompt format and with it the item keys)."""
    from transformers import AutoTokenizer

    from thinkcraft.llm.models import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model_of(resolve_engine_spec(spec)))))


def model_of(spec: str) -> str:
    """`hf:default` / `auto:default` / `vllm:/m/x` -> the model part (greedy answers depend on it alone)."""
    from thinkcraft.llm.registry import parse_spec

    return parse_spec(spec).model
