"""The official `openai` Python client against `thinkcraft serve` (a tiny random-weight model, greedy so that
answers can be compared with the in-process engine): completions, chat, n, stop, logprobs with top-k
alternatives, streaming (server-sent events: the SDK's stream yields the same text as the plain answer),
and errors as the SDK's exception types with the offending `param`."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install -e '.[dev]'")

from thinkcraft.llm.hf import HFEngine  # noqa: E402
from thinkcraft.llm.protocol import Batch, SamplingParams  # noqa: E402
from thinkcraft.llm.serve import make_app  # noqa: E402
from thinkcraft.llm.serve_responses import text_pieces  # noqa: E402
from thinkcraft.llm.testing import save_tiny, tiny_llama  # noqa: E402

MSG = [{"role": "user", "content": "Name a tool."}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> HFEngine:
    return HFEngine(str(save_tiny(tmp_path_factory.mktemp("tiny") / "model", *tiny_llama())))


@pytest.fixture(scope="module")
def client(engine, module_servers):
    url = module_servers.app(make_app(engine, "tiny", batch_window_ms=0))
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy(engine: HFEngine, prompt, n_tokens: int):  # noqa: ANN001
    return engine.generate(Batch(items=[prompt]), SamplingParams(max_new_tokens=n_tokens, temperature=0.0))[0]


def test_completions_n_and_stop(engine, client) -> None:
    want = _greedy(engine, "Hello there", 8)
    got = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids)
    assert got.choices[0].finish_reason == "length"
    many = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2, n=3, temperature=0)
    assert [c.index for c in many.choices] == list(range(6))
    # a stop string taken from inside the greedy answer cuts it there
    stop = want.text[len(want.text) // 2 :][:3]
    cut = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].text == want.text[: want.text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_completion_logprobs_top_k(engine, client) -> None:
    want = _greedy(engine, "Hello there", 5)
    got = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(want.token_ids)
    assert "".join(lp.tokens) == want.text and lp.text_offset[0] == 0
    for tok, tok_lp, top, engine_lp in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, want.logprobs):
        assert tok_lp == pytest.approx(engine_lp, abs=1e-4)
        values = list(top.values())
        assert len(top) == 3 and values == sorted(values, reverse=True)
        # greedy: the sampled token is the most likely one, with the same logprob
        assert next(iter(top)) == tok and values[0] == pytest.approx(tok_lp, abs=1e-4)


def test_chat_with_top_logprobs(engine, client) -> None:
    want = _greedy(engine, engine.apply_chat_template(MSG, tokenize=True), 4)
    got = client.chat.completions.create(model="tiny", messages=MSG, max_completion_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=2)
    ch = got.choices[0]
    assert ch.message.role == "assistant" and ch.message.content == want.text
    assert [e.logprob for e in ch.logprobs.content] == pytest.approx(want.logprobs, abs=1e-4)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in ch.logprobs.content)
    plain = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == want.text


def test_streaming_completions(client) -> None:
    whole = client.completions.create(model="tiny", prompt="The tree", max_tokens=8, temperature=0, n=2)
    chunks = list(client.completions.create(model="tiny", prompt="The tree", max_tokens=8, temperature=0, n=2,
                                            stream=True, logprobs=1))
    assert chunks, "the stream yielded nothing"
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == whole.choices[i].text
        assert mine[-1].finish_reason == whole.choices[i].finish_reason and all(c.finish_reason is None for c in mine[:-1])
        assert sum(len(c.logprobs.tokens) for c in mine[:-1]) == whole.usage.completion_tokens // 2


def test_streaming_chat_with_usage(client) -> None:
    whole = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, logprobs=True, top_logprobs=1)
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    n_lp = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    assert n_lp == whole.usage.completion_tokens


def test_errors_are_the_sdks_exceptions_with_param(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert e.value.param == "max_tokens" and "max_tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 50_000}], max_tokens=2)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert e.value.param == "model"


@pytest.mark.parametrize("text", ["héllo wörld", "tools 🔨⛏️ and 木", "plain ascii words here"])
def test_stream_pieces_rebuild_the_text(engine, text) -> None:
    tok = engine.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    full = tok.decode(ids, skip_special_tokens=True)
    decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    pieces = text_pieces(decode, ids, full)
    assert len(pieces) == len(ids) and "".join(pieces) == full
    assert all("\ufffd" not in p for p in pieces)  # a character split over tokens comes out whole
    for cut in (0, 3, len(full) - 2):  # the answer cut at a stop string: the pieces stop there too
        assert "".join(text_pieces(decode, ids, full[:cut])) == full[:cut]


def test_top_alternatives_in_chunks_equal_one_pass(engine, monkeypatch) -> None:
    import thinkcraft.llm.serve_engine as se

    c = _greedy(engine, "Hello there", 7)
    vocab = engine.model.get_input_embeddings().num_embeddings
    one = se.top_alternatives(engine, c.prompt_token_ids, c.token_ids, 3, vocab)
    monkeypatch.setattr(se, "TOPK_LOGITS_BUDGET", 2 * vocab)  # two positions per forward
    chunked = se.top_alternatives(engine, c.prompt_token_ids, c.token_ids, 3, vocab)
    assert [[t for t, _ in row] for row in chunked] == [[t for t, _ in row] for row in one]
    assert [lp for row in chunked for _, lp in row] == pytest.approx([lp for row in one for _, lp in row], abs=1e-5)
    assert [row[0][0] for row in one] == c.token_ids  # greedy: the sampled token is the top alternative


def test_our_openai_engine_reads_logprobs_without_top_k(engine, client, monkeypatch) -> None:
    import thinkcraft.llm.serve_engine as se
    from thinkcraft.llm.clients import OpenAIEngine

    def no_top_k(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("logprobs: 0 must not cost a top-k forward")

    monkeypatch.setattr(se, "top_alternatives", no_top_k)
    want = _greedy(engine, "Hello there", 5)
    got = OpenAIEngine(str(client.base_url).rstrip("/"), model="tiny").generate(
        Batch(items=["Hello there"]), SamplingParams(max_new_tokens=5, temperature=0.0))[0]
    assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
