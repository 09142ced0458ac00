"""What do an llm-policy rollout's prompts cost on the host per decision? `ChatPrompts.next` (the sync and
async rollouts' prompt builder) for N episodes x T turns: each later turn's piece built around the observation
(THINKCRAFT_FAST_PROMPTS=0: the whole conversation rendered by the chat template again each turn), then only the
new piece tokenized. Bundled SmolLM2 template, Craftax-sized observations
(80 lines, ~1,500 characters), 32-token replies ending in the template's end-of-turn token.

    PYTHONPATH=src python bench/probes/chat_render_probe.py            # 256 episodes x 8 turns
    THINKCRAFT_FAST_PROMPTS=0 PYTHONPATH=src python bench/probes/chat_render_probe.py   # rendering whole

Writes bench/results/chat_render_probe.json {episodes, turns, per_turn_s, ms_per_decision, prompt_tokens_last,
fast_prompts, fast_pieces}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from common import card, today, write_records  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--turns", type=int, default=8)
    a = ap.parse_args()
    from thinkcraft.llm.testing import bundled_tokenizer
    from thinkcraft.train.llm_policy.rollout import ChatPrompts

    tok = bundled_tokenizer()
    rng = random.Random(0)
    words = "tree stone water grass sand coal iron cow zombie table furnace wood sapling plant lava diamond".split()

    def obs() -> str:
        return "\n".join(f"{rng.choice(words)} at ({rng.randint(-4, 4)},{rng.randint(-4, 4)})" for _ in range(80))

    n = a.episodes
    prompts = ChatPrompts(tok, "You play Craftax. Answer with one action.", n, -1)
    comps: list = [None] * n
    per_turn, ids = [], []
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for _ in range(a.turns):
        observations = [obs() for _ in range(n)]
        t0 = time.perf_counter()
        ids = prompts.next(list(range(n)), observations, comps)
        per_turn.append(time.perf_counter() - t0)
        reply = [rng.randrange(100, 4000) for _ in range(31)] + [end]
        comps = [SimpleNamespace(token_ids=reply, text=tok.decode(reply, skip_special_tokens=True),
                                 finish_reason="stop") for _ in range(n)]
    row = {"episodes": n, "turns": a.turns, "per_turn_s": [round(x, 4) for x in per_turn],
           "ms_per_decision": 1000 * sum(per_turn) / (n * a.turns), "prompt_tokens_last": len(ids[0]),
           # later turns built around the observation without rendering the conversation (THINKCRAFT_FAST_PROMPTS)
           "fast_prompts": prompts.fast, "fast_pieces": prompts.fast_pieces,
           "card": card(), "date": today()}
    print(f"{n} episodes x {a.turns} turns: {row['ms_per_decision']:.3f} ms per decision; per turn "
          f"{row['per_turn_s']} s; {row['prompt_tokens_last']} prompt tokens at the end")
    print("wrote", write_records(ROOT / "bench" / "results" / "chat_render_probe.json", [row],
                                 merge_keys=("episodes", "turns", "fast_prompts", "card")))


if __name__ == "__main__":
    main()
