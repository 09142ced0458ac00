"""Held-out agreement between a student's answers and a teacher's labels, the majority-label baseline,
the stable held-out split and the training target text (pure functions, used by `distill`)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any, Sequence

from thinkcraft.label.template import OutputSpec, parse_output



def in_heldout(key: str, frac: float) -> bool:
    """Stable split by key hash: the same item is held out in every run."""
    return int(hashlib.sha256(("heldout:" + key).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < frac


def target_text(output: str, parsed_json: str | None, spec: OutputSpec) -> str:
    """What the student learns to write: canonical compact JSON for JSON specs, else the stripped text."""
    if spec.is_json and parsed_json is not None:
        # the layout constrained decoding writes (llm/constrained.JSON_SEPARATORS, characters unescaped)
        return json.dumps(json.loads(parsed_json), separators=(", ", ": "), ensure_ascii=False)
    return output.strip()


def majority_answer(teacher_values: Sequence[Any], spec: OutputSpec) -> str:
    """The baseline that ignores the input: the teacher's most common answer (JSON: most common value of
    each field), as answer text."""
    if not spec.is_json:
        return Counter(str(v) for v in teacher_values).most_common(1)[0][0] if teacher_values else ""
    fields = list((spec.schema or {}).get("properties", {}))
    obj = {}
    for f in fields:
        vals = [json.dumps(v[f], sort_keys=True) for v in teacher_values if isinstance(v, dict) and f in v]
        if vals:
            obj[f] = json.loads(Counter(vals).most_common(1)[0][0])
    return json.dumps(obj)


def _tokens(s: str) -> list[str]:
    return s.lower().split()


def token_f1(a: str, b: str) -> float:
    ta, tb = _tokens(a), _tokens(b)
    if not ta and not tb:
        return 1.0
    common = sum(min(ta.count(w), tb.count(w)) for w in set(ta))
    if common == 0:
        return 0.0
    p, r = common / len(ta), common / len(tb)
    return 2 * p * r / (p + r)


def agreement(student: Sequence[str], teacher: Sequence[Any], spec: OutputSpec) -> dict[str, float]:
    """Student answers (raw text) vs the teacher's parsed answers.

    JSON: valid rate, exact match (all fields), and per-field match rate; free text: normalised exact match
    and mean token F1."""
    n = len(student)
    if n == 0:
        return {"n": 0}
    if not spec.is_json:
        norm = [" ".join(_tokens(s)) for s in student]
        exact = sum(a == " ".join(_tokens(t)) for a, t in zip(norm, teacher)) / n
        f1 = sum(token_f1(s, t) for s, t in zip(student, teacher)) / n
        return {"n": n, "exact_match": exact, "token_f1": f1}
    fields = list((spec.schema or {}).get("properties", {}))
    valid = exact = 0
    per_field = {f: 0 for f in fields}
    for s, t in zip(student, teacher):
        p = parse_output(s, spec)
        if p.error is not None:
            continue
        valid += 1
        exact += all(p.value.get(f) == t.get(f) for f in fields)
        for f in fields:
            per_field[f] += p.value.get(f) == t.get(f)
    out = {"n": n, "valid": valid / n, "exact_match": exact / n}
    out.update({f"field/{f}": v / n for f, v in per_field.items()})
    return out
