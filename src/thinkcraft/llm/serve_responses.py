"""OpenAI response bodies and server-sent-event streams of `thinkcraft serve`, built from engine
`Completion`s (pure: a tokenizer's `decode` is the only outside call).

Streaming (`stream: true`) sends OpenAI's chunk objects (`text_completion` / `chat.completion.chunk`) as
`data: {...}` events, one per generated token (its text delta and, when asked, its logprobs), then one
with the `finish_reason` per choice, a usage chunk when `stream_options.include_usage`, and
`data: [DONE]`. The engine decodes a batch to its end before it returns, so the chunks follow each
other once generation is done: what a streaming client receives is exactly what it expects, only the
time to its first token is not shorter than the whole answer's.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from thinkcraft.llm.protocol import Completion

TopK = list[list[tuple[str, float]]]
"""Per generated token, the k most likely (token text, logprob) alternatives, most likely first."""


def finish_reason(c: Completion) -> str:
    return "length" if c.finish_reason == "length" else "stop"


def usage(cs: Sequence[Completion], n: int) -> dict[str, int]:
    prompt = sum(len(c.prompt_token_ids) for c in cs[::n]) if cs else 0
    comp = sum(len(c.token_ids) for c in cs)
    return {"prompt_tokens": prompt, "completion_tokens": comp, "total_tokens": prompt + comp}


def text_pieces(decode: Any, ids: Sequence[int], text: str) -> list[str]:
    """Per token, the text it adds: the pieces concatenate to `text` (the completion's final text, cut
    at a stop string). Incremental detokenization over a sliding window (as TGI and vLLM do), so a
    multi-byte character split across tokens comes out whole with its last token; a piece that would
    not continue `text` (a stop string being cut) is held back and the rest goes with the last token."""
    pieces, sent, prefix_at, read_at = [], 0, 0, 0
    for i in range(len(ids)):
        before = decode(ids[prefix_at:read_at])
        now = decode(ids[prefix_at : i + 1])
        piece = ""
        if len(now) > len(before) and not now.endswith("\ufffd"):
            piece = now[len(before):]
            prefix_at, read_at = read_at, i + 1
        if piece and text.startswith(piece, sent):
            pieces.append(piece)
            sent += len(piece)
        else:
            pieces.append("")
    if pieces:
        pieces[-1] += text[sent:]
    return pieces


@dataclass
class Shaped:
    """One completion as the API shows it: its choice index, token texts, text pieces and top-k."""

    index: int
    completion: Completion
    tokens: list[str]
    pieces: list[str]
    top: TopK | None

    def __post_init__(self) -> None:
        self.offsets = [0] * len(self.pieces)
        """Character offset of each token's piece in the completion's text."""
        at = 0
        for i, p in enumerate(self.pieces):
            self.offsets[i] = at
            at += len(p)


def _top_dict(alts: list[tuple[str, float]]) -> dict[str, float]:
    return {s: lp for s, lp in alts}


def _chat_entry(s: str, lp: float, alts: list[tuple[str, float]] | None) -> dict[str, Any]:
    return {"token": s, "logprob": lp, "bytes": list(s.encode()),
            "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in (alts or [])]}


def completion_logprobs(sh: Shaped, a: int = 0, b: int | None = None) -> dict[str, Any]:
    """Legacy completions `logprobs` of tokens [a, b): tokens, token_logprobs, top_logprobs, text_offset."""
    b = len(sh.tokens) if b is None else b
    lps = sh.completion.logprobs or []
    return {
        "tokens": sh.tokens[a:b], "token_logprobs": lps[a:b],
        "top_logprobs": [_top_dict(t) for t in sh.top[a:b]] if sh.top is not None else None,
        "text_offset": sh.offsets[a:b],
    }


def chat_logprobs(sh: Shaped, a: int = 0, b: int | None = None) -> dict[str, Any]:
    b = len(sh.tokens) if b is None else b
    lps = sh.completion.logprobs or []
    return {"content": [_chat_entry(sh.tokens[i], lps[i], sh.top[i] if sh.top is not None else None)
                        for i in range(a, b)]}


class OpenAIShapes:
    """Bodies for one request: `completion`/`chat` responses, or their chunk streams."""

    def __init__(self, model_name: str, chat: bool, want_logprobs: bool, token_ids: bool) -> None:
        self.model = model_name
        self.chat = chat
        self.want_logprobs = want_logprobs
        self.token_ids = token_ids
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _logprobs(self, sh: Shaped, a: int = 0, b: int | None = None) -> dict[str, Any] | None:
        if not self.want_logprobs or sh.completion.logprobs is None:
            return None
        return chat_logprobs(sh, a, b) if self.chat else completion_logprobs(sh, a, b)

    def _ids(self, ch: dict[str, Any], c: Completion) -> dict[str, Any]:
        """thinkcraft's extension: the sampled and prompt token ids (token-in/token-out training)."""
        if self.token_ids:
            ch["token_ids"] = c.token_ids
            ch["prompt_token_ids"] = c.prompt_token_ids
        return ch

    def response(self, shaped: list[Shaped], n: int) -> dict[str, Any]:
        choices = []
        for sh in shaped:
            c = sh.completion
            ch: dict[str, Any] = {"index": sh.index, "finish_reason": finish_reason(c), "logprobs": self._logprobs(sh)}
            if self.chat:
                ch["message"] = {"role": "assistant", "content": c.text}
            else:
                ch["text"] = c.text
            choices.append(self._ids(ch, c))
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, choices, usage=usage([s.completion for s in shaped], n))

    def chunks(self, shaped: list[Shaped], n: int, include_usage: bool) -> Iterator[dict[str, Any]]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        for sh in shaped:
            c = sh.completion
            if self.chat:  # the role comes first, in a chunk of its own (as OpenAI sends it)
                first = {"index": sh.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield self._envelope(obj, [first])
            for i, piece in enumerate(sh.pieces):
                ch: dict[str, Any] = {"index": sh.index, "logprobs": self._logprobs(sh, i, i + 1), "finish_reason": None}
                if self.chat:
                    ch["delta"] = {"content": piece}
                else:
                    ch["text"] = piece
                if self.token_ids:
                    ch["token_ids"] = [c.token_ids[i]]
                yield self._envelope(obj, [ch])
            last: dict[str, Any] = {"index": sh.index, "logprobs": None, "finish_reason": finish_reason(c)}
            if self.chat:
                last["delta"] = {}
            else:
                last["text"] = ""
            if self.token_ids:
                last["prompt_token_ids"] = c.prompt_token_ids
            yield self._envelope(obj, [last])
        if include_usage:
            yield self._envelope(obj, [], usage=usage([s.completion for s in shaped], n))


def sse(events: Iterator[dict[str, Any]]) -> Iterator[str]:
    """Server-sent events: `data: <json>` per event, then `data: [DONE]`."""
    for e in events:
        yield f"data: {json.dumps(e)}\n\n"
    yield "data: [DONE]\n\n"
