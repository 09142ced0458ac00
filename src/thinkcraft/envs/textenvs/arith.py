"""Procedurally generated arithmetic word problems with a verifiable integer answer (offline).

Difficulty 1: one addition/subtraction of small numbers; 2: two operations incl. multiplication;
3: three operations with larger numbers and exact division; 4+: 2 + level operations, numbers up to 10^level.
The same (seed, difficulty) always gives the same problem.
"""

from __future__ import annotations

import random

from thinkcraft.envs.textenvs.base import Problem
from thinkcraft.utils.errors import ConfigError

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jada", "Kofi", "Lena")
_ITEMS = ("apples", "marbles", "coins", "books", "stickers", "pencils", "shells", "cards", "stones", "cookies")

INSTRUCTIONS = (
    "Solve the math problem. Think step by step, briefly. "
    "Write the final answer on the last line in the form '#### <number>'.\n"
    "Example: 'Mia has 3 pens. She gets 2 more. How many pens does Mia have now?' -> '3 + 2 = 5\n#### 5'"
)


class ArithTask:
    name = "arith"
    instructions = INSTRUCTIONS

    def __init__(self, difficulty: int = 1) -> None:
        if not 1 <= difficulty <= 6:
            raise ConfigError("difficulty", f"must be in 1..6, got {difficulty}")
        self.difficulty = difficulty

    def problem(self, seed: int) -> Problem:
        rng = random.Random(f"arith-{self.difficulty}-{seed}")
        d = self.difficulty
        num_ops = {1: 1, 2: 2, 3: 3}.get(d, d - 1)
        hi = {1: 20, 2: 50, 3: 100}.get(d, 10 ** (d - 1))
        who, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        value = rng.randint(2, hi)
        sentences = [f"{who} has {value} {item}."]
        ops = ["add", "sub"] if d == 1 else ["add", "sub", "mul"] + (["div"] if d >= 3 else [])
        for _ in range(num_ops):
            op = rng.choice(ops)
            if op == "sub" and value <= 1:
                op = "add"
            if op == "add":
                k = rng.randint(1, hi)
                value += k
                sentences.append(rng.choice([f"{who} gets {k} more.", f"A friend gives {who} {k} more {item}."]))
            elif op == "sub":
                k = rng.randint(1, value - 1)
                value -= k
                sentences.append(rng.choice([f"{who} gives away {k}.", f"{who} loses {k} {item}."]))
            elif op == "mul":
                k = rng.randint(2, 5 if d <= 3 else 9)
                value *= k
                sentences.append(f"Then the number of {item} becomes {k} times as many.")
            else:  # exact division: pick a divisor of the current value
                divisors = [k for k in range(2, 10) if value % k == 0]
                if not divisors:
                    k = rng.randint(1, hi)
                    value += k
                    sentences.append(f"{who} gets {k} more.")
                    continue
                k = rng.choice(divisors)
                value //= k
                sentences.append(f"{who} shares them equally among {k} boxes and keeps one box.")
        sentences.append(f"How many {item} does {who} have now?")
        return Problem(question=" ".join(sentences), answer=str(value), meta={"difficulty": d, "seed": seed})
