"""The engine protocol every part of thinkcraft uses to talk to a language model.

A `Batch` is either texts or token ids, with an optional shared `prefix` (instructions, few-shot) kept
apart from the per-item suffixes so that an engine can prefill the prefix once and reuse its KV across
the batch and across calls while it is unchanged. The full input of item i is `prefix + items[i]`
(concatenated as text, or as token ids when the batch is tokenized).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable, Literal, Protocol, Sequence, TypedDict, runtime_checkable

import numpy as np

from thinkcraft.utils.errors import UserError

if TYPE_CHECKING:
    from thinkcraft.llm.constrained import StructuredOutput


class EngineError(RuntimeError):
    """An engine call failed (after its retries, where the engine retries)."""


class EngineCapabilityError(UserError):
    """The engine cannot do what was asked (e.g. hidden states from an OpenAI endpoint)."""


class WeightUpdateError(EngineError):
    """`update_weights` refused or failed: the engine keeps its previous weights and version."""


class StaleWeightsError(WeightUpdateError):
    """`update_weights` refused a version not newer than the engine's (held, or queued to apply at the next
    step boundary): nothing changed, and the engine has - or is about to have - these weights or newer ones.
    A publisher may ignore it (a retry after a lost answer, or two publishers racing)."""


@dataclass(frozen=True)
class Batch:
    items: Sequence[str] | Sequence[Sequence[int]]
    """Per-item suffixes: all texts, or all token-id lists."""
    prefix: str | Sequence[int] | None = None
    """Shared prefix (same type as the items), prepended to every item; reused across calls."""

    @property
    def is_tokens(self) -> bool:
        return len(self.items) > 0 and not isinstance(self.items[0], str)

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when one appears; it is not included in `text`."""
    n: int = 1
    """Samples per item (GRPO groups); completions come back item-major: item0×n, item1×n, ..."""
    seed: int | None = None
    logprobs: bool = True
    """Return the sampled tokens' log-probabilities (under the unmodified softmax at temperature 1)."""
    thinking_budget: int | None = None
    """For `<think>` models: after this many thinking tokens, close the thought and ask for the answer."""
    structured: StructuredOutput | None = None
    """Constrain the answer to a JSON schema (llm/constrained.py; engines without support ignore it)."""


@dataclass
class Completion:
    token_ids: list[int]
    """Generated token ids (what training uses: never re-tokenize `text`)."""
    text: str
    logprobs: list[float] | None
    """Per generated token, log π(token) of the sampling policy; None if not requested/supported."""
    finish_reason: Literal["stop", "length", "budget"] | str
    """"stop": EOS or a stop string; "length": max_new_tokens reached; "budget": the thought was cut by
    the thinking budget and the answer then ended normally."""
    prompt_token_ids: list[int] = field(default_factory=list)
    """Full prompt (prefix + item) token ids as the engine saw them, when known."""
    thinking_tokens: int = 0
    forced_token_indices: list[int] = field(default_factory=list)
    """Indices into `token_ids` of tokens the engine inserted rather than sampled (the thinking-budget
    close); learners should mask them out of the policy loss. Their logprobs are the model's."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, declared by the engine: callers read these fields instead of probing for
    methods. The optional methods named below exist exactly when their field says so."""

    hidden_states: bool
    """`hidden_states(batch, layer, pooling)` returns (N, H) hidden states."""
    generate: bool
    """`generate(batch, sampling)` returns completions."""
    logprobs: bool
    """Completions carry the sampled tokens' logprobs (when `SamplingParams.logprobs`)."""
    prefix_reuse: bool
    """A batch's shared prefix is prefilled once and its KV reused (across the batch and calls)."""
    weight_update: bool = False
    """In-process weight sharing / update (the learner can change the weights it samples with)."""
    hidden_size: int | None = None
    num_layers: int | None = None
    token_ids_in: bool = False
    """Batch items (and prefix) may be token-id lists, fed to the model as they are."""
    token_ids_out: bool = False
    """`Completion.token_ids` are always the sampled ids (what training needs; never re-tokenize text)."""
    tokenizer: bool = False
    """The engine exposes its tokenizer in-process: `.tokenizer`, `tokenize_batch(batch) -> (prefix ids,
    item ids)` and `apply_chat_template(messages, ...)`; callers may build token-id batches with it."""
    device_tensors: bool = False
    """`hidden_states_torch(batch, layer, pooling)` returns the (N, H) float32 torch tensor on `device`
    (no host copy; hand it to JAX with `llm.dlpack.torch_to_jax`)."""
    device: str | None = None
    """Where an in-process engine computes ("cuda:0", "cpu"); None for remote engines."""
    per_token_hidden_states: bool = False
    """`token_hidden_states(token_ids, layer)` returns one sequence's (T, H) per-token hidden states."""
    sm_partition: bool = False
    """`set_sm_limit(n)` / `sm_limit` confine the engine's GPU work to n SMs (a CUDA green context; creating
    one may still fail with a UserError on a driver without them)."""
    continuous_batching: bool = False
    """`submit(GenerationRequest) -> handle`, `step()`, `poll() -> list[GenerationResult]`, `pending()` and
    `release(episode)`: requests join the running decode batch at step boundaries and leave it as soon as
    they finish (`generate` is a wrapper over them). Thread-safe: any thread may submit / poll / update
    weights; one thread at a time steps (or the engine's own thread, `start()` / `stop()`)."""
    turn_kv_reuse: bool = False
    """A request carrying an `episode` key keeps that episode's KV after it finishes; the episode's next
    request prefills only the tokens past what the engine still holds (compared token by token)."""
    remote_model_info: bool = False
    """A remote engine: `model_info()` asks its server for the model's facts (`ModelInfo`: hidden size,
    layers; one request, then cached) and `hidden_size` / `num_layers` here report them afterwards. Until
    then they are None: declaring capabilities never touches the network."""
    versioned_weights: bool = False
    """`update_weights(state, version)` applies new weights at a decode-step boundary with a version check;
    results record the weight version of every generated token (`GenerationResult.weight_versions`)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate (n = 1: submit n requests for n samples), token in, token out."""

    prompt: Sequence[int]
    """The full prompt token ids (shared prefix included)."""
    sampling: SamplingParams = SamplingParams()
    prefix_len: int = 0
    """The first `prefix_len` prompt tokens are a prefix shared by many requests (instructions): its KV is
    computed once and stored once, whatever the number of sequences reading it."""
    episode: Hashable | None = None
    """Multi-turn episodes: the engine keeps the KV of this episode's sequence (prompt + generated tokens)
    after the request finishes, and the episode's next request prefills only what lies past it. Call
    `release(episode)` when the episode ends (or let the engine evict it under memory pressure)."""
    tag: Any = None
    """Returned untouched in the result (the caller's bookkeeping)."""


@dataclass
class GenerationResult:
    """A finished request: the completion and how the engine produced it."""

    handle: int
    completion: Completion
    tag: Any = None
    episode: Hashable | None = None
    weight_versions: list[tuple[int, int]] = field(default_factory=list)
    """[(first token index, weight version), ...]: token i was sampled from logits of the version of the
    last entry whose index is <= i. One entry unless the weights changed mid-sequence (partial rollout)."""
    prefill_tokens: int = 0
    """Prompt tokens this request ran through the model."""
    reused_tokens: int = 0
    """Prompt tokens whose KV the engine already held (the shared prefix and the episode's earlier turns)."""
    shared_prefix_tokens: int = 0
    """Of `reused_tokens`, those of the shared prefix (the rest: the episode's own earlier turns)."""
    kv_fallback: bool = False
    """The prompt did not extend the episode's previous sequence (e.g. a chat template that drops earlier
    thoughts): the engine kept only the common token prefix and recomputed the rest (counted)."""
    thinking_budget: int | None = None
    error: str | None = None
    """Set when the engine failed while the request was queued or running (its completion is then empty,
    finish_reason "error"); the step that failed also raised."""

    @classmethod
    def failed(cls, handle: int, request: GenerationRequest, error: str) -> GenerationResult:
        """The result of a request the engine lost (`error` set, an empty completion, finish_reason "error")."""
        return cls(handle=handle, tag=request.tag, episode=request.episode, error=error, completion=Completion(
            token_ids=[], text="", logprobs=None, finish_reason="error", prompt_token_ids=[int(t) for t in request.prompt]))


class ModelInfo(TypedDict):
    """A served model's facts (`thinkcraft serve`'s and SGLang's `GET /get_model_info`, the size probed
    when a server does not report it)."""

    model_path: str
    hidden_size: int
    num_hidden_layers: int | None


@runtime_checkable
class Engine(Protocol):
    @property
    def capabilities(self) -> Capabilities: ...

    def hidden_states(
        self, batch: Batch, layer: int = -1, pooling: Literal["last", "mean"] = "last"
    ) -> np.ndarray:
        """(N, H) float32 hidden states of layer `layer` (negative counts from the top) pooled over each
        item's suffix tokens ("last" = last real token; "mean" = mean over the item's own tokens).
        Engines that live on a GPU may return a framework tensor via `hidden_states_device` instead."""
        ...

    def generate(self, batch: Batch, sampling: SamplingParams) -> list[Completion]: ...

    def close(self) -> None: ...
