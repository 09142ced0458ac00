"""GSM8K from a local file (JSONL or Parquet, fields `question` and `answer` where the answer ends with
`#### <number>`, as in openai/grade-school-math). Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

from thinkcraft.envs.textenvs.base import Problem
from thinkcraft.envs.textenvs.rewards import extract_hash_answer, normalize_number
from thinkcraft.utils.errors import UserError

INSTRUCTIONS = (
    "Solve the math problem. Think step by step. "
    "Write the final answer on the last line in the form '#### <number>'."
)


def _rows(path: Path) -> list[dict]:
    if path.suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}: row {i}: not valid JSON ({e.msg})") from None
    return rows


def load_gsm8k(path: str | Path) -> list[Problem]:
    """Problems of a GSM8K-layout file; a row with a missing/empty field or no `#### <number>` answer is an
    error naming the row (1-based)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"GSM8K file not found: {path} (give a local .jsonl or .parquet; nothing is downloaded)")
    problems = []
    for i, row in enumerate(_rows(path), start=1):
        if not isinstance(row, dict):
            raise UserError(f"{path}: row {i}: expected an object with 'question' and 'answer'")
        missing = [k for k in ("question", "answer") if not isinstance(row.get(k), str) or not row.get(k).strip()]
        if missing:
            raise UserError(f"{path}: row {i}: missing field(s) {', '.join(missing)} (GSM8K layout: question, answer)")
        gold = extract_hash_answer(row["answer"])
        norm = normalize_number(gold) if gold is not None else None
        if norm is None:
            raise UserError(f"{path}: row {i}: answer has no final '#### <number>' line")
        problems.append(Problem(question=row["question"].strip(), answer=norm, solution=row["answer"], meta={"row": i}))
    if not problems:
        raise UserError(f"{path}: no rows")
    return problems


class GSM8KTask:
    name = "gsm8k"
    instructions = INSTRUCTIONS

    def __init__(self, path: str | Path) -> None:
        self.problems = load_gsm8k(path)

    def __len__(self) -> int:
        return len(self.problems)

    def problem(self, seed: int) -> Problem:
        return self.problems[seed % len(self.problems)]
