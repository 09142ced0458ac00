"""`thinkcraft serve` refuses every invalid request with a 4xx naming the API's own field, in OpenAI's error
shape, and never answers a 500 to bad input: a table of requests -> (status, param), then every field of
each route fed values of the wrong type and out of range. A tiny random-weight model serves (fast)."""

from __future__ import annotations

import httpx
import pytest

from thinkcraft.llm.hf import HFEngine
from thinkcraft.llm.serve import Limits, make_app
from thinkcraft.llm.testing import save_tiny, tiny_llama

CONTEXT = 256  # tokens: the tiny model's context for these tests (--max-model-len)
LIMITS = Limits(max_new_tokens=8, max_n=4, context_tokens=CONTEXT)
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> HFEngine:
    return HFEngine(str(save_tiny(tmp_path_factory.mktemp("tiny") / "model", *tiny_llama())))


@pytest.fixture(scope="module")
def url(engine, module_servers) -> str:
    return module_servers.app(make_app(engine, "tiny", limits=LIMITS, batch_window_ms=0))


C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"
# (route, body, status, param named in the error; None = no particular field)
TABLE = [
    # wrong types
    (C, {"prompt": "hi", "max_tokens": "lots"}, 400, "max_tokens"),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "hi", "n": "abc"}, 400, "n"),
    (C, {"prompt": "hi", "seed": "x"}, 400, "seed"),
    (C, {"prompt": "hi", "stop": 5}, 400, "stop"),
    (C, {"prompt": "hi", "logprobs": "yes"}, 400, "logprobs"),
    (C, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": None}, 400, "prompt"),
    (C, {"prompt": [[1, 2], "mixed"]}, 400, "prompt"),
    (CH, {"messages": MSG, "max_tokens": "lots"}, 400, "max_tokens"),
    (CH, {"messages": MSG, "logprobs": 1}, 400, "logprobs"),
    (G, {"text": "hi", "sampling_params": {"max_new_tokens": "lots"}}, 400, "sampling_params.max_new_tokens"),
    (G, {"text": "hi", "sampling_params": "greedy"}, 400, "sampling_params"),
    # out of range
    (C, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    (C, {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    (C, {"prompt": "hi", "top_p": -0.1}, 400, "top_p"),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "hi", "n": 0}, 400, "n"),
    (C, {"prompt": "hi", "n": 5}, 400, "n"),                       # over the documented cap (--max-n)
    (C, {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    (C, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    (C, {"prompt": [1, 2, 10**9]}, 400, "prompt"),                 # token id outside the vocabulary
    (C, {"prompt": [1, -3]}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (CH, {"messages": MSG, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
    (G, {"input_ids": [1, 10**9]}, 400, "input_ids"),
    (G, {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
    (G, {"text": "hi", "sampling_params": {"n": 99}}, 400, "sampling_params.n"),
    # max tokens: 0 is a 400 naming the field; over the server's limit too; null is the API's default
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 9}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": None}, 200, None),
    (CH, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CH, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CH, {"messages": MSG, "max_tokens": 3, "max_completion_tokens": 4}, 400, "max_tokens"),
    (CH, {"messages": MSG, "max_tokens": None}, 200, None),
    (G, {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, 400, "sampling_params.max_new_tokens"),
    # the context: a prompt longer than it, or prompt + max_tokens over it, before anything runs
    (C, {"prompt": "word " * 10_000}, 400, "prompt"),
    (C, {"prompt": [1] * (CONTEXT - 4), "max_tokens": 8}, 400, "max_tokens"),
    (C, {"prompt": [1] * (CONTEXT - 4)}, 200, None),                # the default is cut to the room left
    (CH, {"messages": [{"role": "user", "content": "word " * 10_000}]}, 400, "messages"),
    (G, {"input_ids": [1] * CONTEXT}, 400, "input_ids"),
    # malformed chat messages
    (CH, {}, 400, "messages"),
    (CH, {"messages": []}, 400, "messages"),
    (CH, {"messages": "hi"}, 400, "messages"),
    (CH, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CH, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CH, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CH, {"messages": [MSG[0], {"content": "x"}]}, 400, "messages[1].role"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content"),
    (CH, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400, "messages[0].tool_calls"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2}, 200, None),
    (CH, {"messages": [{"role": "developer", "content": "be brief"}, MSG[0]], "max_tokens": 2}, 200, None),
    # features that would change the answer but are not implemented: refused, not ignored
    (C, {"prompt": "hi", "echo": True}, 400, "echo"),
    (C, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (C, {"prompt": "hi", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "hi", "thinking_budget": 4}, 400, "thinking_budget"),  # this model has no <think>
    (C, {"prompt": "hi", "no_such_field": 1}, 400, "no_such_field"),
    (CH, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    (CH, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (CH, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema.schema"),
    (CH, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     400, "response_format.json_schema.schema"),
    (CH, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),  # needs logprobs: true
    (G, {"text": "hi", "stream": True}, 400, "stream"),
    (G, {"text": "hi", "sampling_params": {"top_k": 5}}, 400, "sampling_params.top_k"),
    (G, {}, 400, "text"),
    (G, {"text": "hi", "input_ids": [1]}, 400, "text"),
    # the model asked for must be the one served
    (C, {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    (C, {"prompt": "hi", "model": "tiny", "max_tokens": 2}, 200, None),
    # valid edge values
    (C, {"prompt": "hi", "temperature": 0, "max_tokens": 2}, 200, None),
    (C, {"prompt": "hi", "temperature": 1e-9, "max_tokens": 2}, 200, None),  # greedy below 1e-5, no overflow
    (C, {"prompt": "hi", "top_p": 1e-6, "max_tokens": 2, "seed": -5}, 200, None),
    (C, {"prompt": [[1, 2], [3]], "n": 4, "max_tokens": 2, "stop": ["\n"]}, 200, None),
    (G, {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2, "sampling_seed": 3}}, 200, None),
]


def _id(i: int, row: tuple) -> str:
    route, _, status, param = row
    return f"{i:02d}-{route.rsplit('/', 1)[-1]}-{status}-{param or 'ok'}"


@pytest.mark.parametrize("route,body,status,param", TABLE, ids=[_id(i, r) for i, r in enumerate(TABLE)])
def test_request_status_and_param(url, route, body, status, param) -> None:  # noqa: ANN001
    r = httpx.post(url + route, json=body, timeout=60)
    assert r.status_code == status, r.text
    if status >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and err["message"]
        if param is not None and "." not in param and "[" not in param:
            assert param in err["message"], err  # the message names the field too


def test_not_json_and_not_an_object(url) -> None:  # noqa: ANN001
    r = httpx.post(url + C, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert httpx.post(url + C, json=[1, 2]).status_code == 400


def test_null_max_tokens_is_the_apis_default(url) -> None:  # noqa: ANN001
    # completions: OpenAI's default 16, cut to this server's limit (8); chat: the rest of the context, same cap
    r = httpx.post(url + C, json={"prompt": "hi", "max_tokens": None, "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] == 8 or r["choices"][0]["finish_reason"] == "stop"
    r = httpx.post(url + C, json={"prompt": [1] * (CONTEXT - 3), "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] <= 3


BAD_VALUES = [None, "x", -1, 0, 0.5, 10**30, -(10**30), True, [], [None], {}, {"a": 1}, "", float("inf")]
FIELDS = {
    C: ({"prompt": "hi", "max_tokens": 2}, ["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                                           "logprobs", "stream", "stream_options", "echo", "best_of", "suffix",
                                           "logit_bias", "user", "return_token_ids", "thinking_budget", "model",
                                           "frequency_penalty"]),
    CH: ({"messages": MSG, "max_tokens": 2}, ["messages", "max_tokens", "max_completion_tokens", "temperature",
                                              "top_p", "n", "stop", "seed", "logprobs", "top_logprobs", "stream",
                                              "response_format", "tools", "tool_choice", "chat_template_kwargs",
                                              "metadata"]),
    G: ({"text": "hi", "sampling_params": {"max_new_tokens": 2}}, ["text", "input_ids", "return_logprob",
                                                                   "return_hidden_states", "stream"]),
}


@pytest.mark.parametrize("route", [C, CH, G])
def test_no_value_of_any_field_is_a_500(url, route) -> None:  # noqa: ANN001
    import json

    base, fields = FIELDS[route]
    sampling = [f"sampling_params.{f}" for f in ("max_new_tokens", "temperature", "top_p", "n", "stop", "sampling_seed")]
    with httpx.Client(timeout=60) as client:
        for field in fields + (sampling if route == G else []) + ["messages[0].role", "messages[0].content"] * (route == CH):
            for value in BAD_VALUES:
                body = json.loads(json.dumps(base))
                if field.startswith("sampling_params."):
                    body["sampling_params"][field.split(".", 1)[1]] = value
                elif field.startswith("messages[0]."):
                    body["messages"] = [{**MSG[0], field.split(".", 1)[1]: value}]
                else:
                    body[field] = value
                r = client.post(url + route, content=json.dumps(body, allow_nan=True),
                                headers={"content-type": "application/json"})
                assert r.status_code < 500, (field, value, r.text)
                if r.status_code >= 400:
                    assert r.json()["error"]["message"], (field, value)


def test_response_format_json_schema_constrains_the_answer(engine, module_servers) -> None:  # noqa: ANN001
    """OpenAI structured outputs: a random-weight model never writes JSON by itself, so an answer that
    parses and satisfies the schema does so because decoding was constrained."""
    import json

    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"move": {"type": "string", "enum": ["left", "right"]},
                                               "sure": {"type": "boolean"}},
              "required": ["move", "sure"], "additionalProperties": False}
    url = module_servers.app(make_app(engine, "tiny", limits=Limits(max_new_tokens=48, max_n=4,
                                                                      context_tokens=CONTEXT), batch_window_ms=0))
    body = {"messages": MSG, "max_tokens": 48, "n": 3, "seed": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "act", "schema": schema}}}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"move", "sure"} and value["move"] in ("left", "right") and isinstance(value["sure"], bool)
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"messages": MSG, "max_tokens": 48, "response_format": {"type": "json_object"}})
    choice = r.json()["choices"][0]
    # any object: a random model may run past the budget inside it; what it wrote is still an object's start
    assert r.status_code == 200 and choice["message"]["content"].startswith("{")
    assert choice["finish_reason"] == "length" or isinstance(json.loads(choice["message"]["content"]), dict)
