"""Structured outputs (`SamplingParams.structured`, `llm/constrained.py`) under continuous batching.

One `GuideState` per schema spans all S slots; a row is under its constraint only while a request of that
schema holds the slot (`open` at admission, `close` when it ends), so constrained and free requests share
the decode batch. Each iteration: the live rows' masks are applied to a copy of the logits (the model's own
logits stay for "model" log-probs), the tokens are sampled from the copy, and the matchers accept them
before the next mask (asynchronously on CUDA, as in the label pipeline's batch loop). A request whose prompt
ends inside a `<think>` thought waits unconstrained until its thought closes (the row state's `in_think` and
`force_pos`, handed over with the tokens), then its grammar constrains the answer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from thinkcraft.llm.constrained import CompiledGuide, GuideState, StructuredOutput, compile_guide


def compile_for(eng: Any, spec: StructuredOutput) -> CompiledGuide:
    """The schema compiled for this engine's tokenizer, logits width and EOS ids (cached by constrained.py);
    raises the one-line UserError of a bad schema or a missing xgrammar - at submit, before any decoding."""
    from thinkcraft.llm import compat

    vocab = int(compat.lm_head(eng._lm).weight.shape[0])
    return compile_guide(eng.tokenizer, vocab, eng.eos_ids, spec)


class SlotGuides:
    def __init__(self, eng: Any, slots: int, device: torch.device) -> None:
        self.eng, self.slots, self.device = eng, slots, device
        self.states: dict[StructuredOutput, GuideState] = {}
        self.row_spec: list[StructuredOutput | None] = [None] * slots
        self.constrained_lp = np.zeros(slots, dtype=bool)
        """Rows whose reported log-probs are of the masked distribution (`logprobs="constrained"`)."""

    def open(self, slot: int, spec: StructuredOutput, after_thought: bool = False) -> None:
        st = self.states.get(spec)
        if st is None:
            st = compile_for(self.eng, spec).start(self.slots, self.device, spec.logprobs)
            for s in range(self.slots):
                st.close_row(s)
            self.states[spec] = st
        st.open_row(slot, after_thought)
        self.row_spec[slot] = spec
        self.constrained_lp[slot] = spec.logprobs == "constrained"

    def close(self, slot: int) -> None:
        spec = self.row_spec[slot]
        if spec is not None:
            self.states[spec].close_row(slot)
            self.row_spec[slot] = None
            self.constrained_lp[slot] = False

    def any_open(self, rows: np.ndarray) -> bool:
        return any(self.row_spec[s] is not None for s in np.flatnonzero(rows))

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` with every live row's disallowed tokens at -inf (`logits` itself when no row is
        under a grammar now: only rows still thinking)."""
        states = [st for st in self.states.values() if st.constraining()]
        if not states:
            return logits
        out = logits.clone()
        for st in states:
            st.apply(out)
        return out

    def advance(self, tokens: torch.Tensor, thought_closed: torch.Tensor) -> None:
        """This step's tokens, and per row whether its thought is closed after them (`GuideState.advance`)."""
        for st in self.states.values():
            if st.watching:
                st.advance(tokens, thought_closed)
