"""The requests `thinkcraft serve` accepts, as typed models (pydantic v2): every field is checked for type
and range before anything runs, and a bad one is a 400 in OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}` whose `param` is the API's own field name
(`max_tokens`, `messages[0].role`, `sampling_params.max_new_tokens`), never an internal one.

Semantics that differ from a plain reading, each as the API it copies does it:
- `max_tokens` null/absent: OpenAI completions' default 16; chat: the rest of the context (capped by the
  server's --max-new-tokens-limit); SGLang /generate: 128 (SGLang's default). 0 is a 400.
- `temperature` in [0, 2] (OpenAI's range; SGLang: >= 0); below 1e-5 it is greedy (vLLM's epsilon: a
  smaller one overflows the logits). `top_p` in (0, 1]: 0 would keep no token (use temperature 0).
- Fields that would change the output but are not implemented (penalties, `logit_bias`, `echo`,
  `suffix`, `best_of` > n, tools, images) are a 400 saying so, not silently ignored; unknown fields are a
  400 ("Unrecognized request argument"), as OpenAI does.
- Chat `response_format` {"type": "json_schema" | "json_object"} (OpenAI structured outputs) constrains
  decoding to the schema (xgrammar, llm/constrained.py): the answer parses by construction.
- Extensions (thinkcraft): `return_token_ids`, `thinking_budget`, `chat_template_kwargs`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from thinkcraft.llm.protocol import SamplingParams

MAX_STOP = 4
"""Stop strings per request (OpenAI's limit)."""
GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128


class RequestError(Exception):
    """A request the server will not run: status, message, the offending field (`param`) and a code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = "invalid_value",
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def param_name(loc: tuple[Any, ...]) -> str:
    """pydantic's error location as the API writes it: ('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse(model: type[BaseModel], body: Any) -> Any:
    """`model` validated from a JSON body; the first problem as a RequestError naming its field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_type")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = param_name(err["loc"])
        if err["type"] == "extra_forbidden":
            raise RequestError(f"Unrecognized request argument supplied: {param}", param, code="unknown_parameter") from None
        if err["type"] == "missing":
            raise RequestError(f"{param} is required", param, code="missing_required_parameter") from None
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        msg = err["msg"].removeprefix("Value error, ")
        code = "invalid_type" if err["type"].endswith("_type") else "invalid_value"
        raise RequestError(f"{param}: {msg} (got {got})", param, code=code) from None


# --- field checks shared by the models ---------------------------------------------------------------


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        if len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return tuple(v)
    raise ValueError(f"must be a string or a list of up to {MAX_STOP} strings")


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _items(v: Any, allow_text: bool, allow_ids: bool) -> list[str] | list[list[int]]:
    """One prompt or a list of them, as a non-empty list of texts or of token-id lists."""
    if allow_text and isinstance(v, str):
        return [v]
    if allow_ids and _is_ids(v):
        return [list(v)]
    if isinstance(v, list) and v:
        if allow_text and all(isinstance(x, str) for x in v):
            return list(v)
        if allow_ids and all(_is_ids(x) for x in v):
            return [list(x) for x in v]
    forms = {(True, True): "a string, a list of token ids, or a non-empty list of either",
             (True, False): "a string or a non-empty list of strings",
             (False, True): "a list of token ids or a non-empty list of them"}[(allow_text, allow_ids)]
    raise ValueError(f"must be {forms}")


def _message_text(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   and set(p) <= {"type", "text", "cache_control"} for p in v):
        return "".join(p["text"] for p in v)
    raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts (no images or audio)')


_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def _effective_temperature(t: float | None) -> float:
    t = 1.0 if t is None else float(t)
    return 0.0 if t < GREEDY_BELOW else t


# --- OpenAI ---------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None


class _OpenAIRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _STRICT
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stop: tuple[str, ...] = ()
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool | None = None
    """thinkcraft/vLLM extension: choices carry `token_ids` and `prompt_token_ids`."""
    thinking_budget: int | None = Field(None, ge=1)
    """thinkcraft extension: close a <think> block after this many thinking tokens."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, v: Any) -> tuple[str, ...]:
        return _stop(v)

    def unsupported(self) -> None:
        """A 400 for a field that would change the answer but is not implemented."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise RequestError(f"{name} is not supported by thinkcraft serve (leave it out or 0)", name,
                                   code="unsupported_parameter")
        if self.logit_bias:
            raise RequestError("logit_bias is not supported by thinkcraft serve", "logit_bias", code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")

    @property
    def samples(self) -> int:
        return self.n or 1

    n_param: ClassVar[str] = "n"

    @property
    def thinking_field(self) -> tuple[str, int | None]:
        return "thinking_budget", self.thinking_budget

    def structured_output(self) -> Any:
        """The answer's constraint (chat's `response_format`); None: free text."""
        return None

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=_effective_temperature(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p), stop=self.stop, n=self.samples, seed=self.seed,
            logprobs=True, thinking_budget=self.thinking_budget, structured=self.structured_output(),
        )


class CompletionRequest(_OpenAIRequest):
    prompt: list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    """Top-k alternatives per token (OpenAI's legacy field: 0..5)."""
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> list[str] | list[list[int]]:
        return _items(v, allow_text=True, allow_ids=True)

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise RequestError("echo is not supported by thinkcraft serve", "echo", code="unsupported_parameter")
        if self.suffix:
            raise RequestError("suffix is not supported by thinkcraft serve", "suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of != self.samples:
            raise RequestError("best_of other than n is not supported by thinkcraft serve", "best_of",
                               code="unsupported_parameter")

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    @property
    def top_logprobs(self) -> int:
        return self.logprobs or 0


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, v: Any) -> str:
        return _message_text(v)


class ChatRequest(_OpenAIRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    """Deprecated by OpenAI in favour of max_completion_tokens; either is accepted."""
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """thinkcraft/vLLM extension: keyword arguments for the tokenizer's chat template (e.g. enable_thinking)."""
    # accepted and without effect on the answer (a local server stores nothing and has one tier)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.tools:
            raise RequestError("tools are not supported by thinkcraft serve", "tools", code="unsupported_parameter")
        if self.tool_choice not in (None, "none", "auto"):
            raise RequestError("tool_choice is not supported by thinkcraft serve", "tool_choice",
                               code="unsupported_parameter")
        self.structured_output()  # a malformed response_format is a 400 naming it
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise RequestError("max_tokens and max_completion_tokens differ: give one", "max_tokens")

    def structured_output(self) -> Any:
        """`response_format` as the engine's constraint (llm.constrained.StructuredOutput), or None for text.
        OpenAI's structured outputs: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}};
        {"type": "json_object"} = any JSON object. Decoding is constrained by the schema (xgrammar), so the
        answer parses by construction."""
        rf = self.response_format
        if rf is None or rf == {"type": "text"}:
            return None
        from thinkcraft.llm.constrained import StructuredOutput, check_schema
        from thinkcraft.utils.errors import UserError

        kind = rf.get("type")
        if kind == "json_object":
            schema: Any = {"type": "object"}
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise RequestError("response_format.json_schema.schema must be a JSON Schema object",
                                   "response_format.json_schema.schema")
        else:
            raise RequestError('response_format.type must be "text", "json_object" or "json_schema"',
                               "response_format.type")
        try:
            check_schema(schema)
        except UserError as e:
            raise RequestError(f"response_format: {e}", "response_format.json_schema.schema") from None
        return StructuredOutput.from_schema(schema)

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @property
    def top_k(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def template_messages(self) -> list[dict[str, str]]:
        """Messages for the chat template (`developer` is OpenAI's newer name for `system`)."""
        out = []
        for m in self.messages:
            d = {"role": "system" if m.role == "developer" else m.role, "content": m.content}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


# --- SGLang -------------------------------------------------------------------------------------------


class SGLangSampling(BaseModel):
    model_config = _STRICT
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stop: tuple[str, ...] = ()
    sampling_seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    thinking_budget: int | None = Field(None, ge=1)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, v: Any) -> tuple[str, ...]:
        return _stop(v)


class GenerateRequest(BaseModel):
    model_config = _STRICT
    text: list[str] | None = None
    input_ids: list[list[int]] | None = None
    sampling_params: SGLangSampling = Field(default_factory=SGLangSampling)
    return_logprob: bool | None = None
    return_hidden_states: bool | None = None
    stream: bool | None = None
    _single: bool = PrivateAttr(False)

    @field_validator("text", mode="before")
    @classmethod
    def _text(cls, v: Any) -> list[str] | None:
        return None if v is None else _items(v, allow_text=True, allow_ids=False)

    @field_validator("input_ids", mode="before")
    @classmethod
    def _input_ids(cls, v: Any) -> list[list[int]] | None:
        return None if v is None else _items(v, allow_text=False, allow_ids=True)

    @classmethod
    def from_body(cls, body: Any) -> "GenerateRequest":
        req = parse(cls, body)
        raw = body.get("text") if body.get("text") is not None else body.get("input_ids")
        req._single = isinstance(raw, str) or _is_ids(raw)
        return req

    @property
    def single(self) -> bool:
        """One prompt (answered with one object when n = 1) rather than a list."""
        return self._single

    def unsupported(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise RequestError("/generate needs exactly one of `text` or `input_ids`", "text")
        if self.stream:
            raise RequestError("streaming is not supported on /generate (use /v1/completions with stream: true)",
                               "stream", code="unsupported_parameter")

    @property
    def prompt_field(self) -> str:
        return "text" if self.text is not None else "input_ids"

    @property
    def samples(self) -> int:
        return self.sampling_params.n or 1

    n_param: ClassVar[str] = "sampling_params.n"

    @property
    def thinking_field(self) -> tuple[str, int | None]:
        return "sampling_params.thinking_budget", self.sampling_params.thinking_budget

    @property
    def max_tokens_field(self) -> tuple[str, int | None]:
        return "sampling_params.max_new_tokens", self.sampling_params.max_new_tokens

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        s = self.sampling_params
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=_effective_temperature(s.temperature),
            top_p=1.0 if s.top_p is None else float(s.top_p), stop=s.stop, n=self.samples, seed=s.sampling_seed,
            logprobs=True, thinking_budget=s.thinking_budget,
        )
