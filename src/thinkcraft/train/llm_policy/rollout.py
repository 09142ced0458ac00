"""Rollouts: prompts (chat template, history) -> the engine -> env reward; episodes as trajectory-store
records. Token in, token out: sampled ids and logprobs are kept, never re-tokenized.

With an engine that batches continuously (`Capabilities.continuous_batching`, the in-process hf engine) every
episode runs on its own: a turn is submitted, and as soon as it comes back the episode's env steps (together
with the other episodes that are waiting, one batched env call) and its next turn is submitted, without
waiting for the slowest row of the batch. Prompts only grow (`history_turns < 0`, the default: the whole
history) - previous prompt + the sampled reply tokens + the new observation - so the engine keeps each
episode's KV between turns and prefills only the new tokens; the system prompt is a shared prefix stored
once. A chat template that is not append-only (Qwen3 drops earlier thoughts) is detected on the rendered
text: that turn is tokenized whole and counted (`kv/template_fallbacks`). Other engines: every turn of all
active episodes is one `generate` batch (lockstep).

JSON answers (`--action-format json`): an env with an `answer_schema` has every turn constrained to it
(`SamplingParams.structured`, log-probs of the constrained distribution, which the learner recomputes). With
a thinking budget the engine constrains the answer after the thought, so the prompt must open the thought:
where the chat template's generation prompt does not, `<think>\n` is appended (and kept in the history).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from thinkcraft.pools.contract import Trajectory, TurnRecord
from thinkcraft.train.llm_policy.config import LLMPolicyConfig
from thinkcraft.utils.errors import env_switch

log = logging.getLogger(__name__)


def build_messages(system: str, history: Sequence[tuple[str, str]], obs: str, history_turns: int) -> list[dict]:
    """Chat messages: system, the last K (observation, action) turns (all of them for K < 0), the current
    observation."""
    msgs = [{"role": "system", "content": system}] if system else []
    past = list(history) if history_turns < 0 else (list(history)[-history_turns:] if history_turns > 0 else [])
    for o, a in past:
        msgs += [{"role": "user", "content": o}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": obs})
    return msgs

def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(x) for x in ids]


def _render(tokenizer, messages: list[dict], generation_prompt: bool = True) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def _encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of rendered texts (no extra special tokens: the template wrote them), one batched call: the Rust
    tokenizer's `encode_batch_fast` where it gives the call's ids (`compat.rust_encoder`). On the CPU, the Craftax
    rollout's later-turn pieces (~235 characters, 128 a call) took 43-69 us each that way against 64-94 through
    `tokenizer(texts)` (the offsets and a `BatchEncoding` per text not made)."""
    if not texts:
        return []
    from thinkcraft.llm import compat

    # equal texts tokenized once: the G samples of a group share their first prompt (a quarter of a first turn's
    # texts with G = 4), and later ones where they saw the same observation
    first = dict.fromkeys(texts)
    uniq = list(first) if len(first) < len(texts) else texts
    rust = compat.rust_encoder(tokenizer)
    if rust is not None:
        ids = [e.ids for e in rust.encode_batch_fast(uniq, add_special_tokens=False)]
    else:
        ids = [list(x) for x in tokenizer(uniq, add_special_tokens=False)["input_ids"]]
    if uniq is texts:
        return ids
    for k, t in enumerate(uniq):
        first[t] = ids[k]
    return [list(first[t]) for t in texts]  # a list of its own each


def rollout(env, engine, tokenizer, seeds: Sequence[int], samples_per_seed: int, sampling, history_turns: int,
            timer=None, gen_context=None, metrics: dict | None = None, env_batch_frac: float = 0.25) -> list[Trajectory]:
    """Play one episode per (seed, sample): the G samples of a seed form group `index of the seed`.

    `metrics` (optional) receives the rollout's counters (`rollout_metrics` of the episodes plus the
    engine's evictions). `env_batch_frac`: with a continuous-batching engine, waiting episodes step their env
    together once they are this share of the running ones (or when the engine has nothing else to do).
    """
    phase = timer.phase if timer is not None else (lambda name: contextlib.nullcontext())
    gen_ctx = gen_context if gen_context is not None else contextlib.nullcontext
    all_seeds = [int(s) for s in seeds for _ in range(samples_per_seed)]
    episodes = [Trajectory(seed=s, group=i // samples_per_seed, sample=i % samples_per_seed) for i, s in enumerate(all_seeds)]
    sampling = replace(sampling, n=1, structured=answer_structure(env, sampling))
    if sampling.structured is not None and not engine.capabilities.continuous_batching:
        from thinkcraft.utils.errors import UserError

        raise UserError("--action-format json needs the in-process hf engine (constrained decoding)")
    t0 = time.perf_counter()  # the rollout's wall time, `timing/rollout`: every phase below and the host between
    before = engine.decode_metrics() if engine.capabilities.continuous_batching else {}
    with phase("env"):
        obs = env.reset(all_seeds)
    if engine.capabilities.continuous_batching:
        _Continuous(env, engine, tokenizer, episodes, obs, sampling, history_turns, phase, gen_ctx,
                    env_batch_frac).run()
    else:
        _lockstep(env, engine, tokenizer, episodes, obs, sampling, history_turns, phase, gen_ctx)
    wall = time.perf_counter() - t0
    for e in episodes:
        e.wall_time_s = wall
    if metrics is not None:
        metrics.update(rollout_metrics(episodes))
        if before:
            metrics.update(decode_metrics_delta(before, engine.decode_metrics()))
    if timer is not None:
        timer.add("rollout", time.perf_counter() - t0)
    return episodes


def decode_metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What an in-process engine's decode loop did between two `decode_metrics()` readings (summed over
    engines by the caller): KV evictions and invalidations, the mean wall time of one decode step (launch +
    collect, host included: against the GPU's own step time it shows a host-bound loop, e.g. one waiting for
    the GIL behind other threads) and the part of it the host spent waiting for the device's previous
    iteration (`decode_wait_ms`: near the step time = device-bound, near 0 = host-bound), rows per step, and
    rows the host ended past max_new_tokens."""
    from thinkcraft.llm.hf.device_timing import per_call_ms

    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = max(d.get("decode_steps", 0.0), 1.0)
    return {"kv/evictions": d.get("evictions", 0.0), "kv/invalidated": d.get("invalidated", 0.0),
            "engine/decode_steps": d.get("decode_steps", 0.0),  # the weight of the means below across updates
            "engine/decode_step_ms": 1000.0 * d.get("decode_s", 0.0) / steps,
            "engine/decode_wait_ms": 1000.0 * d.get("decode_wait_s", 0.0) / steps,
            "engine/rows_per_decode_step": d.get("generated_tokens", 0.0) / steps,
            "engine/host_length_ends": d.get("host_length_ends", 0.0),
            # where an update's generation time went: admissions (prefill forwards of the new turns' tokens, in
            # `prefill_calls` packed calls) and the decode loop; the rest of `timing/generate` the engine waited
            # for work (env steps, prompts)
            "engine/prefill_s": d.get("prefill_s", 0.0), "engine/prefill_calls": d.get("prefill_calls", 0.0),
            "engine/prefill_tokens": d.get("prefill_tokens", 0.0), "engine/decode_s": d.get("decode_s", 0.0),
            # decode graphs compiled and captured (a new width, prefix or dtype) and the seconds they took,
            # waits for another engine's capture included: a first step's compile time, seen
            "engine/graph_captures": d.get("graph_captures", 0.0),
            "engine/graph_capture_s": d.get("graph_capture_s", 0.0),
            # weight updates taken between decode steps, in three timed phases (host seconds; the copy's device
            # time shows in the next step): draining the step in flight, copying the tensors in, switching the
            # version (the shared prefix's KV recomputed, parked KV dropped)
            "engine/weight_drain_s": d.get("weight_drain_s", 0.0), "engine/weight_copy_s": d.get("weight_copy_s", 0.0),
            "engine/weight_switch_s": d.get("weight_switch_s", 0.0),
            # the switch's shared-prefix KV written by a CUDA-graph replay (prefix_graph.py) and, a state, whether
            # an engine's graph turned itself off (its check or capture failed: the eager forward since)
            "engine/prefix_graph_replays": d.get("prefix_graph_replays", 0.0),
            "engine/prefix_graph_failed": after.get("prefix_graph_failed", 0.0),
            # the packed prefill's calls replayed from CUDA graphs (prefill_graphs.py), the graphs captured and
            # their seconds, calls too large for one (eager); a state: whether an engine's graphs turned off
            "engine/prefill_graph_replays": d.get("prefill_graph_replays", 0.0),
            "engine/prefill_graph_captures": d.get("prefill_graph_captures", 0.0),
            "engine/prefill_graph_capture_s": d.get("prefill_graph_capture_s", 0.0),
            "engine/prefill_graph_declined": d.get("prefill_graph_declined", 0.0),
            "engine/prefill_graph_failed": after.get("prefill_graph_failed", 0.0),
            # a state, not a count: the decode step's attention, 1 per engine on FlashAttention over the slots (the
            # async pools sum their engines' counters), 0 on the matmuls
            "engine/flash_decode": after.get("flash_decode", 0.0),
            # a state too: the one-pass sampler served (fused_sampler.py), per engine
            "engine/fused_sampler": after.get("fused_sampler", 0.0),
            # and the split-KV decode attention (split_decode.py) in place of FlashAttention's, per engine
            "engine/split_decode": after.get("split_decode", 0.0),
            # opt-in (THINKCRAFT_DEVICE_TIMING=1, device_timing.py): the device's time in each phase and idle between
            # phases, per phase or gap (`engine/dev_*_ms`) and in all (`engine/dev_*_s`)
            **per_call_ms(d)}


def answer_structure(env, sampling):
    """What the env's answers are constrained to: a `StructuredOutput` of its `answer_schema` with log-probs of
    the constrained distribution (the learner's ratio compares like with like), or the sampling's own."""
    schema = getattr(env, "answer_schema", None)
    if schema is None:
        return sampling.structured
    import json

    from thinkcraft.llm.constrained import StructuredOutput

    return StructuredOutput(json.dumps(schema), logprobs="constrained")  # property order kept: reason first


THOUGHT_OPENER = "<think>\n"


def _needs_opener(sampling, text: str) -> bool:
    """A constrained turn with a thinking budget whose rendered prompt does not end inside a thought."""
    if sampling.structured is None or sampling.thinking_budget is None:
        return False
    return text.rfind("<think>") <= text.rfind("</think>")


def _turn(obs: str, prompt: list[int], c, res, j: int, **extra) -> TurnRecord:
    """The record of completion `c` (the env's result row `j`)."""
    return TurnRecord.of_completion(obs, prompt, c, res.rewards[j], res.infos[j].get("invalid", False),
                                    dict(res.infos[j]), **extra)


def _lockstep(env, engine, tokenizer, episodes, obs, sampling, history_turns, phase, gen_ctx) -> None:
    """Every turn of the active episodes as one `generate` batch (engines without continuous batching)."""
    from thinkcraft.llm.protocol import Batch

    histories: list[list[tuple[str, str]]] = [[] for _ in episodes]
    while active := env.active_indices():
        with phase("generate"):
            prompts = [encode_prompt(tokenizer, build_messages(env.system_prompt, histories[i], obs[i], history_turns))
                       for i in active]
            with gen_ctx():
                comps = engine.generate(Batch(items=prompts), sampling)
        with phase("env"):
            res = env.step([c.text for c in comps])
        for j, i in enumerate(active):
            episodes[i].turns.append(_turn(obs[i], prompts[j], comps[j], res, j,
                                           thinking_budget=sampling.thinking_budget, structured=sampling.structured))
            histories[i].append((obs[i], comps[j].text))
            obs[i] = res.observations[j]
            if res.terminated[j] or res.truncated[j]:
                episodes[i].terminated, episodes[i].truncated = bool(res.terminated[j]), bool(res.truncated[j])


_ROLLOUT_IDS = itertools.count()


@dataclass
class _Chat:
    """One episode's conversation: its messages, the rendered text of the current prompt and its ids."""

    messages: list[dict]
    text: str = ""
    ids: list[int] = field(default_factory=list)
    fallback: bool = False
    opener: str = ""
    """What the rollout appended to the rendered prompt (`THOUGHT_OPENER` or ""): part of the reply's message."""


class ChatPrompts:
    """The prompts of `n` episodes, turn by turn, token in / token out (the sync rollout's continuous path and
    the async rollout pool's workers both build theirs here). With the whole history (`history_turns < 0`) an
    episode's next prompt is its previous prompt's ids + the reply's sampled ids + the tokens of what the chat
    template writes after the reply (the new observation): prompts only grow, token for token, so an engine
    can keep the episode's KV and the learner can train its turns as one row. A template that rewrote earlier
    turns (detected on the rendered text) gets that prompt tokenized whole (`_Chat.fallback`). A history
    window renders every prompt anew. One batched tokenizer call per `next`, under `lock` (a fast tokenizer
    shared by threads can fail "Already borrowed"). `sampling`: a constrained answer under a thinking budget
    gets `THOUGHT_OPENER` appended where the template does not open the thought (`_needs_opener`).

    Without rendering (`fast`, THINKCRAFT_FAST_PROMPTS, on): a template that writes every message on its own
    (the end of a reply, then the user turn around its content, then the generation prompt) adds, after a
    reply, the same text around every observation - found once by rendering marker messages (`_wrapper`;
    refused where the markers do not come back verbatim: a template that trims, escapes or reorders content).
    Each later turn's piece is then that text around the observation, where rendering the whole conversation
    again cost the host ~0.3-0.5 ms a decision, growing with the turns (bench/probes/chat_render_probe.py).
    Every `next` still renders one episode's conversation whole and compares; a template whose rendering
    depends on more than the message (Qwen3 drops earlier thoughts, some number the turns) fails that check
    and every prompt is rendered whole from then on (`rendered_whole_after_check`, a warning)."""

    def __init__(self, tokenizer, system_prompt: str, n: int, history_turns: int, lock: Any = None,
                 sampling: Any = None) -> None:
        self.tok, self.system_prompt, self.history_turns = tokenizer, system_prompt, history_turns
        self.sampling = sampling
        self.append_only = history_turns < 0
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.chats = [_Chat(messages=list(self.system)) for _ in range(n)]
        self.histories: list[list[tuple[str, str]]] = [[] for _ in range(n)]
        self._obs: list[str | None] = [None] * n
        self.specials = {i: tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.all_special_ids}
        self._special_texts = sorted({t for t in self.specials.values() if t}, key=len, reverse=True)
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self._prefix: np.ndarray | None = None
        self._prefix_list: list[int] = []  # the same ids as a list, made with `_prefix`
        self._prefix_text = ""  # the rendered system prompt they are the ids of, made with `_prefix`
        self.split_prefix = True
        """Whole prompts that start with the shared prefix are tokenized after it (`_encode`); off for good after a
        whole tokenization differed."""
        self.fast = self.append_only and env_switch("THINKCRAFT_FAST_PROMPTS", default=True)
        self._wrap: tuple[str, str] | None | bool = False  # (after a reply, after an observation); False: not yet
        self.fast_pieces = 0
        """Pieces built without rendering."""
        self.reuse_reply_text = not (sampling is not None and getattr(sampling, "stop", None))
        """A reply without special tokens takes its completion's text (`_reply_texts`): no stop strings (they cut the
        text), and off for good after a check differed."""
        self.rendered_whole_after_check = False
        """The per-`next` check found a whole render that the pieces did not match: rendering whole since."""

    @property
    def prefix(self) -> np.ndarray:
        """The token ids of the rendered system prompt: the prefix every episode's prompts share."""
        if self._prefix is None:
            text = _render(self.tok, self.system, False) if self.system else ""
            with self.lock:
                ids = _encode_texts(self.tok, [text])[0] if self.system else []
            self._prefix, self._prefix_list, self._prefix_text = np.asarray(ids, dtype=np.int64), list(ids), text
        return self._prefix

    def prefix_len(self, ids: Sequence[int]) -> int:
        """How many leading tokens of prompt `ids` are the shared prefix (0 when it does not start with it)."""
        p = len(self.prefix)
        if not 0 < p < len(ids):
            return 0
        if type(ids) is list:  # the prompts' lists: compared as lists (no array made of each prompt's head)
            return p if ids[:p] == self._prefix_list else 0
        return p if np.array_equal(np.asarray(ids[:p]), self.prefix) else 0

    def next(self, idx: Sequence[int], obs: Sequence[str], comps: Sequence[Any]) -> list[list[int]]:
        """The next prompts' ids of episodes `idx`, given their new observations and their last completions
        (None on the first turn)."""
        self.prefix  # made before the lock is taken (the property takes it): `_encode` tokenizes after it
        with self.lock:
            # one episode rendered whole and compared first: the others then need no render (or, after a
            # mismatch, all are rendered)
            check = next((k for k, c in enumerate(comps) if c is not None), None) if self._fast_ready() else None
            order = ([check] if check is not None else []) + [k for k in range(len(idx)) if k != check]
            pieces: list[str] = [""] * len(idx)
            if self.append_only:
                replies, self.reuse_reply_text = _reply_texts(self.tok, comps, self.specials, self.reuse_reply_text)
            else:
                replies = [None] * len(idx)
            for k in order:
                pieces[k] = self._piece(idx[k], obs[k], comps[k], replies[k], verify=k == check)
            for i, ids in zip(idx, self._encode(pieces, [not self.chats[i].ids for i in idx])):
                # in place: `_piece` has just made the chat's list (the previous prompt's, which a turn record may
                # hold, is never changed) - one copy of the growing prompt a turn, not two
                self.chats[i].ids.extend(ids)
        return [self.chats[i].ids for i in idx]

    def _encode(self, pieces: list[str], whole: list[bool]) -> list[list[int]]:
        """The ids of `pieces` (`whole`: the piece is a whole prompt, a first turn's), one batched tokenizer call.
        A whole prompt that is the shared prefix's text followed by a special token (ChatML's `<|im_start|>`) is
        tokenized as the prefix's ids + those of the rest: a fast tokenizer splits its input at special tokens
        before anything else, so the text before one is tokenized on its own. On the CPU the Craftax rollout's first
        turn (128 prompts of ~2,100 characters, ~1,900 of them the system prompt) was ~70 of the ~140 ms a
        1,024-decision rollout spent tokenizing. One such prompt a call is still tokenized whole and compared (a
        tokenizer whose special tokens take in the whitespace before them, `lstrip`, would differ): a mismatch is
        logged and tokenizes whole prompts whole from then on (`split_prefix`)."""
        pre = self._prefix_text
        cut, lead = [False] * len(pieces), None
        if self.split_prefix and pre:
            for k, piece in enumerate(pieces):
                if whole[k] and piece.startswith(pre):
                    if lead is None:  # the special token the first such rest starts with; the others must too
                        lead = next((t for t in self._special_texts if piece.startswith(t, len(pre))), "")
                    cut[k] = bool(lead) and piece.startswith(lead, len(pre))
        if not any(cut):
            return _encode_texts(self.tok, pieces)
        check = cut.index(True)
        ids = _encode_texts(self.tok, [p[len(pre):] if c else p for p, c in zip(pieces, cut)] + [pieces[check]])
        if ids.pop() == self._prefix_list + ids[check]:
            return [self._prefix_list + x if c else x for x, c in zip(ids, cut)]
        self.split_prefix = False
        log.warning("the tokenizer does not tokenize a prompt as its shared prefix + the rest: whole prompts are "
                    "tokenized whole from now on")
        return _encode_texts(self.tok, pieces)

    def _fast_ready(self) -> bool:
        return self.fast and not self.rendered_whole_after_check and self._wrapper() is not None

    def _wrapper(self) -> tuple[str, str] | None:
        """(what the template writes between a reply's content and the next user message's, what it writes after
        a user message's content up to the reply: its end, the generation prompt), from one render of marker
        messages with spaces around them (a template that trims or escapes content loses them: None)."""
        if self._wrap is False:
            reply, user = " @@thinkcraft-reply-7f3a@@ ", " @@thinkcraft-obs-7f3a@@ "
            turn = [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]
            first = [{"role": "user", "content": " @@thinkcraft-first-7f3a@@ "}]
            early = [{"role": "assistant", "content": " @@thinkcraft-early-7f3a@@ "},
                     {"role": "user", "content": " @@thinkcraft-second-7f3a@@ "}]
            # after one exchange and after two: a template that numbers turns (or looks at the message count)
            # writes different text around the same marker
            wraps = {self._marked(first + turn, reply, user), self._marked(first + early + turn, reply, user)}
            self._wrap = wraps.pop() if len(wraps) == 1 else None
        return self._wrap  # type: ignore[return-value]

    def _marked(self, msgs: list[dict], reply: str, user: str) -> tuple[str, str] | None:
        """`_wrapper`'s two texts in one render of `msgs` (system first), or None."""
        try:
            text = _render(self.tok, self.system + msgs)
        except Exception:  # noqa: BLE001 - a template refusing these messages: render whole
            return None
        if text.count(reply) != 1 or text.count(user) != 1 or text.index(reply) > text.index(user):
            return None
        a, u = text.index(reply) + len(reply), text.index(user)
        return text[a:u], text[u + len(user):]

    def _piece(self, i: int, obs: str, c: Any, reply: tuple[str, str] | None = None, verify: bool = False) -> str:
        """The text still to tokenize for episode i's next prompt (its chat updated to that prompt); `reply`: the
        last completion's `_reply_texts` (whole history). `verify`: rendered whole and compared with the piece
        `_wrapper` gives (a mismatch: render whole from now on)."""
        tok, chat = self.tok, self.chats[i]
        if c is not None:
            self.histories[i].append((self._obs[i], c.text))
        self._obs[i] = obs
        if not self.append_only:  # a history window: every prompt is new (the shared prefix is still reused)
            chat.text = _render(tok, build_messages(self.system_prompt, self.histories[i], obs, self.history_turns))
            chat.text += self._opener(chat.text)
            chat.ids = []
            return chat.text
        sent = None
        if c is not None:
            # the reply as the model produced it (special tokens it sampled included, the closing EOS left
            # to the template): the rendered history then extends exactly what the model saw
            content, end = reply  # type: ignore[misc]
            sent = chat.text + content + end
            chat.messages.append({"role": "assistant", "content": chat.opener + content})
        chat.messages.append({"role": "user", "content": obs})
        fast = None
        if sent is not None and self._fast_ready():
            after_reply, after_obs = self._wrapper()  # type: ignore[misc]
            if after_reply.startswith(end):  # the reply's sampled end is the template's
                fast = after_reply[len(end):] + obs + after_obs
        if fast is not None and not verify:
            self.fast_pieces += 1
            text = sent + fast  # type: ignore[operator]
        else:
            text = _render(tok, chat.messages)
            if verify and fast is not None and text != sent + fast:  # type: ignore[operator]
                self.rendered_whole_after_check = True
                log.warning("the chat template does not write each message on its own (a whole render differed from "
                            "the piece around the observation): every prompt is rendered whole from now on")
        chat.opener = self._opener(text)
        text += chat.opener
        chat.fallback = sent is not None and not text.startswith(sent)
        chat.text = text
        if sent is None or chat.fallback:
            chat.ids = []
            return text  # the whole prompt (first turn, or a template that rewrote earlier turns)
        chat.ids = chat.ids + list(c.token_ids)
        return text[len(sent):]  # only what the template added after the reply

    def _opener(self, text: str) -> str:
        return THOUGHT_OPENER if self.sampling is not None and _needs_opener(self.sampling, text) else ""


class _Continuous:
    """The continuous-batching rollout (see the module docstring): submit, step the engine, step the env of
    the episodes whose turn came back, submit their next turn."""

    def __init__(self, env, engine, tokenizer, episodes, obs, sampling, history_turns, phase, gen_ctx,
                 env_batch_frac) -> None:
        self.env, self.engine, self.tok, self.episodes, self.obs = env, engine, tokenizer, episodes, list(obs)
        self.sampling, self.history_turns, self.phase, self.gen_ctx = sampling, history_turns, phase, gen_ctx
        self.env_batch_frac = env_batch_frac
        self.env_chunked = env_switch("THINKCRAFT_ENV_CHUNKED")
        """Each submit chunk's turns step the env on their own (`_env_step`; off: one env call a boundary)."""
        self.append_only = history_turns < 0
        self.rid = next(_ROLLOUT_IDS)
        self.prompts = ChatPrompts(tokenizer, env.system_prompt, len(episodes), history_turns, sampling=sampling)
        self.chats = self.prompts.chats
        self.prefix = self.prompts.prefix
        self.in_flight: set[int] = set()
        self.pending: list[Any] = []
        """Turns back from the engine whose env step has not happened yet."""
        self.deferred: deque[Callable[[], None]] = deque()
        """Host work that waits for the device's shadow: the turn records of the last env step, in chunks, one
        chunk after each engine step (`run`)."""

    def run(self) -> None:
        n = len(self.episodes)
        with self.phase("generate"):
            self._submit(list(range(n)), [None] * n)
            if self.append_only:  # size the cache for whole episodes once (no reallocation as they grow)
                first = max(len(c.ids) for c in self.chats) - len(self.prefix)
                per_turn = first + self.sampling.max_new_tokens + 16
                self.engine.reserve(n, per_turn * max(int(self.env.max_turns), 1), len(self.prefix))
        while self.in_flight or self.pending:
            if self.in_flight:
                with self.phase("generate"), self.gen_ctx():
                    self.engine.step()
                    self.pending += self.engine.poll()
                if self.deferred:  # the step just launched the next iteration: the device is busy for a while
                    with self.phase("records"):
                        self.deferred.popleft()()
            self.in_flight.difference_update(r.tag for r in self.pending)
            waiting = len(self.pending)
            if waiting and (not self.in_flight or waiting >= self.env_batch_frac * (waiting + len(self.in_flight))):
                results, self.pending = self.pending, []
                self._env_step(results)
        self._flush()

    def _env_step(self, results: list) -> None:
        self._flush()  # the previous env step's records first: an episode's turns stay in order
        # episodes still decoding (the ones back are out of `in_flight`): none where the turn runs in lockstep
        others = bool(self.in_flight)
        if not self.env_chunked or len(results) <= SUBMIT_CHUNK:
            self._env_chunk(results, others, last=True)
            return
        # THINKCRAFT_ENV_CHUNKED=1: each chunk of SUBMIT_CHUNK turns steps its own env call, then its prompts are
        # built, submitted and admitted (prefilled: the device runs it) before the next chunk's env call - the
        # env's host side (dispatch, copy back, render) of every chunk after the first overlaps a prefill too,
        # for one more env dispatch a chunk (the masked step runs every env each call)
        for a in range(0, len(results), SUBMIT_CHUNK):
            self._env_chunk(results[a : a + SUBMIT_CHUNK], others, last=a + SUBMIT_CHUNK >= len(results))

    def _env_chunk(self, results: list, others: bool, last: bool) -> None:
        """One env call for the turns of `results`, then their episodes' next prompts submitted in chunks
        (`others`: episodes outside this boundary are decoding; `last`: the boundary's last env call - its final
        chunk is left for the next `step` to admit)."""
        idx = [r.tag for r in results]
        with self.phase("env"):
            texts = [r.completion.text for r in results]
            # all active episodes in their own order: the plain protocol call; a subset: `indices`
            res = self.env.step(texts) if idx == self.env.active_indices() else self.env.step(texts, indices=idx)
        nxt, comps = [], []
        # what each turn's record needs, taken before the next prompts are built (`ChatPrompts.next` gives a chat
        # a new ids list and fallback flag; the list taken here is never changed)
        turns = [(i, self.obs[i], self.chats[i].ids, self.chats[i].fallback, r) for i, r in zip(idx, results)]
        for j, (i, r) in enumerate(zip(idx, results)):
            self.obs[i] = res.observations[j]
            if res.terminated[j] or res.truncated[j]:
                ep = self.episodes[i]
                ep.terminated, ep.truncated = bool(res.terminated[j]), bool(res.truncated[j])
                self.engine.release((self.rid, i))
            else:
                nxt.append(i)
                comps.append(r.completion)
        # The records wait for the engine's decode steps (`run`: one chunk after each): built here, they held up
        # the next prefill by a few ms a turn of host work the device would have idled through
        for a in range(0, len(turns), RECORD_CHUNK):
            self.deferred.append(functools.partial(self._records, res, a, turns[a : a + RECORD_CHUNK]))
        # Prompts are built and submitted in chunks, the engine prefilling each while the host renders and tokenizes
        # the next (one thread; the engine only queues device work) - with `admit` where the engine has it and no
        # other episode is decoding (no decode step yet: the whole turn decodes in lockstep), else with a `step`
        # (the other episodes' decode goes on meanwhile)
        admit = self.engine.step if others else getattr(self.engine, "admit", self.engine.step)
        for a, b in submit_bounds(len(nxt)):
            with self.phase("generate"):
                self._submit(nxt[a:b], comps[a:b])
                if b < len(nxt) or not last:
                    with self.gen_ctx():
                        admit()
                    self.pending += self.engine.poll()

    def _records(self, res: Any, first: int, turns: list[tuple[int, str, list[int], bool, Any]]) -> None:
        """The turn records of `turns` (rows `first`, `first + 1`, ... of env result `res`)."""
        structured = self.sampling.structured
        for j, (i, obs, ids, fallback, r) in enumerate(turns, first):
            self.episodes[i].turns.append(_turn(
                obs, ids, r.completion, res, j, thinking_budget=r.thinking_budget, prefill_tokens=r.prefill_tokens,
                reused_tokens=r.reused_tokens, shared_prefix_tokens=r.shared_prefix_tokens,
                template_fallback=fallback, weight_versions=r.weight_versions, structured=structured))

    def _flush(self) -> None:
        """Every deferred piece of host work, now."""
        if self.deferred:
            with self.phase("records"):
                while self.deferred:
                    self.deferred.popleft()()

    def _submit(self, idx: list[int], comps: list) -> None:
        """Next prompts of episodes `idx` (their last completions `comps`, None on the first turn), tokenized
        in one batched call, and submitted."""
        from thinkcraft.llm.protocol import GenerationRequest

        with self.phase("prompts"):  # inside `generate`: the next prompts' host work alone (`timing/prompts`)
            prompts = self.prompts.next(idx, [self.obs[i] for i in idx], comps)
        reqs = [GenerationRequest(ids, self.sampling, prefix_len=self.prompts.prefix_len(ids), tag=i,
                                  episode=(self.rid, i) if self.append_only else None) for i, ids in zip(idx, prompts)]
        many = getattr(self.engine, "submit_many", None)  # one lock and wake-up for the chunk, where the engine has it
        if many is not None:
            many(reqs)
        else:
            for req in reqs:
                self.engine.submit(req)
        self.in_flight.update(idx)


RECORD_CHUNK = 16
"""Turn records built after one engine step (`_Continuous.deferred`): ~20 us each on a 2-core CPU, so a chunk
stays well inside one decode step's device time (~3 ms for the 0.5B shape at 256 rows, H200)."""

def submit_bounds(n: int) -> list[tuple[int, int]]:
    """The (start, end) of each chunk of `n` next prompts built and submitted before the engine steps again: chunks of
    `SUBMIT_CHUNK`, the first of them `SUBMIT_FIRST` long where that is set (and shorter than a chunk)."""
    first = SUBMIT_FIRST if 0 < SUBMIT_FIRST < min(SUBMIT_CHUNK, n) else 0
    starts = ([0] if first else []) + list(range(first, n, SUBMIT_CHUNK))
    return [(a, min(b, n)) for a, b in zip(starts, starts[1:] + [n])]


SUBMIT_FIRST = 0
"""The length of a boundary's first submit chunk where it is shorter than the others (0: every chunk
`SUBMIT_CHUNK`). Why: the device idles through the first chunk's host work (its prompts, submit, admission) and
then prefills it while the host builds the next; a prefill costs the device several times what its prompts cost the
host (a Craftax turn at 256 envs, H100 s64-1: ~64 ms of prefill, ~35 ms of host work between the env and the
prefill), so a short first chunk (16 prompts) exposes little of the host's work and each later chunk is built while
the one before is prefilled - where the chunks' prefills replay from CUDA graphs (~1 ms of host a call; an eager
prefill launches for about as long as it runs). Opt-in until measured (the Craftax bench's `--variants
first=16,chunk=128`)."""

SUBMIT_CHUNK = 256
"""Episodes whose next prompt is built and submitted before the engine is stepped again (see `_env_step`).
Larger chunks mean fewer, larger prefills and env steps; smaller ones more overlap of host and GPU. Measured on one
H200 (Craftax, Qwen2.5-0.5B shape, 256 envs, merged LoRA weights, 2026-11-29, BENCHMARKS §7b): 64 -> 256 took a
turn's prefills from 42 calls (1.6 s) to 13 (0.8 s) and the rollout from 509 to 706 decisions/s (1.39x); the
overlap lost cost less than the per-call host time saved. Since the chunks are prefilled with `admit` (the turn in
lockstep; 2026-12-03, H200, every other default, BENCHMARKS §7b): 128 gave 961-1,048 decisions/s (settled 1,098-1,168)
against 1,036-1,121 for 256 - no clear gain, the chunks' prefill shapes capturing CUDA graphs in the first steps."""


def _reply_texts(tok, comps: Sequence[Any], specials: dict[int, str], reuse: bool = False
                 ) -> tuple[list[tuple[str, str] | None], bool]:
    """Per completion (None: a first turn, None back): (the reply's text as sampled, special tokens included,
    without the special token that ended it; that token's text): the template writes its own end of turn after the
    content. The replies decoded in one batched call (`compat.decode_batch`), and with `reuse` (sampling without stop
    strings, which cut a completion's text) a reply with no special token in its body takes the completion's own
    text instead - the engine decoded the same ids with special tokens skipped, and there are none to skip: for the
    Craftax rollout's 256 replies a turn, the second decode of every one gone. One reused reply is decoded anyway
    and compared; the second value is False where it differed (the caller then stops reusing: a tokenizer whose
    decode differs with the flag even without special tokens)."""
    from thinkcraft.llm import compat

    at, bodies, ends, reused = [], [], [], []
    out: list[tuple[str, str] | None] = [None] * len(comps)
    for k, c in enumerate(comps):
        if c is None:
            continue
        ids = c.token_ids
        ended = bool(ids) and c.finish_reason in ("stop", "budget") and ids[-1] in specials
        body = ids[:-1] if ended else ids
        end = specials[ids[-1]] if ended else ""
        if reuse and not any(t in specials for t in body):
            out[k] = (c.text, end)
            reused.append((k, body))
            continue
        at.append(k)
        bodies.append(list(body))
        ends.append(end)
    check = reused[0] if reused else None
    texts = compat.decode_batch(tok, bodies + ([list(check[1])] if check else []), skip_special_tokens=False)
    if check is not None and texts.pop() != out[check[0]][0]:  # type: ignore[index]
        log.warning("a reply's text with special tokens kept differs from the engine's (skipped) although it has none: "
                    "every reply is decoded again from now on")
        return _reply_texts(tok, comps, specials, reuse=False)[0], False
    for k, text, end in zip(at, texts, ends):
        out[k] = (text, end)
    return out, True


def rollout_metrics(episodes: Sequence[Trajectory]) -> dict[str, float]:
    """Per-rollout counters: prefill tokens the engine ran and the share turn reuse (and the shared prefix)
    saved, template fallbacks, thinking length and budget per turn, budget hits."""
    turns = [t for e in episodes for t in e.turns]
    if not turns:
        return {}
    pre = sum(t.prefill_tokens for t in turns)
    reused = sum(t.reused_tokens for t in turns)
    by_turns = reused - sum(t.shared_prefix_tokens for t in turns)
    out = {
        "kv/prefill_tokens": float(pre),
        "kv/reused_tokens": float(reused),
        "kv/prefill_saved_frac": reused / max(pre + reused, 1),
        "kv/turn_reuse_saved_frac": by_turns / max(pre + reused, 1),
        "kv/template_fallbacks": float(sum(t.template_fallback for t in turns)),
        "thinking/tokens_mean": float(np.mean([t.thinking_tokens for t in turns])),
        "thinking/budget_hit_rate": float(np.mean([0 in t.train_mask for t in turns])),
        "perf/weight_switches": float(sum(max(len(t.weight_versions) - 1, 0) for t in turns)),
    }
    budgets = [t.thinking_budget for t in turns if t.thinking_budget is not None]
    if budgets:
        out["thinking/budget"] = float(np.mean(budgets))
    return out

def _split_think(text: str) -> tuple[str, str]:
    """(thought, answer) of a `<think>` model's reply; ("", text) when there is no closed thought."""
    head, sep, tail = text.partition("</think>")
    if not sep:
        return "", text
    return head.replace("<think>", "").strip(), tail.strip()

def episode_record(e: Trajectory, env_name: str, policy_version: int, extra: dict[str, Any]):
    from thinkcraft.data.schema import TrajectoryMetadata, TrajectoryRecord, Turn

    turns = [
        Turn(think=_split_think(t.text)[0], act=_split_think(t.text)[1], obs=t.obs, reward=t.reward, done=(k == len(e.turns) - 1),
             prompt_token_ids=np.asarray(t.prompt_ids, dtype=np.int32),
             response_token_ids=np.asarray(t.completion_ids, dtype=np.int32),
             logprobs=np.asarray(t.logprobs, dtype=np.float32),
             loss_mask=np.asarray(t.train_mask, dtype=np.int8))
        for k, t in enumerate(e.turns)
    ]
    md = TrajectoryMetadata(env_version=env_name, wall_time=e.wall_time_s, truncated=e.truncated,
                            policy_version=policy_version, seed=e.seed,
                            extra={"group": e.group, "invalid_turns": sum(t.invalid for t in e.turns), **extra})
    return TrajectoryRecord.build(task_id=f"{env_name}/{e.seed}", turns=turns, metadata=md)


# ================================================================================================ run

def make_env_and_reward(cfg: LLMPolicyConfig, judge: tuple[Any, Any] | None = None):
    """The text env with its reward. arith/gsm8k: the `####` rule reward, or with `judge` = (engine, prompt
    format) an LLM judge (`--reward judge`; the loop builds the judge once the policy exists, `make_judge`)."""
    from thinkcraft.envs.textenvs import JudgeReward, RuleReward, make_text_env

    reward_fn = None
    if cfg.env in ("arith", "gsm8k"):
        if judge is not None:
            engine, fmt = judge
            reward_fn = JudgeReward(engine, answer_weight=cfg.answer_weight, format_weight=cfg.format_weight,
                                    format_prompt=fmt)
        else:
            reward_fn = RuleReward(answer_weight=cfg.answer_weight, format_weight=cfg.format_weight,
                                   lenient=cfg.lenient_answer)
    env = make_text_env(cfg.env, reward_fn=reward_fn, difficulty=cfg.difficulty, gsm8k_path=cfg.gsm8k_path,
                        max_steps=cfg.max_turns, format_penalty=cfg.format_penalty, action_format=cfg.action_format,
                        reason_chars=cfg.action_reason_chars, unroll_env_scans=cfg.unroll_env_scans)
    if cfg.env_latency_ms > 0:  # a slow env (benchmarks): every batched step waits this long
        from thinkcraft.pools.envproc import LatencyEnv

        return LatencyEnv(env, cfg.env_latency_ms)
    return env

def _prompt_corpus(cfg: LLMPolicyConfig, env) -> list[str]:
    """Texts to train a BPE on for random-weight models: instructions, problems and expected answers."""
    texts = [env.system_prompt] * 10
    if hasattr(env, "task"):
        num_problems = 200 if cfg.model == "random:tiny" else 2000  # tiny is for tests: keep BPE training short
        for s in range(num_problems):
            p = env.task.problem(s)
            texts += [p.question, f"{p.question}\n#### {p.answer}"]
    else:
        obs = env.reset(list(range(4)))
        texts += obs * 50
    return texts

def _seed_of(cfg: LLMPolicyConfig, step: int, i: int) -> int:
    """Problem seed of prompt i at learner step `step` >= 1; step 0 is the A*-PO pool (a disjoint range)."""
    base = cfg.seed * 1_000_003 + (10**9 if step == 0 else step * cfg.prompts_per_step)
    return (base + i) % (2**31 - 1)
