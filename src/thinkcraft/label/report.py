"""The label run's counts, its cumulative report (`report.json`) and failure records (`failures.jsonl`).

`report.json` describes the output folder, not only the last run: `labelled` is every item of the input
that has a stored label, `unlabelled` the rest; `invalid` / `failed` count the unlabelled items whose
last attempt failed (by kind in `errors`), as listed in `failures.jsonl`; tokens and seconds are summed
over the runs, and `runs` keeps one summary per run that had work. So a no-op re-run (everything
already labelled) rewrites the same numbers, never zeros. `failures.jsonl` keeps, per still-unlabelled
item, its last failure: the kind, the error and the raw answer.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from thinkcraft.utils.io import atomic_write_json, atomic_write_text
from thinkcraft.utils.progress import RunProgress, console

_ANSWER_CHARS = 2000
"""Raw answers kept per failure record (enough to see what the model did)."""
_RUN_FIELDS = ("to_label", "labelled", "invalid", "failed", "reasked", "first_asked", "first_pass_valid",
               "first_pass_valid_frac",
               "elapsed_s", "items_per_s", "tokens_per_s", "prompt_tokens", "completion_tokens", "cached_tokens",
               "interrupted", "threads")
_SUMMED = ("prompt_tokens", "completion_tokens", "cached_tokens", "reasked", "elapsed_s")


@dataclass
class Tracker:
    """Counts shown on the progress bar and written to the report."""

    total: int
    progress: RunProgress | None = None
    labelled: int = 0
    first_pass_valid: int = 0
    """Items never asked before (not retries of an earlier run's failures) labelled by their first answer."""
    retried: set[str] = field(default_factory=set)
    """Keys of this run's items that an earlier run failed to label (their first pass was then)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasked: int = 0
    errors: Counter = field(default_factory=Counter)
    invalid: int = 0
    failed: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    def ok(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, attempt: int = 1,
           key: str | None = None) -> None:
        self.labelled += 1
        self.first_pass_valid += attempt == 1 and key not in self.retried
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.cached_tokens += cached_tokens
        self.tick()

    def fail(self, item: Any, kind: str, message: str, answer: str | None = None, attempts: int = 1) -> None:
        self.errors[kind] += 1
        if kind == "schema":
            self.invalid += 1
        else:
            self.failed += 1
        rec = {"key": item.key, "row": item.row, "kind": kind, "error": message[:500], "attempts": attempts,
               "answer": answer[:_ANSWER_CHARS] if answer is not None else None}
        self.failures.append(rec)
        self.tick()

    def tick(self) -> None:
        if self.progress is None:
            return
        dt_s = max(self.elapsed_s(), 1e-9)
        finished = self.labelled + self.invalid + self.failed
        rate = self.labelled / dt_s
        eta_s = (self.total - finished) / rate if rate > 0 else float("nan")
        self.progress.update(finished, items_per_s=rate, tok_per_s=self.completion_tokens / dt_s,
                             errors=sum(self.errors.values()), eta_s=eta_s)

    def run_report(self, endpoints: Sequence[Any]) -> dict[str, Any]:
        """This run's counts (what `label()` returns, merged into report.json)."""
        d = max(self.elapsed_s(), 1e-9)
        return {
            "labelled": self.labelled, "invalid": self.invalid, "failed": self.failed,
            "remaining": self.total - self.labelled, "reasked": self.reasked,
            "first_pass_valid": self.first_pass_valid, "first_asked": self.total - len(self.retried),
            "first_pass_valid_frac": (self.first_pass_valid / (self.total - len(self.retried))
                                      if self.total > len(self.retried) else None),
            "errors": dict(self.errors), "elapsed_s": round(d, 3),
            "items_per_s": self.labelled / d, "tokens_per_s": self.completion_tokens / d,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "endpoints": {e.cfg.name: asdict(e.stats) for e in endpoints},
            "failures_sample": self.failures[:20],
        }


def read_failures(out_dir: Path) -> list[dict[str, Any]]:
    p = out_dir / "failures.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a hand-edited or foreign line: not ours to keep
    return out


def merge_failures(old: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]], labelled: set[str],
                   current: set[str]) -> list[dict[str, Any]]:
    """Last failure per key of this input still unlabelled: this run's records replace older ones."""
    by_key: dict[str, dict[str, Any]] = {}
    for rec in [*old, *new]:
        by_key[rec["key"]] = rec
    return [r for k, r in by_key.items() if k in current and k not in labelled]


def save_report(out_dir: Path, run: dict[str, Any], tracker: Tracker, labelled_keys: set[str],
                current_keys: set[str]) -> dict[str, Any]:
    """Merge this run into report.json and failures.jsonl (see the module docstring); returns the saved report."""
    path = out_dir / "report.json"
    try:
        prev = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except json.JSONDecodeError:
        prev = {}
    fails = merge_failures(read_failures(out_dir), tracker.failures, labelled_keys, current_keys)
    kinds = Counter(f["kind"] for f in fails)
    runs = list(prev.get("runs", [])) if prev.get("template_digest") == run.get("template_digest") else []
    if run["to_label"] or run.get("interrupted"):
        runs.append({"date": dt.datetime.now().isoformat(timespec="seconds"), **{k: run.get(k) for k in _RUN_FIELDS}})
    sums = {k: round(sum(r.get(k) or 0 for r in runs), 3) for k in _SUMMED}
    labelled_in_runs = sum(r.get("labelled") or 0 for r in runs)
    done = len(labelled_keys & current_keys)
    saved = {
        **{k: v for k, v in run.items() if k not in _RUN_FIELDS and k not in ("remaining", "errors", "failures_sample")},
        "labelled": done, "unlabelled": len(current_keys) - done,
        "invalid": kinds.get("schema", 0), "failed": sum(kinds.values()) - kinds.get("schema", 0),
        "errors": dict(kinds), **sums,
        "items_per_s": labelled_in_runs / sums["elapsed_s"] if sums["elapsed_s"] else 0.0,
        "tokens_per_s": sums["completion_tokens"] / sums["elapsed_s"] if sums["elapsed_s"] else 0.0,
        "first_pass_valid_frac": _first_pass(runs), "last_run": runs[-1] if runs else None, "runs": runs,
        "failures_sample": fails[:20],
    }
    atomic_write_json(path, saved)
    atomic_write_text(out_dir / "failures.jsonl", "".join(json.dumps(f) + "\n" for f in fails))
    return saved


def _first_pass(runs: Sequence[dict[str, Any]]) -> float | None:
    """Of the items asked for the first time (over all runs), the fraction labelled by their first answer."""
    tried = sum(r.get("first_asked") or 0 for r in runs)
    return sum(r.get("first_pass_valid") or 0 for r in runs) / tried if tried else None


def print_report(report: dict[str, Any], saved: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"label report — {report['out_dir']}", show_header=False)
    fp = report.get("first_pass_valid_frac")
    rows = [
        ("model", report["model"]), ("prompt format", report.get("prompt_format", "-")),
        ("constrained decoding", report.get("constrained", "-")), ("items in input", report["items_in_input"]),
        ("duplicates in input", report["duplicates_in_input"]), ("already done (skipped)", report["already_done"]),
        ("labelled now", report["labelled"]),
        ("first-pass valid", f"{report['first_pass_valid']}/{report['first_asked']}" + (f" ({fp:.1%})" if fp is not None else "")),
        ("invalid (schema)", report["invalid"]), ("failed (requests)", report["failed"]),
        ("not labelled (this run)", report["remaining"]), ("re-asked", report["reasked"]),
        ("items/s", f"{report['items_per_s']:.2f}"), ("tokens/s (generated)", f"{report['tokens_per_s']:.1f}"),
        ("elapsed", f"{report['elapsed_s']:.1f} s"),
        ("labelled in total (all runs)", f"{saved['labelled']}/{saved['labelled'] + saved['unlabelled']}"),
    ]
    if report.get("threads"):
        rows.append(("torch CPU threads", report["threads"]))
    if report["cached_tokens"]:
        rows.append(("cached prompt tokens", report["cached_tokens"]))
    for k, v in sorted(report["errors"].items()):
        rows.append((f"errors: {k}", v))
    for name, st in report["endpoints"].items():
        parts = [f"{st['ok']}/{st['requests']} ok", f"{st['items']} items"]
        for k in ("http_429", "http_5xx", "http_4xx", "timeouts", "connect_errors", "retries", "failed_requests"):
            if st[k]:
                parts.append(f"{k} {st[k]}")
        if st.get("structured") is False:
            parts.append("no structured outputs (parse and re-ask)")
        if st["stopped"]:
            parts.append(f"[red]STOPPED: {st['stopped']}[/red]")
        rows.append((f"endpoint {name}", ", ".join(parts)))
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)
    if report["remaining"]:
        console.print(f"{report['remaining']} item(s) of this run stay unlabelled (exit code 1): see "
                      f"{report['out_dir']}/failures.jsonl; re-running the same command retries them.")
    untried = saved["unlabelled"] - report["remaining"]
    if untried > 0:
        console.print(f"{untried} item(s) of the input were not attempted (--limit): re-run to label them.")
