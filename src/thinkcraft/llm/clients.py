"""HTTP clients for remote engines (async httpx, bounded retries with backoff), each also an `Engine`.

- `SGLangClient` / `SGLangEngine` (`sglang+http://host:port`): `/generate` for generation (token ids and
  logprobs) and hidden states (`return_hidden_states`; the server must run with
  `--enable-return-hidden-states`; SGLang returns the last layer only). `model_info()`: the served model's
  hidden size from `GET /get_model_info` (`thinkcraft serve` reports it; where a server does not, one
  one-token hidden-states request measures it).
- `OpenAIClient` / `OpenAIEngine` (`openai+http://host:port/v1`): any OpenAI-compatible endpoint (vLLM's
  server, `thinkcraft serve`, hosted providers); generation only.

Only what can succeed on retry is retried (`thinkcraft.utils.retry`: timeouts, connection errors, 429
and 408 honouring `Retry-After`, 502/503/504, a 500 only when the server says so), with exponential
backoff up to `RetryPolicy.max_attempts`; a 4xx (e.g. 400, 401) or a plain 500 fails at once. Every
failure ends as an `EngineError` whose message says what was tried and what to check.

Both clients build their request bodies from `SamplingParams` with one mapping, `sampling_body`.
The API key: `HTTPOptions.api_key`, `api_key_env` (a variable's name) or `api_key_file`.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Awaitable, Literal, Sequence, TypeVar

import numpy as np

from thinkcraft.llm.protocol import (
    Batch,
    Capabilities,
    Completion,
    EngineCapabilityError,
    EngineError,
    ModelInfo,
    SamplingParams,
)
from thinkcraft.utils.apikey import resolve_api_key
from thinkcraft.utils.retry import (
    HTTPStatusError,
    RetryError,
    RetryPolicy,
    is_retryable_http,
    retry_after_of,
    retry_async,
    status_error,
)

T = TypeVar("T")


@dataclass(frozen=True)
class HTTPOptions:
    timeout_s: float = 120.0
    """Per-request timeout (generation can be slow)."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """Bounded retries with backoff on what can succeed on retry (timeouts, connection errors, 429, 502-504)."""
    api_key: str | None = None
    """Bearer token (default: $OPENAI_API_KEY for OpenAI endpoints, none for SGLang)."""
    api_key_env: str | None = None
    """Read the bearer token from this environment variable instead."""
    api_key_file: str | None = None
    """Read the bearer token from the first line of this file instead."""
    max_concurrency: int = 32
    """Requests in flight at once from one engine call."""


class _HTTP:
    """One base URL, JSON POST/GET with retries; an httpx.AsyncClient per event loop."""

    def __init__(self, base_url: str, options: HTTPOptions, default_key_env: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.options = options
        key = resolve_api_key(options.api_key, options.api_key_env, options.api_key_file)
        if key is None and default_key_env:
            key = os.environ.get(default_key_env) or None
        self._key = key

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self._key:
            h["Authorization"] = f"Bearer {self._key}"
        return h

    async def request(self, method: str, path: str, payload: dict | None = None) -> Any:
        import httpx

        url = self.base_url + path

        async def once(client: httpx.AsyncClient) -> Any:
            r = await client.request(method, url, json=payload, headers=self._headers())
            if r.status_code >= 400:
                raise status_error(r, url)
            return r.json()

        async with httpx.AsyncClient(timeout=self.options.timeout_s) as client:
            try:
                return await retry_async(
                    lambda: once(client), self.options.retry, is_retryable_http, what=f"{method} {url}",
                    retry_after=retry_after_of,
                )
            except RetryError as e:
                cause = e.__cause__
                hint = (
                    "is the server running and reachable? (try `thinkcraft serve --port ...` locally)"
                    if not isinstance(cause, HTTPStatusError) else "the server keeps failing"
                )
                raise EngineError(
                    f"{method} {url} failed after {self.options.retry.max_attempts} attempts "
                    f"({type(cause).__name__}: {cause}); {hint}"
                ) from e
            except HTTPStatusError as e:
                hint = " (check the API key)" if e.status in (401, 403) else " (not retried: it would fail again)"
                raise EngineError(f"{method} {url}: HTTP {e.status}{hint}: {e.body[:300]}") from e

    async def post(self, path: str, payload: dict) -> Any:
        return await self.request("POST", path, payload)

    async def get(self, path: str) -> Any:
        return await self.request("GET", path)


def run_sync(coro: Awaitable[T]) -> T:
    """Run a coroutine from sync code, also when an event loop is already running in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["v"] = asyncio.run(coro)  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


async def _gather_bounded(coros: Sequence[Awaitable[T]], limit: int) -> list[T]:
    sem = asyncio.Semaphore(max(1, limit))

    async def one(c: Awaitable[T]) -> T:
        async with sem:
            return await c

    return list(await asyncio.gather(*(one(c) for c in coros)))


def _prompts(batch: Batch) -> list[str] | list[list[int]]:
    """Full prompts: prefix + item (text or token ids)."""
    if batch.is_tokens:
        pre = list(batch.prefix) if batch.prefix is not None else []
        return [pre + list(it) for it in batch.items]
    pre = batch.prefix or ""
    if not isinstance(pre, str):
        raise EngineCapabilityError("a text batch needs a text prefix")
    return [pre + it for it in batch.items]  # type: ignore[operator]


# The request-body names of SamplingParams fields that differ between the two APIs; the rest are shared.
_WIRE_NAMES: dict[str, dict[str, str]] = {
    "openai": {"max_new_tokens": "max_tokens", "seed": "seed"},
    "sglang": {"max_new_tokens": "max_new_tokens", "seed": "sampling_seed"},
}


def sampling_body(sp: SamplingParams, api: Literal["openai", "sglang"]) -> dict[str, Any]:
    """The request fields of `sp`: top-level for OpenAI (/completions), `sampling_params` for SGLang
    (/generate). `thinking_budget` is thinkcraft serve's extension (other servers may reject it)."""
    names = _WIRE_NAMES[api]
    d: dict[str, Any] = {
        names["max_new_tokens"]: sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p, "n": sp.n,
    }
    if sp.stop:
        d["stop"] = list(sp.stop)
    if sp.seed is not None:
        d[names["seed"]] = sp.seed
    if sp.thinking_budget is not None:
        d["thinking_budget"] = sp.thinking_budget
    return d


def _finish(reason: Any) -> str:
    if isinstance(reason, dict):
        reason = reason.get("type")
    return "length" if reason == "length" else "stop"


# --- SGLang --------------------------------------------------------------------------------------------


class SGLangClient:
    """Async client for an SGLang server's native `/generate`."""

    def __init__(self, base_url: str, options: HTTPOptions = HTTPOptions()) -> None:
        self.http = _HTTP(base_url, options)

    async def generate_raw(self, payload: dict) -> Any:
        return await self.http.post("/generate", payload)

    def _completion(self, out: dict, prompt: Any) -> Completion:
        meta = out.get("meta_info", {})
        lps = meta.get("output_token_logprobs")
        return Completion(
            token_ids=list(out.get("output_ids") or []),
            text=out.get("text", ""),
            logprobs=[float(x[0]) for x in lps] if lps else None,
            finish_reason=_finish(meta.get("finish_reason")),
            prompt_token_ids=list(prompt) if prompt and not isinstance(prompt, str) else [],
        )

    async def generate(self, batch: Batch, sampling: SamplingParams) -> list[Completion]:
        prompts = _prompts(batch)
        key = "input_ids" if batch.is_tokens else "text"

        params = sampling_body(sampling, "sglang")

        async def one(p: Any) -> list[Completion]:
            outs = await self.generate_raw({key: p, "sampling_params": params, "return_logprob": sampling.logprobs})
            outs = outs if isinstance(outs, list) else [outs]
            return [self._completion(o, p) for o in outs]

        if sampling.n == 1:  # one batched request
            outs = await self.generate_raw({key: prompts, "sampling_params": params, "return_logprob": sampling.logprobs})
            outs = outs if isinstance(outs, list) else [outs]
            return [self._completion(o, p) for o, p in zip(outs, prompts)]
        # n > 1: one request per item keeps the item-major order unambiguous
        groups = await _gather_bounded([one(p) for p in prompts], self.http.options.max_concurrency)
        return [c for g in groups for c in g]

    async def model_info(self) -> ModelInfo:
        """`GET /get_model_info` (SGLang's route; `thinkcraft serve` adds `hidden_size` and
        `num_hidden_layers`). SGLang's own answer has no hidden size: then one one-token hidden-states
        request measures it (the width of the row it returns)."""
        try:
            info = await self.http.get("/get_model_info")
        except EngineError as e:  # a server without the route answers 404: measure; anything else is an error
            if not (isinstance(e.__cause__, HTTPStatusError) and e.__cause__.status == 404):
                raise
            info = {}
        info = info if isinstance(info, dict) else {}
        size = info.get("hidden_size")
        if not isinstance(size, int) or size <= 0:
            size = int((await self.hidden_states(Batch(items=["x"]))).shape[-1])
        layers = info.get("num_hidden_layers")
        return ModelInfo(model_path=str(info.get("model_path", "")), hidden_size=size,
                         num_hidden_layers=layers if isinstance(layers, int) else None)

    async def hidden_states(self, batch: Batch, layer: int = -1, pooling: str = "last") -> np.ndarray:
        if layer != -1:
            raise EngineCapabilityError("SGLang returns the last layer's hidden states only (layer=-1)")
        prompts = _prompts(batch)
        key = "input_ids" if batch.is_tokens else "text"
        pre_len = len(batch.prefix) if batch.is_tokens and batch.prefix is not None else 0
        outs = await self.generate_raw({
            key: prompts, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_hidden_states": True,
        })
        outs = outs if isinstance(outs, list) else [outs]
        rows = []
        for o in outs:
            hs = o.get("meta_info", {}).get("hidden_states")
            if not hs:
                raise EngineError("the server returned no hidden states (start SGLang with --enable-return-hidden-states)")
            prefill = np.asarray(hs[0], dtype=np.float32)
            prefill = prefill[None, :] if prefill.ndim == 1 else prefill
            # "mean" over the item's own tokens when they are known (token batches), else the whole prompt
            rows.append(prefill[-1] if pooling == "last" else prefill[pre_len:].mean(0))
        return np.stack(rows)


class SGLangEngine:
    """`sglang+http://host:port` as an Engine (sync wrapper over SGLangClient)."""

    def __init__(self, base_url: str, options: HTTPOptions | None = None, **http: Any) -> None:
        self.client = SGLangClient(base_url, options or HTTPOptions(**http))
        self._info: ModelInfo | None = None

    @property
    def capabilities(self) -> Capabilities:
        info = self._info
        return Capabilities(hidden_states=True, generate=True, logprobs=True, prefix_reuse=True,
                            token_ids_in=True, token_ids_out=True, remote_model_info=True,
                            hidden_size=None if info is None else info["hidden_size"],
                            num_layers=None if info is None else info["num_hidden_layers"])

    def model_info(self) -> ModelInfo:
        """The served model's facts, asked once (capabilities then report the hidden size)."""
        if self._info is None:
            self._info = run_sync(self.client.model_info())
        return self._info

    def hidden_states(self, batch: Batch, layer: int = -1, pooling: Literal["last", "mean"] = "last") -> np.ndarray:
        return run_sync(self.client.hidden_states(batch, layer, pooling))

    def generate(self, batch: Batch, sampling: SamplingParams) -> list[Completion]:
        return run_sync(self.client.generate(batch, sampling))

    def close(self) -> None:
        pass


# --- OpenAI-compatible ------------------------------------------------------------------------------------


class OpenAIClient:
    """Async client for an OpenAI-compatible API (`base_url` ends in /v1)."""

    def __init__(self, base_url: str, model: str | None = None, options: HTTPOptions | None = None) -> None:
        self.http = _HTTP(base_url, options or HTTPOptions(), default_key_env="OPENAI_API_KEY")
        self.model = model

    async def model_name(self) -> str:
        if self.model is None:
            data = await self.http.get("/models")
            models = data.get("data") or []
            if not models:
                raise EngineError(f"{self.http.base_url}/models lists no model; pass model=")
            self.model = models[0]["id"]
        return self.model

    async def completions(self, prompt: str | list[int], **params: Any) -> dict:
        return await self.http.post("/completions", {"model": await self.model_name(), "prompt": prompt, **params})

    async def chat(self, messages: list[dict[str, str]], **params: Any) -> dict:
        return await self.http.post("/chat/completions", {"model": await self.model_name(), "messages": messages, **params})

    async def generate(self, batch: Batch, sampling: SamplingParams) -> list[Completion]:
        """One /completions request per item (n samples each), bounded concurrency. Token ids come
        back where the server supports `return_token_ids` (vLLM, thinkcraft serve), else empty."""
        params = sampling_body(sampling, "openai")
        if sampling.logprobs:
            params["logprobs"] = 0  # the sampled tokens' logprobs, no top-k alternatives (which cost the server a forward)
        params["return_token_ids"] = True

        async def one(p: Any) -> list[Completion]:
            data = await self.completions(p, **params)
            out = []
            for ch in sorted(data.get("choices", []), key=lambda c: c.get("index", 0)):
                lp = (ch.get("logprobs") or {}).get("token_logprobs")
                out.append(Completion(
                    token_ids=list(ch.get("token_ids") or []), text=ch.get("text", ""),
                    logprobs=[float(x) for x in lp] if lp is not None else None,
                    finish_reason=_finish(ch.get("finish_reason")),
                    prompt_token_ids=list(ch.get("prompt_token_ids") or (p if not isinstance(p, str) else [])),
                ))
            return out

        groups = await _gather_bounded([one(p) for p in _prompts(batch)], self.http.options.max_concurrency)
        return [c for g in groups for c in g]


class OpenAIEngine:
    """`openai+http://host:port/v1` as an Engine (generation only)."""

    def __init__(self, base_url: str, model: str | None = None, options: HTTPOptions | None = None, **http: Any) -> None:
        self.client = OpenAIClient(base_url, model, options or HTTPOptions(**http))

    @property
    def capabilities(self) -> Capabilities:
        # token ids out only where the server honours `return_token_ids` (vLLM, thinkcraft serve): not promised
        return Capabilities(hidden_states=False, generate=True, logprobs=True, prefix_reuse=False, token_ids_in=True)

    def hidden_states(self, batch: Batch, layer: int = -1, pooling: Literal["last", "mean"] = "last") -> np.ndarray:
        raise EngineCapabilityError(
            "OpenAI-compatible endpoints do not return hidden states; use hf:<model>, vllm:<model> or sglang+http://..."
        )

    def generate(self, batch: Batch, sampling: SamplingParams) -> list[Completion]:
        return run_sync(self.client.generate(batch, sampling))

    def close(self) -> None:
        pass


# --- weight updates (the async llm-policy's HTTP engines) ---------------------------------------------------
#
# Each client writes the learner's update in the format its server loads, asks the server to load it with
# its version, and reads the version back. Every call goes through `_HTTP` (bounded retries on what can
# succeed on retry); a refused or failed load is an EngineError saying what the server answered. The caller
# (pools.weights.HTTPWeights) keeps the old version when this raises, and retries later.


class ThinkcraftWeightsClient:
    """`thinkcraft serve`: POST /update_weights {path, version} (a thinkcraft weight file, full or LoRA),
    GET /weights_version."""

    def __init__(self, base_url: str, options: HTTPOptions | None = None) -> None:
        self.http = _HTTP(base_url, options or HTTPOptions())

    def write(self, update: Any, out_dir: Any) -> str:
        from pathlib import Path

        from thinkcraft.llm.weight_files import write_weight_file

        return str(write_weight_file(Path(out_dir) / f"weights-v{update.version:08d}.pt", update))

    def update_weights(self, path: str, version: int, kind: str) -> None:
        out = run_sync(self.http.post("/update_weights", {"path": path, "version": int(version)}))
        if not (isinstance(out, dict) and out.get("success")):
            raise EngineError(f"{self.http.base_url}/update_weights did not load version {version}: {out}")

    def weights_version(self) -> int | None:
        return int(run_sync(self.http.get("/weights_version"))["version"])


class SGLangWeightsClient:
    """SGLang: full weights by POST /update_weights_from_disk {model_path, weight_version} (an HF folder);
    LoRA adapters by /unload_lora_adapter + /load_lora_adapter {lora_name, lora_path}; the version from
    GET /model_info (newer servers) or /get_weight_version."""

    def __init__(self, base_url: str, base_model_dir: str, options: HTTPOptions | None = None,
                 lora_name: str = "policy") -> None:
        self.http = _HTTP(base_url, options or HTTPOptions())
        self.base_model_dir = base_model_dir
        self.lora_name = lora_name

    def write(self, update: Any, out_dir: Any) -> str:
        from pathlib import Path

        from thinkcraft.llm.weight_files import write_hf_weights

        return str(write_hf_weights(update, Path(out_dir) / f"hf-v{update.version:08d}", self.base_model_dir))

    def update_weights(self, path: str, version: int, kind: str) -> None:
        if kind == "lora":
            try:
                run_sync(self.http.post("/unload_lora_adapter", {"lora_name": self.lora_name}))
            except EngineError:
                pass  # none loaded yet
            out = run_sync(self.http.post("/load_lora_adapter", {"lora_name": self.lora_name, "lora_path": path}))
        else:
            out = run_sync(self.http.post("/update_weights_from_disk", {
                "model_path": path, "weight_version": str(version), "abort_all_requests": False}))
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(f"SGLang refused the weights at {path}: {out.get('message')}")

    def weights_version(self) -> int | None:
        for route in ("/model_info", "/get_weight_version"):
            try:
                got = run_sync(self.http.get(route)).get("weight_version")
            except EngineError:
                continue
            return int(got) if got not in (None, "") else None
        return None


class VLLMWeightsClient:
    """vLLM's OpenAI server: full weights by POST /collective_rpc {"method": "reload_weights", "kwargs":
    {"weights_path", "is_checkpoint_format": true}} (the server runs with VLLM_SERVER_DEV_MODE=1); LoRA
    adapters by POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace: true}
    (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; requests then name the adapter as their model). vLLM reports
    no weight version: the version is the last one it accepted."""

    def __init__(self, base_url: str, base_model_dir: str, options: HTTPOptions | None = None,
                 lora_name: str = "policy") -> None:
        root = base_url.rstrip("/")
        self.http = _HTTP(root[: -len("/v1")] if root.endswith("/v1") else root, options or HTTPOptions())
        self.base_model_dir = base_model_dir
        self.lora_name = lora_name
        self._version: int | None = None

    write = SGLangWeightsClient.write

    def update_weights(self, path: str, version: int, kind: str) -> None:
        if kind == "lora":
            run_sync(self.http.post("/v1/load_lora_adapter",
                                    {"lora_name": self.lora_name, "lora_path": path, "load_inplace": True}))
        else:
            run_sync(self.http.post("/collective_rpc", {
                "method": "reload_weights", "kwargs": {"weights_path": path, "is_checkpoint_format": True}}))
        self._version = int(version)

    def weights_version(self) -> int | None:
        return self._version


def weights_client(spec: str, base_model_dir: str | None, lora: bool,
                   options: HTTPOptions | None = None) -> tuple[Any, Any]:
    """(engine, weights client) for an async rollout server spec: thinkcraft+http://host:port,
    sglang+http://host:port or vllm+http://host:port/v1 (see train llm-policy --rollout-servers). With
    `lora`, vLLM requests name the adapter as their model."""
    from thinkcraft.utils.errors import UserError

    s = spec.strip()
    for prefix in ("thinkcraft+", "sglang+", "vllm+"):
        if s.startswith(prefix + "http://") or s.startswith(prefix + "https://"):
            url = s[len(prefix):]
            break
    else:
        raise UserError(f"rollout server {spec!r}: expected thinkcraft+http://host:port, sglang+http://host:port "
                        "or vllm+http://host:port/v1")
    opts = options or HTTPOptions()
    if prefix == "thinkcraft+":
        return SGLangEngine(url, opts), ThinkcraftWeightsClient(url, opts)
    if base_model_dir is None:
        raise UserError(f"rollout server {spec!r} loads HF folders: the policy must come from a local model folder")
    if prefix == "sglang+":
        return SGLangEngine(url, opts), SGLangWeightsClient(url, base_model_dir, opts)
    client = VLLMWeightsClient(url, base_model_dir, opts)
    return OpenAIEngine(url, model=client.lora_name if lora else None, options=opts), client
