"""`thinkcraft serve`: the hf engine over HTTP, so that clients, labelling and remote-engine code can be
tried on one laptop.

Endpoints (JSON):
  GET  /health                   {"status": "ok"}
  GET  /v1/models                OpenAI model list
  GET  /get_model_info           SGLang's route: model_path, is_generation, and (an extension) hidden_size,
                                 num_hidden_layers (what `train ppo-hidden --engine sglang+http://...` reads)
  POST /v1/completions           OpenAI completions (prompt: text, token ids, or a list of either)
  POST /v1/chat/completions      OpenAI chat completions (the tokenizer's chat template)
  POST /generate                 SGLang-style: text | input_ids (one or a list), sampling_params,
                                 return_logprob, return_hidden_states
  POST /update_weights           {"path", "version"}: load a learner's weight file (full or LoRA), atomically
  GET  /weights_version          {"version": v} (serve_weights: the async llm-policy's HTTP engines)

Requests are validated before anything runs (`serve_requests`): a bad one is a 400 in OpenAI's error
shape naming the API's own field, never a 500; prompts longer than the model's context, token ids
outside the vocabulary, and more than --max-n samples are refused up front. The OpenAI routes answer
`n`, `stop`, `seed`, logprobs with top-k alternatives (`logprobs: k` for completions, `logprobs` +
`top_logprobs` for chat) and `stream: true` (server-sent events, `serve_responses`). Extensions:
`return_token_ids` (choices carry `token_ids` and `prompt_token_ids`), `thinking_budget`,
`chat_template_kwargs`. Answers carry `usage`.

For testing clients: an API key (`--api-key-env VAR` or `--api-key-file PATH`; `--api-key K` shows in
`ps`): requests without `Authorization: Bearer <key>` get 401. Fault injection: `--fail-every N` (every
N-th request fails), `--fail-rate p` (each request fails with probability p), `--fail-status
500|429|502|503` (429s carry `Retry-After: --fail-retry-after-s`), `--delay-ms D` (each request waits D ms
first, to exercise client timeouts).
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from thinkcraft.llm.protocol import Batch
from thinkcraft.llm.serve_engine import Limits, ServedEngine
from thinkcraft.llm.serve_requests import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    GENERATE_DEFAULT_MAX_NEW_TOKENS,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    RequestError,
    parse,
)
from thinkcraft.llm.serve_responses import OpenAIShapes, Shaped, finish_reason, sse
from thinkcraft.llm.serve_weights import WeightRoutes
from thinkcraft.utils.apikey import resolve_config_key
from thinkcraft.utils.errors import UserError, check

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    """Serve the hf engine over OpenAI- and SGLang-compatible HTTP."""

    model: str = "default"
    """Model: "default" (bundled SmolLM2-135M-Instruct), a local HF folder, or a .gguf file."""
    host: str = "127.0.0.1"
    """Address to bind (127.0.0.1 = this machine only)."""
    port: int = 8000
    """TCP port."""
    device: str | None = None
    """torch device (default: cuda if available, else cpu)."""
    dtype: str | None = None
    """torch dtype name (default: bfloat16 on GPU, float32 on CPU)."""
    kv_cache: str = "dynamic"
    """Generation KV cache: "dynamic", or "static" (preallocated; with --compile-decode, CUDA graphs)."""
    compile_decode: bool = False
    """torch.compile the decode step (GPU; first request per batch shape compiles for ~1 min)."""
    batch_window_ms: float = 5.0
    """Requests arriving within this window with the same sampling parameters share one engine call (0 = off)."""
    served_model_name: str | None = None
    """Model name reported by /v1/models (default: the --model value)."""
    api_key: str | None = None
    """If set, requests must carry `Authorization: Bearer <key>` (else 401). Visible in `ps`: prefer
    --api-key-env or --api-key-file."""
    api_key_env: str | None = None
    """Read the required API key from this environment variable."""
    api_key_file: str | None = None
    """Read the required API key from the first line of this file."""
    max_new_tokens_limit: int = 4096
    """Upper bound on max_tokens a request may ask for (also caps a chat request without max_tokens)."""
    max_n: int = 64
    """Upper bound on `n` (samples per prompt) a request may ask for."""
    max_model_len: int | None = None
    """Context length in tokens, prompt + completion (default: the model's max_position_embeddings)."""
    fail_every: int = 0
    """Fault injection: every N-th request fails with --fail-status (0 = never)."""
    fail_rate: float = 0.0
    """Fault injection: each request fails with this probability."""
    fail_status: int = 500
    """HTTP status of injected failures: 429 (with Retry-After) and 502/503 are retried by thinkcraft's
    clients; a plain 500 is not (it stands for a deterministic server error)."""
    fail_retry_after_s: float = 1.0
    """Retry-After seconds sent with injected 429s."""
    delay_ms: float = 0.0
    """Fault injection: wait this long before handling each request."""
    log_level: str = "warning"
    """uvicorn log level."""

    def __post_init__(self) -> None:
        check(0 <= self.port <= 65535, "port", f"must be 0..65535, got {self.port}")
        check(self.fail_every >= 0, "fail_every", "must be ≥ 0")
        check(0.0 <= self.fail_rate <= 1.0, "fail_rate", f"must be in [0, 1], got {self.fail_rate}")
        check(self.fail_status in (429, 500, 502, 503), "fail_status", "must be one of 429, 500, 502, 503")
        check(self.delay_ms >= 0 and self.fail_retry_after_s >= 0, "delay_ms", "delays must be ≥ 0")
        check(self.batch_window_ms >= 0, "batch_window_ms", "must be ≥ 0")
        check(self.max_new_tokens_limit >= 1, "max_new_tokens_limit", "must be ≥ 1")
        check(self.kv_cache in ("dynamic", "static"), "kv_cache", "must be 'dynamic' or 'static'")
        check(self.max_n >= 1, "max_n", "must be ≥ 1")
        check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be ≥ 2")
        self.resolved_api_key()  # an unset variable or unreadable key file fails here, before the model loads

    def resolved_api_key(self) -> str | None:
        return resolve_config_key(self.api_key, self.api_key_env, self.api_key_file)


@dataclass(frozen=True)
class FaultConfig:
    fail_every: int = 0
    fail_rate: float = 0.0
    fail_status: int = 500
    fail_retry_after_s: float = 1.0
    delay_ms: float = 0.0


class _FaultInjector:
    """--fail-every / --fail-rate / --delay-ms: the error a request gets instead of its answer, or None."""

    def __init__(self, faults: FaultConfig) -> None:
        self.faults = faults
        self.requests = 0
        self.rng = random.Random(0)

    async def __call__(self) -> RequestError | None:
        f = self.faults
        if f.delay_ms:
            await asyncio.sleep(f.delay_ms / 1000.0)
        self.requests += 1
        if not ((f.fail_every and self.requests % f.fail_every == 0) or (f.fail_rate and self.rng.random() < f.fail_rate)):
            return None
        headers = {"Retry-After": f"{f.fail_retry_after_s:g}"} if f.fail_status == 429 else None
        return RequestError("injected failure (thinkcraft serve --fail-*)", status=f.fail_status, code="injected",
                            kind="injected", headers=headers)


class _Routes:
    """The HTTP routes over one ServedEngine: auth and fault injection first, then the typed request,
    the checks against the model, generation, and the answer in the API's shape."""

    def __init__(self, srv: ServedEngine, model_name: str, api_key: str | None, faults: FaultConfig) -> None:
        self.srv = srv
        self.model_name = model_name
        self.api_key = api_key
        self.inject = _FaultInjector(faults)
        self.weights = WeightRoutes(srv)

    async def _guard(self, request: Request) -> None:
        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise RequestError("missing or wrong API key (send Authorization: Bearer <key>)", status=401,
                               code="invalid_api_key")
        injected = await self.inject()
        if injected is not None:
            raise injected

    def _endpoint(self, fn: Any) -> Any:
        """`fn(request)` behind the guard; every refusal answered in OpenAI's error shape."""

        async def endpoint(request: Request) -> Response:
            try:
                await self._guard(request)
                return await fn(request)
            except RequestError as e:
                return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
            except UserError as e:  # the engine refusing this input
                return JSONResponse(RequestError(str(e)).body(), status_code=400)
            except Exception as e:  # noqa: BLE001 - report, keep serving
                log.exception("request failed")
                err = RequestError(f"{type(e).__name__}: {e}", status=500, code=None, kind="server_error")
                return JSONResponse(err.body(), status_code=500)

        return endpoint

    @staticmethod
    async def _json(request: Request) -> Any:
        try:
            return await request.json()
        except ValueError as e:
            raise RequestError(f"the request body is not valid JSON: {e}", code="invalid_json") from None

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise RequestError(f"The model `{name}` does not exist: this server serves `{self.model_name}`", "model",
                               status=404, code="model_not_found")

    def _answer(self, req: Any, shaped: list[Shaped], chat: bool, want_logprobs: bool) -> Response:
        shapes = OpenAIShapes(self.model_name, chat, want_logprobs, bool(req.return_token_ids))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(sse(shapes.chunks(shaped, req.samples, include_usage)),
                                     media_type="text/event-stream")
        return JSONResponse(shapes.response(shaped, req.samples))

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list",
                             "data": [{"id": self.model_name, "object": "model", "owned_by": "thinkcraft"}]})

    async def model_info(self, request: Request) -> Response:
        engine = self.srv.engine
        return JSONResponse({"model_path": self.model_name, "tokenizer_path": self.model_name, "is_generation": True,
                             "hidden_size": engine.hidden_size, "num_hidden_layers": engine.num_layers})

    async def completions(self, request: Request) -> Response:
        req = parse(CompletionRequest, await self._json(request))
        req.unsupported()
        self._check_model(req.model)
        prompts = await self.srv.tokenize(req.prompt)
        sp = self.srv.sampling(req, prompts, "prompt", default_max=COMPLETIONS_DEFAULT_MAX_TOKENS)
        cs = await self.srv.batcher.generate(Batch(items=prompts), sp)
        want_lp = req.logprobs is not None
        shaped = await self.srv.shaped(cs, req.top_logprobs, text=want_lp or bool(req.stream))
        return self._answer(req, shaped, chat=False, want_logprobs=want_lp)

    async def chat(self, request: Request) -> Response:
        req = parse(ChatRequest, await self._json(request))
        req.unsupported()
        self._check_model(req.model)
        prompt = await self.srv.chat_prompt(req)
        sp = self.srv.sampling(req, [prompt], "messages", default_max=None)
        cs = await self.srv.batcher.generate(Batch(items=[prompt]), sp)
        want_lp = bool(req.logprobs)
        shaped = await self.srv.shaped(cs, req.top_k, text=want_lp or bool(req.stream))
        return self._answer(req, shaped, chat=True, want_logprobs=want_lp)

    async def generate(self, request: Request) -> Response:
        """SGLang's /generate: one object for one prompt (n = 1), else a list, item-major."""
        req = GenerateRequest.from_body(await self._json(request))
        req.unsupported()
        prompts = await self.srv.tokenize(req.text if req.text is not None else req.input_ids)
        sp = self.srv.sampling(req, prompts, req.prompt_field, default_max=GENERATE_DEFAULT_MAX_NEW_TOKENS)
        cs = await self.srv.batcher.generate(Batch(items=prompts), sp)
        hidden: list[Any] | None = None
        if req.return_hidden_states:
            # SGLang layout: meta_info.hidden_states[0] = the prompt's per-token states (P, H)
            # (decode-token states are not returned by this server).
            per_token = self.srv.engine.token_hidden_states
            hidden = await self.srv.call(lambda: [per_token(c.prompt_token_ids).tolist() for c in cs[:: sp.n]])
        outs = []
        for j, c in enumerate(cs):
            meta: dict[str, Any] = {
                "id": uuid.uuid4().hex[:16],
                "prompt_tokens": len(c.prompt_token_ids), "completion_tokens": len(c.token_ids),
                "finish_reason": {"type": finish_reason(c)},
            }
            if req.return_logprob and c.logprobs is not None:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)]
            if hidden is not None:
                meta["hidden_states"] = [hidden[j // sp.n]]
            outs.append({"text": c.text, "output_ids": c.token_ids, "meta_info": meta})
        return JSONResponse(outs[0] if req.single and sp.n == 1 else outs)

    async def update_weights(self, request: Request) -> Response:
        return JSONResponse(await self.weights.update_weights(await self._json(request)))

    async def weights_version(self, request: Request) -> Response:
        return JSONResponse(self.weights.version())

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
            Route("/get_model_info", self._endpoint(self.model_info), methods=["GET"]),
            Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._endpoint(self.chat), methods=["POST"]),
            Route("/generate", self._endpoint(self.generate), methods=["POST"]),
            Route("/update_weights", self._endpoint(self.update_weights), methods=["POST"]),
            Route("/weights_version", self._endpoint(self.weights_version), methods=["GET"]),
        ]
        app = Starlette(routes=routes)
        app.state.batcher = self.srv.batcher
        return app


def make_app(
    engine: Any,
    model_name: str = "thinkcraft",
    api_key: str | None = None,
    faults: FaultConfig = FaultConfig(),
    max_new_tokens_limit: int = 4096,
    batch_window_ms: float = 5.0,
    limits: Limits | None = None,
) -> Starlette:
    """A Starlette app serving `engine` (an HFEngine: its generate, tokenize_batch, apply_chat_template,
    token_hidden_states, and its model/tokenizer for the limits and top-k logprobs)."""
    srv = ServedEngine(engine, limits or Limits(max_new_tokens=max_new_tokens_limit), batch_window_ms)
    return _Routes(srv, model_name, api_key, faults).app()


def run(config: ServeConfig) -> int:
    import uvicorn

    from thinkcraft.llm.hf import HFEngine

    engine = HFEngine(
        config.model, device=config.device, dtype=config.dtype, kv_cache=config.kv_cache,  # type: ignore[arg-type]
        compile_decode=config.compile_decode,
    )
    faults = FaultConfig(config.fail_every, config.fail_rate, config.fail_status, config.fail_retry_after_s, config.delay_ms)
    limits = Limits(config.max_new_tokens_limit, config.max_n, config.max_model_len)
    app = make_app(engine, config.served_model_name or config.model, config.resolved_api_key(), faults,
                   batch_window_ms=config.batch_window_ms, limits=limits)
    print(f"thinkcraft serve: {config.model} on http://{config.host}:{config.port} "
          f"(OpenAI /v1/completions, /v1/chat/completions; SGLang /generate)", flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
    return 0
