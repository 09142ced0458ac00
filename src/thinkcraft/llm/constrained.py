"""Structured outputs: decoding constrained to a JSON schema, valid by construction.

The grammar engine is xgrammar (what vLLM and SGLang use; Dong et al. 2024, "XGrammar: Flexible and
Efficient Structured Generation Engine for Large Language Models"). A schema is compiled once per
tokenizer (vocabulary, stop tokens) into a token-level pushdown automaton; each row of a batch keeps a
matcher (its position in the grammar). Every decode step:

    mask = state.fill_mask()       # one batched call: allowed next tokens of every live row (bitmask)
    state.apply(logits)            # disallowed tokens -> -inf, in place, one kernel
    tok = sample(logits)
    state.advance(tok)             # one batched call: each live row's matcher accepts its token

After the object closes the grammar allows only the stop tokens, so a row ends right after `}` with
EOS, and every finished row parses. A row whose prompt ends inside a `<think>` thought starts its grammar
when the thought closes (a sampled `</think>`, or the end of the thinking budget's forced close): the
thought is the model's own, the answer after it is constrained (vLLM's reasoning-parser rule;
`answer_start` states it for replays). Rows whose token the matcher rejects (a token the engine forced,
or a pad after the engine ended the row on its own) are dropped from the constraint and counted in
`rejected`, never crash the batch.

On CUDA the sampled tokens come back through pinned memory after an event, recorded before the next
forward is queued: the host fills the next mask while the GPU runs that forward (the overlap vLLM's
structured-output backend uses), so the only per-step cost on the device is the mask copy and kernel.

Engines read `SamplingParams.structured` (a `StructuredOutput`) and hook a `GuideState` into their
decode loop (the hf engine: `llm/hf/iteration.py`, lines marked "structured outputs"; one state per schema
over all slots, a row opened when a request takes its slot and closed when it ends). `logprobs="constrained"` makes the
engine report log-probs of the masked, renormalised distribution the token was sampled from;
"model" (default) keeps the unmodified softmax, like unconstrained decoding.

Learners that train on "constrained" log-probs recompute the same distribution (`replay_masks`: every
completion replayed through a matcher, the allowed set at each position as a deduplicated bitmask table;
`rl.chunked_logprobs` takes it for a masked log-sum-exp).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from thinkcraft.utils.errors import UserError
# one JSON layout and one bitmask unpacker for the engine, the learner and the envs (re-exported here)
from thinkcraft.utils.structured import JSON_SEPARATORS, bitmask_to_bool  # noqa: F401

INSTALL_HINT = "structured outputs need xgrammar: pip install xgrammar"


@dataclass(frozen=True)
class StructuredOutput:
    """What a constrained answer must be (the engine-independent request; hashable, so compiled
    grammars are cached by it)."""

    json_schema: str
    """A JSON Schema (as JSON text) the answer must satisfy; the answer is one compact JSON value."""
    logprobs: Literal["model", "constrained"] = "model"
    """Reported log-probs: "model" = log softmax of the unmodified logits (as without a constraint);
    "constrained" = of the masked, renormalised distribution the token was actually sampled from."""

    @classmethod
    def from_schema(cls, schema: Mapping[str, Any], logprobs: Literal["model", "constrained"] = "model"
                    ) -> "StructuredOutput":
        return cls(json.dumps(schema, sort_keys=True), logprobs)

    def __post_init__(self) -> None:
        if self.logprobs not in ("model", "constrained"):
            raise UserError(f"StructuredOutput.logprobs must be 'model' or 'constrained', got {self.logprobs!r}")


def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    return xgrammar


def check_schema(schema: Mapping[str, Any] | str) -> None:
    """Raise a one-line UserError if xgrammar cannot build a grammar from this schema (no tokenizer
    needed: callers run it before loading a model)."""
    xgr = _xgr()
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/InvalidJSONError
        msg = str(e).strip().splitlines()
        raise UserError(f"schema cannot be turned into a grammar: {msg[0] if msg else type(e).__name__}") from None


class CompiledGuide:
    """A schema compiled for one tokenizer + vocabulary size + stop tokens (build with `compile_guide`).

    `vocab_size` is the logits' width; `grammar_vocab` the tokenizer's own size, the ids the grammar knows.
    xgrammar's masks are filled at the grammar's width and widened with the padded ids disallowed
    (`widen`): a padded LM head's ids (e.g. 151,936 logits for a 49,152-token vocabulary; Qwen3 pads its
    151,669 by 267) decode to no text, and a matcher built over them filled a JSON string's mask ~60x
    slower (measured on the CPU: 26.5 vs 0.44 ms for 64 rows) - enough to add 50% to a GPU decode step."""

    def __init__(self, compiled: Any, vocab_size: int, stop_ids: Sequence[int], grammar_vocab: int | None = None
                 ) -> None:
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.grammar_vocab = min(int(grammar_vocab or vocab_size), int(vocab_size))
        self.stop_ids = np.asarray(sorted(stop_ids), dtype=np.int64)
        self.mask_words = (int(vocab_size) + 31) // 32
        """Width (int32 words) of a mask over the logits."""
        self.grammar_words = (self.grammar_vocab + 31) // 32
        """Width of the masks xgrammar fills (ids past `grammar_vocab` are never allowed)."""

    def allocate(self, rows: int) -> torch.Tensor:
        """A (rows, grammar_words) int32 bitmask for xgrammar to fill (every token allowed)."""
        return _xgr().allocate_token_bitmask(rows, self.grammar_vocab)

    def widen(self, masks: torch.Tensor) -> torch.Tensor:
        """(rows, grammar_words) -> (rows, mask_words): the padded ids disallowed."""
        if masks.shape[-1] == self.mask_words:
            return masks
        out = torch.zeros((*masks.shape[:-1], self.mask_words), dtype=masks.dtype)
        out[..., :self.grammar_words] = masks
        return out

    def start(self, rows: int, device: torch.device | str, logprobs: str = "model") -> "GuideState":
        """Fresh matchers for a batch of `rows` sequences whose logits live on `device`."""
        return GuideState(self, rows, torch.device(device), logprobs)


@dataclass
class _CompilerEntry:
    tokenizer: Any
    """A weak reference to the tokenizer the compiler was built for (ids of dead objects get reused)."""
    compiler: Any
    guides: "OrderedDict[str, CompiledGuide]"


_COMPILERS: "OrderedDict[tuple, _CompilerEntry]" = OrderedDict()
_CACHE_SIZE = 8


def _lru_put(cache: OrderedDict, key: Any, value: Any) -> Any:
    cache[key] = value
    while len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)
    return value


def compile_guide(tokenizer: Any, vocab_size: int, stop_ids: Sequence[int], spec: StructuredOutput) -> CompiledGuide:
    """Compile `spec` for this tokenizer; cached (the tokenizer's vocabulary scan and the schema compile
    run once per tokenizer / schema, not per call). `vocab_size` is the model's logits width (it may
    exceed the tokenizer's: padded LM heads), `stop_ids` the engine's EOS ids."""
    import weakref

    xgr = _xgr()
    stops = tuple(sorted(int(s) for s in stop_ids))
    ckey = (id(tokenizer), int(vocab_size), stops)
    # the grammar over the tokenizer's own ids (see CompiledGuide); masks are widened to the logits
    grammar_vocab = min(int(vocab_size), len(tokenizer)) if hasattr(tokenizer, "__len__") else int(vocab_size)
    entry = _COMPILERS.get(ckey)
    if entry is None or entry.tokenizer() is not tokenizer:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=grammar_vocab, stop_token_ids=list(stops))
        entry = _lru_put(_COMPILERS, ckey, _CompilerEntry(weakref.ref(tokenizer), xgr.GrammarCompiler(info),
                                                          OrderedDict()))
    _COMPILERS.move_to_end(ckey)
    guide = entry.guides.get(spec.json_schema)
    if guide is None:
        try:
            compiled = entry.compiler.compile_json_schema(spec.json_schema, any_whitespace=False,
                                                          separators=JSON_SEPARATORS)
        except Exception as e:  # noqa: BLE001 - see check_schema
            msg = str(e).strip().splitlines()
            raise UserError(f"schema cannot be turned into a grammar: {msg[0] if msg else type(e).__name__}") from None
        guide = _lru_put(entry.guides, spec.json_schema, CompiledGuide(compiled, int(vocab_size), stops, grammar_vocab))
    return guide


def start_guide(sampling: Any, tokenizer: Any, stop_ids: Sequence[int], logits: torch.Tensor) -> "GuideState | None":
    """The engine hook: matcher state for a decode batch whose first logits are `logits` (rows, V), or
    None when `sampling.structured` is unset."""
    spec: StructuredOutput | None = sampling.structured
    if spec is None:
        return None
    guide = compile_guide(tokenizer, logits.shape[-1], stop_ids, spec)
    return guide.start(logits.shape[0], logits.device, spec.logprobs)


class GuideState:
    """Per-batch matcher state: `fill_mask`, `apply`, `advance`, `is_done` (see the module docstring)."""

    def __init__(self, guide: CompiledGuide, rows: int, device: torch.device, logprobs: str = "model") -> None:
        xgr = _xgr()
        self._xgr = xgr
        self.guide = guide
        self.device = device
        self.logprobs = logprobs
        self.matchers = [xgr.GrammarMatcher(guide.compiled) for _ in range(rows)]
        self.live = np.ones(rows, dtype=bool)
        """Rows still under the constraint (not terminated, not dropped)."""
        self.terminated = np.zeros(rows, dtype=bool)
        """Rows whose matcher accepted a stop token after a complete value: finished, valid."""
        self.rejected = 0
        """Tokens a matcher refused (forced/pad tokens); their rows leave the constraint."""
        self.waiting = np.zeros(rows, dtype=bool)
        """Rows inside a thought: their matcher starts once the engine reports the thought closed."""
        self._batch = xgr.BatchGrammarMatcher()
        cuda = device.type == "cuda"
        # xgrammar fills `_fill` at the grammar's width; `_mask_host` spans the logits: the padded ids' words
        # are 0 in rows under a grammar and -1 (all allowed) in the others, set when a row changes
        self._fill = guide.allocate(rows)
        self._mask_host = guide.widen(self._fill.clone())
        self._narrow = self._mask_host.shape[1] != self._fill.shape[1]
        if cuda:
            self._mask_host = self._mask_host.pin_memory()
        if not self._narrow:
            self._fill = self._mask_host
        self._mask_dev = self._mask_host.to(device) if cuda else self._mask_host
        self._tok_host = torch.zeros(rows, dtype=torch.long, pin_memory=cuda)
        self._closed_host = torch.zeros(rows, dtype=torch.bool, pin_memory=cuda)
        self._tok_ready: torch.cuda.Event | None = None
        self._pending = False
        self._pending_closed = False
        self._backend = "auto"

    # --- the per-step calls -----------------------------------------------------------------------

    def fill_mask(self) -> torch.Tensor:
        """The (rows, ceil(V/32)) int32 bitmask of allowed next tokens, on the logits' device: one
        batched xgrammar call for the live rows (rows out of the constraint allow every token)."""
        self._accept_pending()
        idx = np.flatnonzero(self.live)
        if len(idx):
            self._batch.batch_fill_next_token_bitmask([self.matchers[i] for i in idx], self._fill, idx.tolist())
            if self._narrow:
                self._mask_host[:, :self._fill.shape[1]].copy_(self._fill)
        if self._mask_dev is not self._mask_host:
            self._mask_dev.copy_(self._mask_host, non_blocking=True)
        return self._mask_dev

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask `logits` (rows, V) in place: tokens the grammar disallows get -inf."""
        mask = self.fill_mask()
        try:
            self._xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1], backend=self._backend)
        except ImportError:  # no Triton on this CUDA install: xgrammar's plain-torch kernel
            self._backend = "torch_native"
            self._xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1], backend=self._backend)
        return logits

    def advance(self, tokens: torch.Tensor, thought_closed: torch.Tensor | None = None) -> None:
        """Record this step's token of every row ((rows,) on the logits' device); the matchers accept
        them before the next mask. `thought_closed` ((rows,) bool, after this token: no thought open, no
        forced close under way) starts the waiting rows' grammars at the next token. On CUDA the copies
        are asynchronous: call this before queueing the next forward, so the host work overlaps it."""
        cuda = self.device.type == "cuda"
        self._tok_host.copy_(tokens, non_blocking=cuda)
        self._pending_closed = thought_closed is not None and bool(self.waiting.any())
        if self._pending_closed:
            self._closed_host.copy_(thought_closed, non_blocking=cuda)
        if cuda:
            self._tok_ready = torch.cuda.Event()
            self._tok_ready.record()
        self._pending = True

    def choose(self, logits: torch.Tensor, choose_fn: Any, want_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`choose_fn(masked logits) -> (token, log-probs)` (the engine's sampler) under the constraint;
        the log-probs are the model's unmodified ones unless the spec asks for the constrained ones."""
        model_logp = torch.log_softmax(logits, dim=-1) if want_logprobs and self.logprobs == "model" else None
        tok, logp = choose_fn(self.apply(logits))
        return tok, (model_logp if model_logp is not None else logp)

    def open_row(self, row: int, after_thought: bool = False) -> None:
        """Put `row` under the constraint from its first token (continuous batching: a new request took this
        slot), or with `after_thought` (its prompt ends inside a thought) from the first token after the
        thought closes (`advance`'s `thought_closed`). The other rows' pending tokens are accepted first
        (they belong to the step before)."""
        self._accept_pending()
        self.terminated[row] = False
        self.waiting[row] = after_thought
        if after_thought:
            self.live[row] = False
            self._free(row)
        else:
            self.matchers[row] = self._xgr.GrammarMatcher(self.guide.compiled)
            self.live[row] = True
            self._bind(row)

    def close_row(self, row: int) -> None:
        """Take `row` out of the constraint (its request ended; the slot may serve an unconstrained one)."""
        self._accept_pending()
        self.live[row] = self.waiting[row] = False
        self._free(row)

    @property
    def finished(self) -> bool:
        """Every row's answer ended (as of the tokens accepted so far: the engine learns it one step late,
        without waiting for the device)."""
        return bool(self.terminated.all())

    def is_done(self, row: int) -> bool:
        """Has this row's answer ended (complete value + stop token)?"""
        self._accept_pending()
        return bool(self.terminated[row])

    def all_done(self) -> bool:
        self._accept_pending()
        return not (self.live.any() or self.waiting.any())

    def constraining(self) -> bool:
        """Does any row's grammar mask the next token (pending tokens accepted, waiting rows started)?"""
        self._accept_pending()
        return bool(self.live.any())

    @property
    def watching(self) -> bool:
        """Rows whose tokens this state must see (under a grammar, or waiting for their thought to close)."""
        return bool(self.live.any() or self.waiting.any())

    # --- internals --------------------------------------------------------------------------------

    def _bind(self, rows: Any) -> None:
        """Rows that came under a grammar: their padded ids are disallowed (the grammar's own words are
        filled at every step)."""
        if self._narrow:
            self._mask_host[rows, self._fill.shape[1]:] = 0

    def _free(self, rows: Any) -> None:
        """Rows out of the constraint: every token allowed."""
        self._fill[rows] = -1
        self._mask_host[rows] = -1

    def _accept_pending(self) -> None:
        if not self._pending:
            return
        self._pending = False
        if self._tok_ready is not None:
            self._tok_ready.synchronize()
        idx = np.flatnonzero(self.live)
        if self._pending_closed:  # after the live rows took their tokens: a closed thought's last token is no answer's
            self._pending_closed = False
            for i in np.flatnonzero(self.waiting & self._closed_host.numpy()):
                self.matchers[i] = self._xgr.GrammarMatcher(self.guide.compiled)
                self.live[i], self.waiting[i] = True, False
                self._bind(i)
        if not len(idx):
            return
        toks = self._tok_host.numpy()[idx]
        ok = np.asarray(self._batch.batch_accept_token([self.matchers[i] for i in idx], toks.tolist()), dtype=bool)
        if not ok.all():
            bad = idx[~ok]
            self.rejected += len(bad)
            self.live[bad] = False
            self._free(bad)  # every token allowed again: the engine decides for these rows
        stopped = idx[ok & np.isin(toks, self.guide.stop_ids)]
        for i in stopped:  # a stop token is only accepted once the value is complete
            if self.matchers[i].is_terminated():
                self.terminated[i] = True
                self.live[i] = False
                self._free(i)


def constrained_log_softmax(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Reference for tests: log-softmax over the tokens a (rows, ceil(V/32)) int32 bitmask allows, -inf
    elsewhere."""
    allowed = bitmask_to_bool(bitmask, logits.shape[-1])
    return torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)


# --------------------------------------------------------------------------------------------- replays

def prompt_in_thought(prompt_ids: Sequence[int] | np.ndarray, open_id: int | None, close_id: int | None) -> bool:
    """Does the prompt end inside a `<think>` thought (its last open tag after its last close tag)? The
    engine's rule for a row's starting state."""
    if open_id is None:
        return False
    ids = np.asarray(prompt_ids)
    last = lambda x: int(np.flatnonzero(ids == x)[-1]) if x is not None and (ids == x).any() else -1  # noqa: E731
    return last(open_id) > last(close_id)


def answer_start(prompt_ids: Sequence[int], token_ids: Sequence[int], forced: Sequence[bool], open_id: int | None,
                 close_id: int | None) -> int:
    """Index of the first generated token a structured request's grammar constrains, as the engine opens it:
    0, or for a prompt that ends inside a thought the first sampled token after the thought closed (by a
    sampled close tag, or by the thinking budget's forced close sequence: `forced` flags its tokens);
    len(token_ids) when the thought never closed."""
    if not prompt_in_thought(prompt_ids, open_id, close_id):
        return 0
    closed = False
    for j, (t, f) in enumerate(zip(token_ids, forced)):
        if closed and not f:
            return j
        closed = closed or bool(f) or t == close_id
    return len(token_ids)


class ReplayMasks(NamedTuple):
    """The allowed sets of replayed completions: distinct bitmask rows and, per completion, each token's row."""

    bitmask: torch.Tensor
    """(M, ceil(V/32)) int32 (CPU): the distinct allowed sets (JSON positions repeat: M is small)."""
    index: list[np.ndarray]
    """Per completion, (len,) int64: the row of `bitmask` its token was sampled under; -1 = no constraint
    (before `start`, forced tokens, after the grammar ended or refused a token)."""


def replay_masks(guide: CompiledGuide, completions: Sequence[Sequence[int]], starts: Sequence[int],
                 forced: Sequence[Sequence[bool]] | None = None) -> ReplayMasks:
    """Replay each completion's tokens from `starts[i]` through a fresh matcher, as the engine's decode loop
    did: at every position the allowed set is filled (one batched call over the completions still under
    their grammar), then the token accepted. A token the matcher refuses (forced) takes its row out of the
    constraint, as in the engine; forced tokens keep no mask. The rows are deduplicated."""
    xgr = _xgr()
    n = len(completions)
    lens = np.array([len(c) for c in completions], dtype=np.int64)
    starts_a = np.minimum(np.asarray(starts, dtype=np.int64).reshape(n), lens)
    counts = lens - starts_a
    offs = np.cumsum(counts) - counts
    table = guide.allocate(max(int(counts.sum()), 1))  # at the grammar's width, widened below
    index = [np.full(int(k), -1, dtype=np.int64) for k in lens]
    matchers = [xgr.GrammarMatcher(guide.compiled) for _ in range(n)]
    live = counts > 0
    batch = xgr.BatchGrammarMatcher()
    for t in range(int(counts.max(initial=0))):
        idx = np.flatnonzero(live & (t < counts))
        if not len(idx):
            break
        pos = starts_a[idx] + t
        batch.batch_fill_next_token_bitmask([matchers[i] for i in idx], table, (offs[idx] + t).tolist())
        toks = [int(completions[i][p]) for i, p in zip(idx, pos)]
        ok = np.asarray(batch.batch_accept_token([matchers[i] for i in idx], toks), dtype=bool)
        for i, p, r, good in zip(idx, pos, offs[idx] + t, ok):
            if not (forced is not None and forced[i][p]):
                index[i][p] = r
            if not good or matchers[i].is_terminated():
                live[i] = False
    used = np.concatenate([x[x >= 0] for x in index] + [np.zeros(0, np.int64)])
    rows = guide.widen(table[torch.from_numpy(used)]).numpy()
    void = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).ravel()
    _, first, inverse = np.unique(void, return_index=True, return_inverse=True)
    remap = np.full(len(table), -1, dtype=np.int64)
    remap[used] = inverse.reshape(-1)
    return ReplayMasks(torch.from_numpy(rows[first].copy()), [np.where(x >= 0, remap[np.maximum(x, 0)], -1)
                                                              for x in index])
