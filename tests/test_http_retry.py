"""What the HTTP clients retry, how often, how long they wait and what they raise, against a local fake
server answering a scripted sequence of statuses; the classification and Retry-After parsing as tables;
the one SamplingParams -> request-body mapping of both clients."""

from __future__ import annotations

import time
from email.utils import formatdate

import httpx
import pytest

from thinkcraft.llm.clients import HTTPOptions, OpenAIEngine, SGLangEngine, sampling_body
from thinkcraft.llm.protocol import Batch, EngineError, SamplingParams
from thinkcraft.utils.apikey import resolve_api_key
from thinkcraft.utils.errors import UserError
from thinkcraft.utils.retry import HTTPStatusError, RetryPolicy, is_retryable_http, parse_retry_after, retry_after_from

FAST = RetryPolicy(max_attempts=4, base_delay_s=0.01, max_delay_s=2.0, jitter=0.0)
OK_OPENAI = {"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]}
OK_SGLANG = [{"text": "hi", "output_ids": [5], "meta_info": {"finish_reason": {"type": "stop"}}}]


class Script:
    """Answers request i with script[i] = (status, headers); past the end, 200 with `ok`."""

    def __init__(self, script: list[tuple[int, dict[str, str]]], ok: object) -> None:
        self.script, self.ok = script, ok
        self.times: list[float] = []
        self.headers: list[dict[str, str]] = []

    def app(self):  # noqa: ANN201
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def answer(request):  # noqa: ANN001, ANN202
            i = len(self.times)
            self.times.append(time.monotonic())
            self.headers.append(dict(request.headers))
            if i < len(self.script):
                status, headers = self.script[i]
                return JSONResponse({"error": {"message": f"scripted {status}"}}, status_code=status, headers=headers)
            return JSONResponse(self.ok)

        return Starlette(routes=[Route("/{path:path}", answer, methods=["GET", "POST"])])


def _openai(url: str, **opts) -> OpenAIEngine:  # noqa: ANN003
    return OpenAIEngine(url + "/v1", model="m", options=HTTPOptions(retry=FAST, **opts))


def _run(engine) -> None:  # noqa: ANN001
    engine.generate(Batch(items=["x"]), SamplingParams(max_new_tokens=2))


RETRY_AFTER_0 = {"Retry-After": "0"}
# (script, attempts made, outcome: "ok" or a regex of the EngineError)
CASES = [
    ([(503, {}), (502, {}), (504, {})], 4, "ok"),                         # overload and gateways: retried
    ([(429, RETRY_AFTER_0)], 2, "ok"),                                    # rate limit: retried
    ([(408, {})], 2, "ok"),                                               # the server timed out waiting: retried
    ([(500, {})], 1, r"HTTP 500 \(not retried"),                          # a plain 500: deterministic, not retried
    ([(500, RETRY_AFTER_0)], 2, "ok"),                                    # ... unless the server says to retry
    ([(500, {"x-should-retry": "true"})], 2, "ok"),
    ([(503, {"x-should-retry": "false"})], 1, r"HTTP 503 \(not retried"),  # the server's "no" wins
    ([(429, {"x-should-retry": "false"})], 1, r"HTTP 429"),                # e.g. an exhausted quota
    ([(400, {})], 1, r"HTTP 400 \(not retried"),                          # 4xx: never retried
    ([(401, {})], 1, r"HTTP 401 \(check the API key"),
    ([(404, {})], 1, r"HTTP 404"),
    ([(409, {})], 1, r"HTTP 409"),
    ([(422, {})], 1, r"HTTP 422"),
    ([(501, {})], 1, r"HTTP 501"),
    ([(503, {})] * 4, 4, r"failed after 4 attempts.*HTTP 503.*keeps failing"),  # bounded
]


@pytest.mark.parametrize("client", ["openai", "sglang"])
@pytest.mark.parametrize("script,attempts,outcome", CASES, ids=[f"{c[0][0][0]}{'+' + ','.join(c[0][0][1]) if c[0][0][1] else ''}x{len(c[0])}" for c in CASES])
def test_what_is_retried(servers, client, script, attempts, outcome) -> None:  # noqa: ANN001
    fake = Script(script, OK_OPENAI if client == "openai" else OK_SGLANG)
    url = servers.app(fake.app())
    engine = _openai(url) if client == "openai" else SGLangEngine(url, options=HTTPOptions(retry=FAST))
    if outcome == "ok":
        _run(engine)
    else:
        with pytest.raises(EngineError, match=outcome):
            _run(engine)
    assert len(fake.times) == attempts


def test_retry_after_is_honoured(servers) -> None:
    fake = Script([(429, {"Retry-After": "0.5"}), (503, {"retry-after-ms": "300"})], OK_OPENAI)
    _run(_openai(servers.app(fake.app())))
    gaps = [b - a for a, b in zip(fake.times, fake.times[1:])]
    assert gaps[0] >= 0.45 and gaps[1] >= 0.25  # not the 0.01 s backoff


def test_connection_errors_and_timeouts_are_retried_then_raised(servers) -> None:
    from servers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="failed after 4 attempts.*server running"):
        _run(_openai(dead))
    assert time.monotonic() - t0 < 5


def test_api_key_sources(servers, tmp_path, monkeypatch) -> None:
    fake = Script([], OK_OPENAI)
    url = servers.app(fake.app())
    monkeypatch.setenv("TC_KEY_A", "from-env")
    (tmp_path / "k").write_text("from-file\n# comment lines after the key are ignored\n")
    monkeypatch.setenv("OPENAI_API_KEY", "default-env")
    for opts, sent in ((dict(api_key_env="TC_KEY_A"), "from-env"), (dict(api_key_file=str(tmp_path / "k")), "from-file"),
                       (dict(api_key="inline"), "inline"), ({}, "default-env")):
        _run(_openai(url, **opts))
        assert fake.headers[-1]["authorization"] == f"Bearer {sent}"
    with pytest.raises(UserError, match="api_key_env: environment variable TC_NOPE is not set"):
        _openai(url, api_key_env="TC_NOPE")
    with pytest.raises(UserError, match="give one of api_key / api_key_env"):
        resolve_api_key("a", "TC_KEY_A")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UserError, match="is empty"):
        resolve_api_key(file=tmp_path / "empty")


@pytest.mark.parametrize("headers,seconds", [
    ({"retry-after": "3"}, 3.0),
    ({"retry-after": "1.5"}, 1.5),
    ({"retry-after": "soon"}, None),
    ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),           # OpenAI's finer header first
    ({}, None),
])
def test_retry_after_parsing(headers, seconds) -> None:  # noqa: ANN001
    assert retry_after_from(httpx.Headers(headers)) == seconds


def test_retry_after_http_date() -> None:
    assert parse_retry_after(formatdate(1_000_010.0, usegmt=True), now=1_000_000.0) == pytest.approx(10.0)
    assert parse_retry_after(formatdate(999_990.0, usegmt=True), now=1_000_000.0) == 0.0


def test_retryable_classification() -> None:
    assert is_retryable_http(httpx.ConnectError("refused")) and is_retryable_http(httpx.ReadTimeout("slow"))
    assert not is_retryable_http(ValueError("a bug"))
    assert [s for s in range(400, 600) if is_retryable_http(HTTPStatusError(s))] == [408, 429, 502, 503, 504]


def test_one_sampling_mapping_for_both_clients() -> None:
    sp = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, stop=("\n",), n=3, seed=11, thinking_budget=4)
    common = {"temperature": 0.5, "top_p": 0.9, "n": 3, "stop": ["\n"], "thinking_budget": 4}
    assert sampling_body(sp, "openai") == {**common, "max_tokens": 7, "seed": 11}
    assert sampling_body(sp, "sglang") == {**common, "max_new_tokens": 7, "sampling_seed": 11}
    assert sampling_body(SamplingParams(max_new_tokens=1), "openai") == {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "n": 1}


def test_every_cli_that_takes_a_key_has_env_and_file_forms(capsys, monkeypatch, tmp_path) -> None:
    from thinkcraft.cli import main
    from thinkcraft.train.llm_policy import LLMPolicyConfig
    from thinkcraft.utils.errors import ConfigError

    for argv, flags in ((["serve"], ("--api-key-env", "--api-key-file")),
                        (["train", "llm-policy"], ("--judge-api-key-env", "--judge-api-key-file")),
                        (["label"], ("api_key_env", "api_key_file"))):  # label: keys of the endpoints file
        assert main([*argv, "--help"]) == 0
        out = capsys.readouterr().out
        assert all(f in out for f in flags), (argv, out[-2000:])
    # one-line errors before anything loads
    assert main(["serve", "--api-key-env", "TC_NO_SUCH_VAR"]) == 2
    assert "--api-key-env: environment variable TC_NO_SUCH_VAR is not set" in capsys.readouterr().err
    judge = "openai+http://127.0.0.1:9/v1"
    with pytest.raises(ConfigError, match="--judge-api-key-env: environment variable TC_NO_SUCH_VAR"):
        LLMPolicyConfig(reward="judge", judge_engine=judge, judge_api_key_env="TC_NO_SUCH_VAR")
    with pytest.raises(ConfigError, match="--judge-api-key-env: an API key is for an HTTP judge"):
        LLMPolicyConfig(reward="judge", judge_engine="self", judge_api_key_env="HOME")
    (tmp_path / "k").write_text("sk-judge\n")
    cfg = LLMPolicyConfig(reward="judge", judge_engine=judge, judge_api_key_file=str(tmp_path / "k"))
    assert cfg.judge_engine_options() == {"api_key": "sk-judge"}
    monkeypatch.setenv("TC_JUDGE_KEY", "sk-env")
    cfg = LLMPolicyConfig(reward="judge", judge_engine=judge, judge_api_key_env="TC_JUDGE_KEY")
    assert cfg.judge_engine_options() == {"api_key": "sk-env"}
    assert LLMPolicyConfig().judge_engine_options() == {}
