"""Engines by spec string, parsed in one place (`parse_spec`):

    hf:<path-or-default>          in-process transformers (options: device=, dtype=, max_batch_tokens=,
                                  kv_cache=, compile_decode=, compile_prefill=, prefix_reuse=,
                                  sm_limit=, chunk_overhead_tokens=, quantize=, random_weights=<seed>
                                  (same architecture + tokenizer, re-initialised weights), ...); `hf` = hf:default
    vllm:<path>                   vLLM in-process (optional extra; options: ServingOptions fields)
    sglang+http://host:port       SGLang server (options: HTTPOptions fields); https too
    openai+http://host:port/v1    any OpenAI-compatible endpoint, generation only (options: model=, HTTPOptions fields)
    auto:<path-or-default>        vllm:<folder> when vLLM is installed and CUDA is present, else hf:<model>
    random:<shape>                random weights in a named shape (`train llm-policy --model`; not an engine)

<path-or-default> is `default` (the bundled SmolLM2-135M-Instruct), a local HF folder or a .gguf file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Collection, Literal

from thinkcraft.llm.protocol import Engine
from thinkcraft.utils.errors import UserError

Scheme = Literal["hf", "vllm", "sglang", "openai", "auto", "random"]

FORMS: dict[str, str] = {
    "hf": "hf:<path-or-default>", "vllm": "vllm:<path>", "sglang": "sglang+http://host:port",
    "openai": "openai+http://host:port/v1", "auto": "auto:<path-or-default>", "random": "random:<shape>",
}
SPEC_FORMS = ", ".join(FORMS.values())

_HTTP_SCHEMES = ("sglang", "openai")
_MODEL_SCHEMES = ("hf", "auto")  # the target defaults to the bundled model


@dataclass(frozen=True)
class EngineSpec:
    """A parsed engine spec."""

    scheme: Scheme
    target: str
    """hf / auto: the model (`default`, a folder, a .gguf); vllm: the model path; sglang / openai: the base URL
    (http[s]://...); random: the shape name."""

    @property
    def is_http(self) -> bool:
        return self.scheme in _HTTP_SCHEMES

    @property
    def model(self) -> str:
        """What names the model (greedy answers depend on it alone): the target of an in-process spec, the
        whole spec of a server (the served model is the server's)."""
        return str(self) if self.is_http else self.target

    def __str__(self) -> str:
        return f"{self.scheme}+{self.target}" if self.is_http else f"{self.scheme}:{self.target}"


def parse_spec(spec: str, bare: Scheme | None = None, allowed: Collection[Scheme] | None = None) -> EngineSpec:
    """`spec` -> EngineSpec, or a UserError that says what is wrong and which forms exist. `bare`: the scheme
    of a spec without one (`default`, a folder: `bare="hf"`); None rejects those. `allowed`: the schemes this
    caller accepts (None: all)."""
    s = spec.strip()
    if not s:
        raise UserError(f"empty engine spec; expected one of: {SPEC_FORMS}")
    es = _parse(s, bare)
    if allowed is not None and es.scheme not in allowed:
        raise UserError(f"engine spec {spec!r}: {es.scheme} is not accepted here; use "
                        f"{' or '.join(FORMS[a] for a in allowed)}")
    return es


def _parse(s: str, bare: Scheme | None) -> EngineSpec:
    if s in _MODEL_SCHEMES:  # `hf`, `auto`: the bundled model
        return EngineSpec(s, "default")  # type: ignore[arg-type]
    for scheme in _HTTP_SCHEMES:
        if s.startswith(f"{scheme}+"):
            url = s[len(scheme) + 1 :]
            if not re.match(r"https?://[^/\s]+", url):
                raise UserError(f"engine spec {s!r} needs a server URL: {FORMS[scheme]} (or https://)")
            return EngineSpec(scheme, url)  # type: ignore[arg-type]
    m = re.match(r"([A-Za-z][A-Za-z0-9_+.-]*):(.*)$", s)
    name, rest = (m.group(1), m.group(2)) if m else ("", s)
    if name in FORMS and name not in _HTTP_SCHEMES:
        if name in _MODEL_SCHEMES:
            return EngineSpec(name, rest or "default")  # type: ignore[arg-type]
        if not rest:
            raise UserError(f"engine spec {s!r} needs a {'model path' if name == 'vllm' else 'shape'}: {FORMS[name]}")
        return EngineSpec(name, rest)  # type: ignore[arg-type]
    if name in _HTTP_SCHEMES or name in ("http", "https"):
        hint = s if name in ("http", "https") else rest.lstrip("/")
        raise UserError(f"engine spec {s!r}: a server is named by its URL after the client, e.g. "
                        f"openai+http://{hint.split('://')[-1]} or sglang+http://{hint.split('://')[-1]}")
    if name or bare is None:
        raise UserError(f"unknown engine spec {s!r}; expected one of: {SPEC_FORMS}")
    return EngineSpec(bare, s)


def resolve_auto(spec: EngineSpec) -> EngineSpec:
    """`auto:<model>` -> `vllm:<folder>` when vLLM is installed and CUDA is present, else `hf:<model>`; any
    other spec as it is."""
    if spec.scheme != "auto":
        return spec
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        import torch

        if torch.cuda.is_available():
            from thinkcraft.llm.models import resolve_model

            return EngineSpec("vllm", str(resolve_model(spec.target)))
    return EngineSpec("hf", spec.target)


def make_engine(spec: str | EngineSpec, **options: Any) -> Engine:
    es = resolve_auto(spec if isinstance(spec, EngineSpec) else parse_spec(spec))
    if es.scheme == "hf":
        from thinkcraft.llm.hf import HFEngine

        return HFEngine(es.target, **options)
    if es.scheme == "vllm":
        from thinkcraft.llm.vllm_engine import VLLMEngine

        return VLLMEngine(es.target, **options)
    if es.scheme == "sglang":
        from thinkcraft.llm.clients import SGLangEngine

        _need("httpx", "sglang+http engines")
        return SGLangEngine(es.target, **options)
    if es.scheme == "openai":
        from thinkcraft.llm.clients import OpenAIEngine

        _need("httpx", "openai+http engines")
        return OpenAIEngine(es.target, **options)
    raise UserError(f"{es} names random weights for `train llm-policy --model` (a BPE tokenizer trained on the "
                    f"env's prompts), not an engine; engines: {', '.join(FORMS[s] for s in FORMS if s != 'random')}")


def _need(module: str, what: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UserError(f"{what} need `{module}`: pip install {module}")
