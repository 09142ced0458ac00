"""Remote structured outputs: the schema goes as OpenAI `response_format`; endpoints that refuse it are asked
again without it and their answers parsed and re-asked; `--engine openai+http://...` uses chat completions."""

import json

import pytest

from thinkcraft.label.pipeline import LabelConfig, label
from thinkcraft.label.template import response_format

from test_label_remote import endpoints_toml, write_items


def _app(log: list, refuse: bool):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def chat(request):
        body = await request.json()
        log.append(body)
        if refuse and "response_format" in body:
            return JSONResponse({"error": {"message": "response_format is not supported"}}, status_code=400)
        user = body["messages"][-1]["content"]
        text = json.dumps({"action": "noop" if "even" in user else "do", "n": len(user)})
        return JSONResponse({"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 10, "completion_tokens": 5}})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "served-model", "object": "model"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])


@pytest.fixture
def server(servers):
    def start(refuse=False):
        log: list = []
        return servers.app(_app(log, refuse)) + "/v1", log

    return start


def _cfg(tmp_path, url, **kw):
    inp = write_items(tmp_path / "items.parquet", 4)
    eps = endpoints_toml(tmp_path / "ep.toml", {"name": "s", "base_url": url, "model": "m", "max_concurrency": 1})
    return LabelConfig(input=str(inp), out_dir=str(tmp_path / "out"), fields="action:string,n:integer",
                       endpoints=str(eps), **kw)


def test_schema_sent_as_response_format(tmp_path, server):
    url, log = server()
    rep = label(_cfg(tmp_path, url))
    assert rep["labelled"] == 4 and rep["endpoints"]["s"]["structured"] is True
    rf = log[0]["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["strict"] is True
    assert rf["json_schema"]["schema"]["additionalProperties"] is False
    assert set(rf["json_schema"]["schema"]["required"]) == {"action", "n"}


def test_refused_response_format_falls_back_to_parse_and_reask(tmp_path, server):
    url, log = server(refuse=True)
    rep = label(_cfg(tmp_path, url))
    st = rep["endpoints"]["s"]
    assert rep["labelled"] == 4 and rep["failed"] == 0 and st["structured"] is False
    # asked once with the schema (refused), then every request plain
    assert ["response_format" in b for b in log] == [True] + [False] * 4
    assert st["failed_requests"] == 0


def test_no_constrain_sends_no_schema(tmp_path, server):
    url, log = server()
    label(_cfg(tmp_path, url, constrain=False))
    assert not any("response_format" in b for b in log)


def test_openai_engine_spec_uses_chat_completions(tmp_path, server):
    url, log = server()
    inp = write_items(tmp_path / "items.parquet", 3)
    rep = label(LabelConfig(input=str(inp), out_dir=str(tmp_path / "o"), fields="action:string,n:integer",
                            engine=f"openai+{url}"))
    assert rep["labelled"] == 3 and rep["model"] == "served-model" and rep["prompt_format"] == "chat"
    assert log[0]["model"] == "served-model" and log[0]["messages"][0]["role"] == "system"


def test_response_format_strict_only_when_every_field_is_required():
    loose = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]}
    rf = response_format(loose)
    assert rf["json_schema"]["strict"] is False and rf["json_schema"]["schema"] == loose
