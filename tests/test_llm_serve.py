"""`thinkcraft serve` + the HTTP clients: OpenAI and SGLang-style routes against the in-process engine's
answers, retries on injected 5xx/429, 401 handling, timeouts, and a clear error once the server is gone."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from thinkcraft.llm.clients import HTTPOptions, OpenAIClient, OpenAIEngine, SGLangEngine, run_sync
from thinkcraft.llm.hf import HFEngine
from thinkcraft.llm.protocol import Batch, EngineError, SamplingParams
from thinkcraft.llm.serve import FaultConfig, ServeConfig, make_app
from thinkcraft.llm.testing import save_tiny, tiny_llama
from thinkcraft.utils.errors import ConfigError
from thinkcraft.utils.retry import RetryPolicy

FAST = RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.5, jitter=0.0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model", *tiny_llama())


@pytest.fixture(scope="module")
def local(tiny_dir) -> HFEngine:
    return HFEngine(str(tiny_dir))


@pytest.mark.slow
def test_cli_serve_openai_sglang_and_unreachable(tiny_dir: Path, local: HFEngine, servers) -> None:
    url = servers.serve("--model", str(tiny_dir))
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    want = local.generate(Batch(items=["Hello there", "The tree"]), sp)
    # OpenAI-compatible completions through the Engine wrapper
    oa = OpenAIEngine(url + "/v1", options=HTTPOptions(retry=FAST))
    got = oa.generate(Batch(items=["Hello there", "The tree"]), sp)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.text for c in got] == [c.text for c in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
        assert g.prompt_token_ids == w.prompt_token_ids
    # raw chat + completions payloads: usage, logprobs, OpenAI shapes
    client = OpenAIClient(url + "/v1", options=HTTPOptions(retry=FAST))
    chat = run_sync(client.chat([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True))
    ch = chat["choices"][0]
    assert chat["object"] == "chat.completion" and ch["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == len(ch["logprobs"]["content"]) <= 4
    assert chat["usage"]["prompt_tokens"] == len(local.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True))
    cmp = run_sync(client.completions([1, 50, 51], max_tokens=3, temperature=0, logprobs=1, n=2))
    assert len(cmp["choices"]) == 2 and cmp["usage"]["prompt_tokens"] == 3
    assert len(cmp["choices"][0]["logprobs"]["token_logprobs"]) == cmp["usage"]["completion_tokens"] // 2
    # SGLang-style /generate: generation and hidden states
    sg = SGLangEngine(url, options=HTTPOptions(retry=FAST))
    got_sg = sg.generate(Batch(items=["Hello there", "The tree"]), sp)
    assert [c.token_ids for c in got_sg] == [c.token_ids for c in want]
    np.testing.assert_allclose(got_sg[0].logprobs, want[0].logprobs, atol=1e-4)
    two = sg.generate(Batch(items=[[1, 50, 51]]), SamplingParams(max_new_tokens=3, temperature=1.0, n=2, seed=0))
    assert len(two) == 2 and all(c.prompt_token_ids == [1, 50, 51] for c in two)
    h = sg.hidden_states(Batch(items=["Hello there", "The tree"]))
    np.testing.assert_allclose(h, local.hidden_states(Batch(items=["Hello there", "The tree"])), atol=1e-4)
    hm = sg.hidden_states(Batch(items=[[5, 6, 7], [8, 9]], prefix=[1, 2, 3]), pooling="mean")
    np.testing.assert_allclose(hm, local.hidden_states(Batch(items=[[5, 6, 7], [8, 9]], prefix=[1, 2, 3]), pooling="mean"), atol=1e-4)
    servers.stop_process(url)
    # server stopped -> clear error after bounded retries
    t0 = time.time()
    with pytest.raises(EngineError, match="after 3 attempts.*server running"):
        oa.generate(Batch(items=["x"]), sp)
    assert time.time() - t0 < 10


def test_retries_through_injected_failures(local: HFEngine, servers) -> None:
    sp = SamplingParams(max_new_tokens=3, temperature=0.0)
    want = local.generate(Batch(items=["a b"]), sp)[0].token_ids
    url = servers.app(make_app(local, "tiny", faults=FaultConfig(fail_every=2, fail_status=503)))
    eng = OpenAIEngine(url + "/v1", model="tiny", options=HTTPOptions(retry=FAST))
    for _ in range(3):  # every second request is a 503: each call still succeeds after one retry
        assert eng.generate(Batch(items=["a b"]), sp)[0].token_ids == want
    sg = SGLangEngine(url, options=HTTPOptions(retry=FAST))
    for _ in range(2):
        assert sg.generate(Batch(items=["a b"]), sp)[0].token_ids == want


def test_injected_500_is_not_retried(local: HFEngine, servers) -> None:
    url = servers.app(make_app(local, "tiny", faults=FaultConfig(fail_every=1, fail_status=500)))
    eng = OpenAIEngine(url + "/v1", model="tiny", options=HTTPOptions(retry=FAST))
    with pytest.raises(EngineError, match="HTTP 500 .not retried"):
        eng.generate(Batch(items=["a b"]), SamplingParams(max_new_tokens=2))


def test_429_retry_after_then_give_up(local: HFEngine, servers) -> None:
    url = servers.app(make_app(local, "tiny", faults=FaultConfig(fail_rate=1.0, fail_status=429, fail_retry_after_s=0.2)))
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 429 and r.headers["retry-after"] == "0.2"
    eng = OpenAIEngine(url + "/v1", model="tiny", options=HTTPOptions(retry=FAST))
    t0 = time.time()
    with pytest.raises(EngineError, match="after 3 attempts"):
        eng.generate(Batch(items=["x"]), SamplingParams(max_new_tokens=2))
    assert time.time() - t0 >= 0.4  # waited Retry-After twice, not the 0.01 s backoff


def test_api_key_timeouts_and_bad_requests(local: HFEngine, servers, tmp_path, monkeypatch) -> None:
    url = servers.app(make_app(local, "tiny", api_key="sekret", faults=FaultConfig(delay_ms=300)))
    sp = SamplingParams(max_new_tokens=2, temperature=0.0)
    wrong = OpenAIEngine(url + "/v1", model="tiny", options=HTTPOptions(retry=FAST, api_key="nope"))
    t0 = time.time()
    with pytest.raises(EngineError, match="401.*API key"):
        wrong.generate(Batch(items=["x"]), sp)
    assert time.time() - t0 < 1.5  # 401 is not retried
    ok = OpenAIEngine(url + "/v1", model="tiny", options=HTTPOptions(retry=FAST, api_key="sekret"))
    assert len(ok.generate(Batch(items=["x"]), sp)[0].token_ids) >= 1
    # the key from an environment variable or a file
    monkeypatch.setenv("TC_TEST_KEY", "sekret")
    (tmp_path / "key").write_text("sekret\n")
    for opts in (dict(api_key_env="TC_TEST_KEY"), dict(api_key_file=str(tmp_path / "key"))):
        eng = OpenAIEngine(url + "/v1", model="tiny", options=HTTPOptions(retry=FAST, **opts))
        assert len(eng.generate(Batch(items=["x"]), sp)[0].token_ids) >= 1
    slow = OpenAIEngine(url + "/v1", model="tiny", options=HTTPOptions(retry=FAST, api_key="sekret", timeout_s=0.05))
    with pytest.raises(EngineError, match="after 3 attempts.*Timeout"):
        slow.generate(Batch(items=["x"]), sp)
    r = httpx.post(url + "/v1/completions", json={"prompt": None}, headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_concurrent_requests_are_micro_batched(local: HFEngine, servers) -> None:
    import asyncio

    prompts = ["a b", "The tree is", "water", "Craft a pickaxe now", "x", "zombie"]
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    want = [c.token_ids for c in local.generate(Batch(items=prompts), sp)]
    app = make_app(local, "tiny", batch_window_ms=200)
    url = servers.app(app)
    client = OpenAIClient(url + "/v1", model="tiny", options=HTTPOptions(retry=FAST))

    async def all_at_once() -> list[dict]:
        return await asyncio.gather(*(
            client.completions(p, max_tokens=4, temperature=0, return_token_ids=True) for p in prompts
        ))

    outs = run_sync(all_at_once())
    assert [o["choices"][0]["token_ids"] for o in outs] == want
    assert [o["usage"]["prompt_tokens"] for o in outs] == [len(local.tokenize_batch(Batch(items=[p]))[1][0]) for p in prompts]
    assert app.state.batcher.engine_calls < len(prompts)


def test_serve_config_validation() -> None:
    with pytest.raises(ConfigError, match="--fail-status"):
        ServeConfig(fail_status=404)
    with pytest.raises(ConfigError, match="--fail-rate"):
        ServeConfig(fail_rate=2.0)
    with pytest.raises(ConfigError, match="--port"):
        ServeConfig(port=70000)
    with pytest.raises(ConfigError, match="--api-key-env: environment variable TC_NO_SUCH_VAR"):
        ServeConfig(api_key_env="TC_NO_SUCH_VAR")
    with pytest.raises(ConfigError, match="--api-key-file: cannot read"):
        ServeConfig(api_key_file="/nonexistent/key")
    with pytest.raises(ConfigError, match="--api-key: give one of"):
        ServeConfig(api_key="a", api_key_file="/nonexistent/key")
