"""How a template's instructions and an item reach a local model: through its chat template, or raw.

Instruct models answer when prompted as chat models: the instructions go in the system turn, the item
in the user turn, then the template's generation prompt (`<|im_start|>assistant\\n`). Sent as raw text
they continue the item instead of answering (issue 22: 0 of 116 states labelled).

The shared prefix is still computed once: it is the chat-templated text up to where the item starts
(system turn + the user turn's opening), as token ids; each item's suffix is the item, the end of the
user turn and the generation prompt. Every item is tokenized from its *full* chat-templated text and
its first tokens are checked equal to the shared prefix ids, so the model sees exactly the tokens of
the full template; an item whose tokens merge across that boundary is sent whole, without the
shared prefix (never a different tokenization). Chat templates carry their own special tokens, so
their text is tokenized with `add_special_tokens=False` (what `apply_chat_template(tokenize=True)` does).

Raw completion (`--prompt-format raw`) sends instructions + item as plain text (the prefix tokenized
apart, as before), e.g. for base models or hand-written few-shot prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from thinkcraft.llm.protocol import Batch
from thinkcraft.utils.errors import UserError

PromptFormat = Literal["auto", "chat", "raw"]

_SENTINEL = "\u2063ITEM\u2063"
"""Stand-in for the item while the template is split (invisible separators: no real item contains it)."""


def has_chat_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class PromptBatch:
    batch: Batch
    positions: list[int]
    """Index, in the texts given to `batches`, of each of the batch's items."""


class RawPrompts:
    """Instructions + item as plain text; the engine tokenizes the instructions apart (shared prefix)."""

    kind = "raw"

    def __init__(self, instructions: str) -> None:
        self.instructions = instructions

    def batches(self, texts: Sequence[str]) -> list[PromptBatch]:
        return [PromptBatch(Batch(items=list(texts), prefix=self.instructions or None), list(range(len(texts))))]

    def prompt_ids(self, engine: Any, texts: Sequence[str]) -> list[list[int]]:
        """Full prompt ids as the engine would build them (for training on the same tokens)."""
        pre, items = engine.tokenize_batch(Batch(items=list(texts), prefix=self.instructions or None))
        return [pre + it for it in items]


class ChatPrompts:
    """System turn = instructions, user turn = item, then the generation prompt (see module docstring).
    Templates that refuse a system turn get the instructions at the start of the user turn."""

    kind = "chat"

    def __init__(self, tokenizer: Any, instructions: str) -> None:
        if not has_chat_template(tokenizer):
            raise UserError("--prompt-format chat: this model's tokenizer has no chat template; use --prompt-format raw")
        self.tokenizer = tokenizer
        self.instructions = instructions
        self.system_turn = bool(instructions)
        try:
            text = self.render(_SENTINEL)
        except Exception:  # noqa: BLE001 - jinja raises TemplateError ("System role not supported") and others
            self.system_turn = False
            text = self.render(_SENTINEL)
        if text.count(_SENTINEL) != 1:
            raise UserError("the model's chat template does not place the user message verbatim; use --prompt-format raw")
        self.prefix_text = text[: text.index(_SENTINEL)]
        self.prefix_ids = self._ids(self.prefix_text)
        self.boundary_mismatches = 0
        """Items sent whole because their tokens merged across the prefix boundary."""

    def messages(self, item: str) -> list[dict[str, str]]:
        if self.system_turn:
            return [{"role": "system", "content": self.instructions}, {"role": "user", "content": item}]
        return [{"role": "user", "content": self.instructions + item}]

    def render(self, item: str) -> str:
        return self.tokenizer.apply_chat_template(self.messages(item), tokenize=False, add_generation_prompt=True)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def full_ids(self, item: str) -> list[int]:
        """Token ids of the item's whole chat-templated prompt."""
        return self._ids(self.render(item))

    def prompt_ids(self, engine: Any, texts: Sequence[str]) -> list[list[int]]:
        return [self.full_ids(t) for t in texts]

    def batches(self, texts: Sequence[str]) -> list[PromptBatch]:
        """One batch of suffixes behind the shared prefix ids, plus one of whole prompts for the rare items
        whose tokens do not split at the prefix boundary."""
        p = len(self.prefix_ids)
        shared: list[list[int]] = []
        shared_pos: list[int] = []
        whole: list[list[int]] = []
        whole_pos: list[int] = []
        for i, text in enumerate(texts):
            ids = self.full_ids(text)
            if ids[:p] == self.prefix_ids and len(ids) > p:
                shared.append(ids[p:])
                shared_pos.append(i)
            else:
                whole.append(ids)
                whole_pos.append(i)
        self.boundary_mismatches += len(whole)
        out = []
        if shared:
            out.append(PromptBatch(Batch(items=shared, prefix=list(self.prefix_ids)), shared_pos))
        if whole:
            out.append(PromptBatch(Batch(items=whole), whole_pos))
        return out


def make_prompts(fmt: PromptFormat, tokenizer: Any, instructions: str) -> RawPrompts | ChatPrompts:
    """`auto` = chat when the tokenizer has a chat template, else raw."""
    if resolved_format(fmt, tokenizer) == "raw":
        return RawPrompts(instructions)
    if tokenizer is None:
        raise UserError("--prompt-format chat needs the model's tokenizer (this engine gives none); use raw")
    return ChatPrompts(tokenizer, instructions)


def resolved_format(fmt: PromptFormat, tokenizer: Any) -> Literal["chat", "raw"]:
    if fmt not in ("auto", "chat", "raw"):
        raise UserError(f"--prompt-format must be auto, chat or raw, not {fmt!r}")
    return "raw" if fmt == "raw" or (fmt == "auto" and not has_chat_template(tokenizer)) else "chat"
