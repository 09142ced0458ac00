"""An llm-policy episode's next prompt without rendering its whole conversation again (`ChatPrompts` fast pieces):
for templates that write each message on their own the ids equal those of whole renders, turn after turn; a
template that trims content is refused up front; one whose rendering depends on more than the message (here: it
numbers the user turns) is caught by the per-call check, warned about, and rendered whole from then on - the ids
always equal the whole render's."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from thinkcraft.llm.testing import bundled_tokenizer
from thinkcraft.train.llm_policy.rollout import ChatPrompts

SYSTEM = "You play a game. Answer with one action."

NUMBERED = (
    "{% set ns = namespace(u=0) %}{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.u = ns.u + 1 %}"
    "<|im_start|>user turn {{ ns.u }}\n{{ m['content'] }}<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
DROPS_THOUGHTS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRIMMING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tok(template: str | None = None):  # noqa: ANN202
    tok = bundled_tokenizer()
    if template is not None:
        tok = copy.deepcopy(tok)
        tok.chat_template = template
    return tok


def _play(tok, fast: str, monkeypatch, turns: int = 5, n: int = 4,  # noqa: ANN001
          thought: bool = False) -> tuple[list[list[list[int]]], ChatPrompts]:
    """n episodes x turns: every turn's prompt ids; replies end in the template's end-of-turn token (as a model's
    do) except one episode's, cut at the token limit; `thought`: each reply opens with a thought."""
    monkeypatch.setenv("THINKCRAFT_FAST_PROMPTS", fast)
    prompts = ChatPrompts(tok, SYSTEM, n, -1)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    comps: list = [None] * n
    out = []
    for t in range(turns):
        obs = [f"  turn {t} of episode {e}:\ntree at ({t},{e}) \n" for e in range(n)]
        out.append(prompts.next(list(range(n)), obs, comps))
        comps = []
        for e in range(n):
            text = f"<think>left or right {t}</think> move_left {t}{e}" if thought else f" move_left {t}{e}"
            reply = tok(text, add_special_tokens=False)["input_ids"]
            cut = e == 1 and t % 2 == 0
            ids = reply if cut else reply + [end]
            comps.append(SimpleNamespace(token_ids=ids, text=tok.decode(reply), finish_reason="length" if cut else "stop"))
    return out, prompts


@pytest.mark.parametrize("template", [None, "chatml"])
def test_pieces_equal_whole_renders(template: str | None, monkeypatch) -> None:
    """The bundled template and ChatML: the same ids as rendering every conversation whole, with all but the
    first turn and one checked episode a call built without rendering (and without a fallback)."""
    from thinkcraft.train.llm_policy import CHATML_TEMPLATE

    tok = _tok(CHATML_TEMPLATE if template == "chatml" else None)
    whole, ref = _play(tok, "0", monkeypatch)
    fast, prompts = _play(tok, "1", monkeypatch)
    assert fast == whole
    assert ref.fast_pieces == 0 and prompts.fast_pieces == 4 * 3  # 4 later turns x (4 episodes - 1 checked)
    assert not prompts.rendered_whole_after_check
    assert not any(c.fallback for c in prompts.chats)


def test_a_trimming_template_is_refused_up_front(monkeypatch) -> None:
    tok = _tok(TRIMMING)
    whole, _ = _play(tok, "0", monkeypatch)
    fast, prompts = _play(tok, "1", monkeypatch)
    assert fast == whole and prompts._wrapper() is None and prompts.fast_pieces == 0


def test_a_template_that_numbers_turns_is_refused_up_front(monkeypatch) -> None:
    """The markers rendered after one exchange and after two differ: no pieces, whole renders."""
    tok = _tok(NUMBERED)
    whole, _ = _play(tok, "0", monkeypatch)
    fast, prompts = _play(tok, "1", monkeypatch)
    assert fast == whole and prompts._wrapper() is None and prompts.fast_pieces == 0


def test_a_template_that_rewrites_replies_is_caught_by_the_check(monkeypatch, caplog) -> None:
    """A template that keeps only what follows a reply's thought (as Qwen3's drops earlier thoughts) writes the
    markers verbatim, so only a whole render shows it: the first call's check does, warns, and every prompt is
    rendered whole (and counted as a template fallback, as before)."""
    tok = _tok(DROPS_THOUGHTS)
    whole, _ = _play(tok, "0", monkeypatch, thought=True)
    with caplog.at_level("WARNING"):
        fast, prompts = _play(tok, "1", monkeypatch, thought=True)
    assert fast == whole
    assert prompts._wrapper() is not None and prompts.rendered_whole_after_check and prompts.fast_pieces == 0
    assert "rendered whole from now on" in caplog.text


def test_the_switch_is_validated(monkeypatch) -> None:
    monkeypatch.setenv("THINKCRAFT_FAST_PROMPTS", "fast")
    with pytest.raises(Exception, match="THINKCRAFT_FAST_PROMPTS must be 0 or 1"):
        ChatPrompts(_tok(), SYSTEM, 1, -1)
