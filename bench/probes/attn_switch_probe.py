"""Host time of switching a model's attention function and back (the engine does it once per prefill
chunk and once per `generate` call), on a 36-layer tiny model (the cost grows with the module count):

  module_walk   find the attention modules' configs by walking every module, then switch (the engine
                before compat.attention_configs)
  public        transformers' public `set_attn_implementation` (re-validates on every switch)
  collected     compat.attention_configs once, compat.attention_implementation per call (the engine now)

    python bench/probes/attn_switch_probe.py   # CPU or GPU host; writes bench/results/attn_switch_probe.json
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))  # common.py
from common import card, today, write_records  # noqa: E402


def main() -> None:
    from thinkcraft.llm import compat
    from thinkcraft.llm.attention import register_cascade_attention
    from thinkcraft.llm.testing import tiny_llama

    model, _ = tiny_llama(num_hidden_layers=36)
    name = register_cascade_attention()
    dec = compat.decoder_of(model)
    attn = compat.attention_configs(dec)

    def module_walk() -> None:
        with compat.attention_implementation(compat.attention_configs(dec), name):
            pass

    def public() -> None:
        model.set_attn_implementation(name)
        model.set_attn_implementation("sdpa")

    def collected() -> None:
        with compat.attention_implementation(attn, name):
            pass

    recs = []
    for variant, fn in (("module_walk", module_walk), ("public", public), ("collected", collected)):
        fn()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(100):
                fn()
            ts.append((time.perf_counter() - t) / 100)
        rec = {"variant": variant, "layers": 36, "switch_ms": 1e3 * statistics.median(ts), "card": card(), "date": today()}
        print(f"{variant:12s} {rec['switch_ms']:8.3f} ms", flush=True)
        recs.append(rec)
    write_records(ROOT / "bench" / "results" / "attn_switch_probe.json", recs)


if __name__ == "__main__":
    main()
