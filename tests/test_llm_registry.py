"""Engine specs (one parser for every scheme, table-driven: good specs -> fields, bad specs -> the error) and
the engine contract (each engine's declared capabilities, and the methods they promise)."""

from __future__ import annotations

import pytest
import torch

from thinkcraft.llm.protocol import Batch, Capabilities
from thinkcraft.llm.registry import EngineSpec, make_engine, parse_spec, resolve_auto
from thinkcraft.utils.errors import ConfigError, UserError

GOOD = [
    # spec, parse_spec kwargs, scheme, target, str(spec), .model
    ("hf", {}, "hf", "default", "hf:default", "default"),
    ("hf:", {}, "hf", "default", "hf:default", "default"),
    ("  hf:/m/x  ", {}, "hf", "/m/x", "hf:/m/x", "/m/x"),
    ("vllm:/m/x", {}, "vllm", "/m/x", "vllm:/m/x", "/m/x"),
    ("sglang+http://127.0.0.1:30000", {}, "sglang", "http://127.0.0.1:30000", "sglang+http://127.0.0.1:30000",
     "sglang+http://127.0.0.1:30000"),
    ("sglang+https://h.example/x", {}, "sglang", "https://h.example/x", "sglang+https://h.example/x",
     "sglang+https://h.example/x"),
    ("openai+http://h:1/v1", {}, "openai", "http://h:1/v1", "openai+http://h:1/v1", "openai+http://h:1/v1"),
    ("auto", {}, "auto", "default", "auto:default", "default"),
    ("auto:/m/y", {}, "auto", "/m/y", "auto:/m/y", "/m/y"),
    ("random:tiny", {}, "random", "tiny", "random:tiny", "tiny"),
    ("default", {"bare": "hf"}, "hf", "default", "hf:default", "default"),
    ("/models/qwen3-4b", {"bare": "hf"}, "hf", "/models/qwen3-4b", "hf:/models/qwen3-4b", "/models/qwen3-4b"),
    ("random:qwen2.5-0.5b", {"bare": "hf", "allowed": ("hf", "random")}, "random", "qwen2.5-0.5b",
     "random:qwen2.5-0.5b", "qwen2.5-0.5b"),
]

BAD = [
    # spec, parse_spec kwargs, error text
    ("", {}, "empty engine spec; expected one of: hf:<path-or-default>, vllm:<path>"),
    ("vllm:", {}, "needs a model path: vllm:<path>"),
    ("random:", {}, "needs a shape: random:<shape>"),
    ("sglang+http://", {}, "needs a server URL: sglang+http://host:port"),
    ("openai+ftp://h/v1", {}, "needs a server URL: openai+http://host:port/v1"),
    ("sglang:127.0.0.1:30000", {}, "openai+http://127.0.0.1:30000 or sglang+http://127.0.0.1:30000"),
    ("http://h:8000/v1", {}, "a server is named by its URL after the client, e.g. openai+http://h:8000/v1"),
    ("llama:foo", {}, "unknown engine spec 'llama:foo'; expected one of"),
    ("llama:foo", {"bare": "hf"}, "unknown engine spec 'llama:foo'"),
    ("default", {}, "unknown engine spec 'default'"),
    ("vllm:/m", {"bare": "hf", "allowed": ("hf", "random")}, "vllm is not accepted here; use hf:<path-or-default> or random:<shape>"),
]


@pytest.mark.parametrize("spec,kw,scheme,target,text,model", GOOD)
def test_parse_spec_good(spec: str, kw: dict, scheme: str, target: str, text: str, model: str) -> None:
    es = parse_spec(spec, **kw)
    assert (es.scheme, es.target, str(es), es.model) == (scheme, target, text, model)
    assert parse_spec(str(es)) == es  # the canonical form parses back to itself


@pytest.mark.parametrize("spec,kw,error", BAD)
def test_parse_spec_bad(spec: str, kw: dict, error: str) -> None:
    with pytest.raises(UserError) as e:
        parse_spec(spec, **kw)
    assert error in str(e.value), str(e.value)


def test_auto_resolves_to_hf_without_vllm_and_random_is_not_an_engine() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
        assert resolve_auto(parse_spec("auto:/m/x")) == EngineSpec("hf", "/m/x")
    assert resolve_auto(parse_spec("vllm:/m")) == EngineSpec("vllm", "/m")
    with pytest.raises(UserError, match="not an engine"):
        make_engine("random:tiny")


def test_label_and_llm_policy_route_their_specs_through_parse_spec() -> None:
    from thinkcraft.label.engines import model_of as _model_of, resolve_engine_spec
    from thinkcraft.train.llm_policy.config import LLMPolicyConfig

    assert resolve_engine_spec("hf:x") == "hf:x" and _model_of("auto:default") == "default"
    assert _model_of("openai+http://h:1/v1") == "openai+http://h:1/v1"
    with pytest.raises(UserError, match="unknown engine spec"):
        resolve_engine_spec("llama:x")
    assert LLMPolicyConfig(model="random:tiny").model_spec == EngineSpec("random", "tiny")
    assert LLMPolicyConfig(model="default").model_spec == EngineSpec("hf", "default")
    for kw, err in (({"model": "random:huge"}, "--model: unknown shape 'huge'"),
                    ({"model": "vllm:/m"}, "--model: engine spec 'vllm:/m': vllm is not accepted here"),
                    ({"judge_engine": "llama:x"}, "--judge-engine: unknown engine spec 'llama:x'")):
        with pytest.raises(ConfigError) as e:
            LLMPolicyConfig(**kw)
        assert err in str(e.value), str(e.value)


# --- the engine contract --------------------------------------------------------------------------------------

PROMISED = {
    "tokenizer": ("tokenizer", "tokenize_batch", "apply_chat_template"),
    "device_tensors": ("hidden_states_torch",),
    "per_token_hidden_states": ("token_hidden_states",),
    "sm_partition": ("set_sm_limit", "sm_limit"),
    "remote_model_info": ("model_info",),
}


def _check_promises(engine: object) -> Capabilities:
    caps = engine.capabilities  # type: ignore[attr-defined]
    for field, methods in PROMISED.items():
        for m in methods:
            assert hasattr(engine, m) or not getattr(caps, field), f"{type(engine).__name__} declares {field} without {m}"
    return caps


def test_hf_engine_declares_and_keeps_its_capabilities() -> None:
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.testing import tiny_llama

    eng = HFEngine.from_model(*tiny_llama())
    caps = _check_promises(eng)
    assert (caps.hidden_states, caps.generate, caps.logprobs, caps.prefix_reuse, caps.weight_update) == (True,) * 5
    assert (caps.token_ids_in, caps.token_ids_out, caps.tokenizer, caps.device_tensors, caps.per_token_hidden_states) \
        == (True,) * 5
    assert (caps.hidden_size, caps.num_layers, caps.device, caps.sm_partition) == (64, 2, "cpu", False)
    h = eng.hidden_states_torch(Batch(items=[[5, 6]], prefix=[1, 2]))
    assert str(h.device) == caps.device and eng.token_hidden_states([1, 2, 5, 6]).shape == (4, caps.hidden_size)
    prefix, items = eng.tokenize_batch(Batch(items=["a b"], prefix="P:"))
    assert prefix and items[0]


def test_http_engines_declare_what_their_servers_promise() -> None:
    pytest.importorskip("httpx")
    sg = _check_promises(make_engine("sglang+http://127.0.0.1:1"))
    oa = _check_promises(make_engine("openai+http://127.0.0.1:1/v1", model="m"))
    assert sg.hidden_states and sg.token_ids_in and sg.token_ids_out and not sg.tokenizer and sg.device is None
    assert not oa.hidden_states and oa.token_ids_in and not oa.token_ids_out and not oa.device_tensors


@pytest.mark.parametrize("api", ["StructuredOutputsParams", "GuidedDecodingParams", None])
def test_vllm_structured_outputs_map_to_its_own_params(api):
    """The in-process vLLM engine hands a JSON-schema constraint to vLLM's own structured outputs (the field of
    the installed version), refuses "constrained" log-probs (vLLM reports the model's), and never drops it."""
    import types

    from thinkcraft.llm.constrained import StructuredOutput
    from thinkcraft.llm.protocol import EngineCapabilityError, SamplingParams
    from thinkcraft.llm.vllm_engine import structured_kwargs

    mod = types.SimpleNamespace()
    if api is not None:
        setattr(mod, api, lambda **kw: (api, kw["json"]))
    vllm = types.SimpleNamespace(sampling_params=mod, __version__="test")
    schema = StructuredOutput.from_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert structured_kwargs(vllm, SamplingParams()) == {}
    if api is None:
        with pytest.raises(EngineCapabilityError, match="no structured outputs"):
            structured_kwargs(vllm, SamplingParams(structured=schema))
        return
    field = "structured_outputs" if api == "StructuredOutputsParams" else "guided_decoding"
    assert structured_kwargs(vllm, SamplingParams(structured=schema)) == {field: (api, schema.json_schema)}
    constrained = StructuredOutput(schema.json_schema, logprobs="constrained")
    with pytest.raises(EngineCapabilityError, match="constrained"):
        structured_kwargs(vllm, SamplingParams(structured=constrained, logprobs=True))
