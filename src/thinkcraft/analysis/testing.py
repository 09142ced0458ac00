"""Tiny synthetic run directories in the real layout (config.json + metrics.jsonl, analysis.runs), for the
tests of `thinkcraft compare` and the dry mode of bench/ppo_parity.py. The curves are made up: a saturating
rise to `final_return` plus per-seed offsets and noise; nothing here trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from thinkcraft.utils.io import atomic_write_json


def fake_curve(steps: np.ndarray, total_steps: int, final_return: float, rng: np.random.Generator,
               spread: float) -> np.ndarray:
    offset = rng.normal(0.0, spread)
    return (final_return + offset) * (1.0 - np.exp(-4.0 * steps / total_steps)) + rng.normal(0.0, spread / 4, len(steps))


def write_fake_run(run_dir: str | Path, config: dict[str, Any], *, num_seeds: int = 1, total_steps: int = 1_000_000,
                   log_every: int = 50_000, final_return: float = 10.0, spread: float = 1.0, seed: int = 0,
                   achievements: Sequence[str] = ("collect_wood", "place_table"),
                   seed_index_field: bool | None = None, noise_seed: int | None = None) -> Path:
    """A run directory with `num_seeds` seeds (records tagged `seed_index` when num_seeds > 1, or when
    `seed_index_field` says so; curves drawn with `noise_seed`, default `seed`), logging `episode/return`, `episode/length`, `achievements/*` and `achievements/mean_rate`."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tagged = num_seeds > 1 if seed_index_field is None else seed_index_field
    atomic_write_json(run_dir / "config.json", {**config, "seed": seed, **({"num_seeds": num_seeds} if tagged else {})})
    rng = np.random.default_rng(seed if noise_seed is None else noise_seed)
    steps = np.arange(log_every, total_steps + 1, log_every)
    lines = []
    for i in range(num_seeds):
        ret = fake_curve(steps, total_steps, final_return, rng, spread)
        rates = np.clip(ret[:, None] / (final_return * 2) + rng.normal(0, 0.02, (len(steps), len(achievements))), 0, 1)
        for k, s in enumerate(steps):
            rec: dict[str, Any] = {"step": int(s), "time_s": float(k), "episode/return": float(ret[k]),
                                   "episode/length": float(100 + 20 * ret[k])}
            rec.update({f"achievements/{a}": float(r) for a, r in zip(achievements, rates[k])})
            rec["achievements/mean_rate"] = float(rates[k].mean())
            if tagged:
                rec["seed_index"] = i
            lines.append(json.dumps(rec))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir
