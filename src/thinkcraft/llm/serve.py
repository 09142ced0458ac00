"""`thinkcraft serve`: the hf engine over HTTP, so that clients, labelling and remote-engine code can be
tried on one laptop.

Endpoints (JSON):
  GET  /health                   {"status": "ok"}
  GET  /v1/models                OpenAI model list
  POST /v1/completions           OpenAI completions (prompt: text, token ids, or a list of either)
  POST /v1/chat/completions      OpenAI chat completions (the tokenizer's chat template)
  POST /generate                 SGLang-style: text | input_ids (one or a list), sampling_params,
                                 return_logprob, return_hidden_states

Extensions accepted on the OpenAI routes: `return_token_ids` (choices carry `token_ids` and
`prompt_token_ids`), `thinking_budget`, `chat_template_kwargs`, `seed`. Answers carry `usage`.

For testing clients: `--api-key K` (requests without `Authorization: Bearer K` get 401), and fault
injection: `--fail-every N` (every N-th request fails), `--fail-rate p` (each request fails with
probability p), `--fail-status 500|429|502|503` (429s carry `Retry-After: --fail-retry-after-s`),
`--delay-ms D` (each request waits D ms first, to exercise client timeouts).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from thinkcraft.llm.protocol import Batch, Completion, Engine, SamplingParams
from thinkcraft.utils.errors import UserError, check


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
    """If set, requests must carry `Authorization: Bearer <key>` (else 401)."""
    max_new_tokens_limit: int = 4096
    """Upper bound on max_tokens a request may ask for."""
    fail_every: int = 0
    """Fault injection: every N-th request fails with --fail-status (0 = never)."""
    fail_rate: float = 0.0
    """Fault injection: each request fails with this probability."""
    fail_status: int = 500
    """HTTP status of injected failures: 429 (with Retry-After), 500, 502 or 503."""
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


@dataclass(frozen=True)
class FaultConfig:
    fail_every: int = 0
    fail_rate: float = 0.0
    fail_status: int = 500
    fail_retry_after_s: float = 1.0
    delay_ms: float = 0.0


class MicroBatcher:
    """Merges generate requests that arrive within `window_ms` of each other and share sampling
    parameters into one engine call (one padded batch on the accelerator instead of many small ones).
    Completions go back to each request in order; an engine error fails every request of its group."""

    def __init__(self, run: Any, window_ms: float = 5.0, max_items: int = 256) -> None:
        self.run = run  # async (Batch, SamplingParams) -> list[Completion]
        self.window_s = window_ms / 1000.0
        self.max_items = max_items
        self.queue: asyncio.Queue | None = None
        self.worker: asyncio.Task | None = None
        self.engine_calls = 0

    async def generate(self, batch: Batch, sp: SamplingParams) -> list[Completion]:
        # seeded requests run alone: grouping depends on arrival timing and would change their samples
        if self.window_s <= 0 or batch.prefix is not None or sp.seed is not None:
            self.engine_calls += 1
            return await self.run(batch, sp)
        if self.worker is None or self.worker.done():
            self.queue = asyncio.Queue()
            self.worker = asyncio.get_running_loop().create_task(self._work())
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((batch, sp, fut))
        return await fut

    async def _work(self) -> None:
        assert self.queue is not None
        loop = asyncio.get_running_loop()
        while True:
            pending = [await self.queue.get()]
            deadline = loop.time() + self.window_s
            while sum(len(b) * sp.n for b, sp, _ in pending) < self.max_items:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    pending.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            groups: dict[tuple, list] = {}
            for req in pending:
                groups.setdefault((req[1], req[0].is_tokens), []).append(req)
            for (sp, _), reqs in groups.items():
                items = [it for b, _, _ in reqs for it in b.items]
                try:
                    self.engine_calls += 1
                    cs = await self.run(Batch(items=items), sp)
                except Exception as e:  # noqa: BLE001 - handed to each waiting request
                    for _, _, fut in reqs:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                at = 0
                for b, _, fut in reqs:
                    k = len(b) * sp.n
                    if not fut.done():
                        fut.set_result(cs[at : at + k])
                    at += k


def make_app(
    engine: Engine,
    model_name: str = "thinkcraft",
    api_key: str | None = None,
    faults: FaultConfig = FaultConfig(),
    max_new_tokens_limit: int = 4096,
    batch_window_ms: float = 5.0,
) -> Any:
    """A Starlette app serving `engine` (an HFEngine, or any Engine for generation-only routes)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    lock = threading.Lock()  # the engine is not re-entrant: one call at a time
    counter = {"n": 0}
    rng = random.Random(0)

    def error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None) -> Any:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status, headers=headers)

    async def guard(request: Request) -> Any | None:
        """Auth and fault injection; returns an error response or None."""
        if faults.delay_ms:
            await asyncio.sleep(faults.delay_ms / 1000.0)
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            return error(401, "missing or wrong API key (send Authorization: Bearer <key>)", "authentication_error")
        counter["n"] += 1
        fail = (faults.fail_every and counter["n"] % faults.fail_every == 0) or (
            faults.fail_rate and rng.random() < faults.fail_rate
        )
        if fail:
            headers = {"Retry-After": f"{faults.fail_retry_after_s:g}"} if faults.fail_status == 429 else None
            return error(faults.fail_status, "injected failure (thinkcraft serve --fail-*)", "injected", headers)
        return None

    async def call(fn: Any, *args: Any) -> Any:
        def locked() -> Any:
            with lock:
                return fn(*args)

        return await asyncio.to_thread(locked)

    batcher = MicroBatcher(lambda b, sp: call(engine.generate, b, sp), batch_window_ms)

    def sampling_from(body: dict, max_key: str) -> SamplingParams:
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        max_new = int(body.get(max_key) or body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if max_new > max_new_tokens_limit:
            raise UserError(f"{max_key}={max_new} exceeds this server's limit {max_new_tokens_limit}")
        temp = body.get("temperature")
        return SamplingParams(
            max_new_tokens=max_new,
            temperature=1.0 if temp is None else float(temp),
            top_p=float(body.get("top_p", 1.0) or 1.0),
            stop=stop,
            n=int(body.get("n", 1) or 1),
            seed=body.get("seed"),
            logprobs=True,
            thinking_budget=body.get("thinking_budget"),
        )

    def usage(cs: list[Completion], n: int) -> dict:
        prompt = sum(len(c.prompt_token_ids) for c in cs[::n]) if cs else 0
        comp = sum(len(c.token_ids) for c in cs)
        return {"prompt_tokens": prompt, "completion_tokens": comp, "total_tokens": prompt + comp}

    def finish_openai(c: Completion) -> str:
        return "length" if c.finish_reason == "length" else "stop"

    def token_strs(ids: list[int]) -> list[str]:
        tok = getattr(engine, "tokenizer", None)
        return [tok.decode([i]) for i in ids] if tok is not None else [str(i) for i in ids]

    async def json_body(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError as e:
            raise UserError(f"request body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise UserError("request body must be a JSON object")
        return body

    def handler(fn: Any) -> Any:
        async def wrapped(request: Request) -> Any:
            bad = await guard(request)
            if bad is not None:
                return bad
            try:
                return await fn(request)
            except UserError as e:
                return error(400, str(e))
            except Exception as e:  # noqa: BLE001 - report, keep serving
                return error(500, f"{type(e).__name__}: {e}", "server_error")

        return wrapped

    async def health(request: Request) -> Any:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Any:
        bad = await guard(request)
        if bad is not None:
            return bad
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "thinkcraft"}]})

    def as_batch(prompt: Any) -> Batch:
        if isinstance(prompt, str):
            return Batch(items=[prompt])
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            return Batch(items=[prompt])
        if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
            return Batch(items=prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(x, list) for x in prompt):
            return Batch(items=prompt)
        raise UserError("prompt must be a string, a list of token ids, or a list of either")

    def with_token_ids(ch: dict[str, Any], c: Any, body: dict) -> dict[str, Any]:
        """thinkcraft's extension: the sampled and prompt token ids (token-in/token-out training)."""
        if body.get("return_token_ids"):
            ch["token_ids"] = c.token_ids
            ch["prompt_token_ids"] = c.prompt_token_ids
        return ch

    def openai_response(id_prefix: str, obj: str, choices: list, cs: list, n: int) -> Any:
        return JSONResponse({
            "id": f"{id_prefix}-{uuid.uuid4().hex[:16]}", "object": obj, "created": int(time.time()),
            "model": model_name, "choices": choices, "usage": usage(cs, n),
        })

    async def completions(request: Request) -> Any:
        body = await json_body(request)
        sp = sampling_from(body, "max_tokens")
        cs: list[Completion] = await batcher.generate(as_batch(body.get("prompt")), sp)
        want_lp = body.get("logprobs") is not None and body.get("logprobs") is not False
        choices = []
        for i, c in enumerate(cs):
            ch: dict[str, Any] = {"index": i, "text": c.text, "finish_reason": finish_openai(c), "logprobs": None}
            if want_lp and c.logprobs is not None:
                ch["logprobs"] = {"tokens": token_strs(c.token_ids), "token_logprobs": c.logprobs, "top_logprobs": None}
            choices.append(with_token_ids(ch, c, body))
        return openai_response("cmpl", "text_completion", choices, cs, sp.n)

    async def chat(request: Request) -> Any:
        body = await json_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise UserError("messages must be a non-empty list")
        sp = sampling_from(body, "max_completion_tokens")
        templ = getattr(engine, "apply_chat_template", None)
        if templ is None:
            raise UserError("this engine has no chat template")
        prompt = templ(messages, add_generation_prompt=True, tokenize=True, **(body.get("chat_template_kwargs") or {}))
        cs = await batcher.generate(Batch(items=[prompt]), sp)
        choices = []
        for i, c in enumerate(cs):
            ch: dict[str, Any] = {
                "index": i, "message": {"role": "assistant", "content": c.text},
                "finish_reason": finish_openai(c), "logprobs": None,
            }
            if body.get("logprobs") and c.logprobs is not None:
                ch["logprobs"] = {"content": [
                    {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                    for s, lp in zip(token_strs(c.token_ids), c.logprobs)
                ]}
            choices.append(with_token_ids(ch, c, body))
        return openai_response("chatcmpl", "chat.completion", choices, cs, sp.n)

    async def generate(request: Request) -> Any:
        body = await json_body(request)
        single = False
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            single = bool(ids) and isinstance(ids[0], int)
            batch = Batch(items=[ids] if single else ids)
        elif body.get("text") is not None:
            text = body["text"]
            single = isinstance(text, str)
            batch = Batch(items=[text] if single else text)
        else:
            raise UserError("/generate needs `text` or `input_ids`")
        sp = sampling_from(dict(body.get("sampling_params") or {}), "max_new_tokens")
        cs = await batcher.generate(batch, sp)
        hidden: list[Any] | None = None
        if body.get("return_hidden_states"):
            per_token = getattr(engine, "token_hidden_states", None)
            if per_token is None:
                raise UserError("this engine cannot return hidden states")
            # SGLang layout: meta_info.hidden_states[0] = the prompt's per-token states (P, H)
            # (decode-token states are not returned by this server).
            hidden = await call(lambda: [per_token(c.prompt_token_ids).tolist() for c in cs[:: sp.n]])
        outs = []
        for j, c in enumerate(cs):
            meta: dict[str, Any] = {
                "id": uuid.uuid4().hex[:16],
                "prompt_tokens": len(c.prompt_token_ids), "completion_tokens": len(c.token_ids),
                "finish_reason": {"type": finish_openai(c)},
            }
            if body.get("return_logprob") and c.logprobs is not None:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)]
            if hidden is not None:
                meta["hidden_states"] = [hidden[j // sp.n]]
            outs.append({"text": c.text, "output_ids": c.token_ids, "meta_info": meta})
        return JSONResponse(outs[0] if single and sp.n == 1 else outs)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", handler(completions), methods=["POST"]),
        Route("/v1/chat/completions", handler(chat), methods=["POST"]),
        Route("/generate", handler(generate), methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.batcher = batcher
    return app


def run(config: ServeConfig) -> int:
    import uvicorn

    from thinkcraft.llm.hf import HFEngine

    engine = HFEngine(
        config.model, device=config.device, dtype=config.dtype, kv_cache=config.kv_cache,  # type: ignore[arg-type]
        compile_decode=config.compile_decode,
    )
    faults = FaultConfig(config.fail_every, config.fail_rate, config.fail_status, config.fail_retry_after_s, config.delay_ms)
    app = make_app(engine, config.served_model_name or config.model, config.api_key, faults, config.max_new_tokens_limit,
                   config.batch_window_ms)
    print(f"thinkcraft serve: {config.model} on http://{config.host}:{config.port} "
          f"(OpenAI /v1/completions, /v1/chat/completions; SGLang /generate)", flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
    return 0
