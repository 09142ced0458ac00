"""Remote labelling: jobs of `pack_size` items dealt over OpenAI-compatible endpoints within their limits
(providers.py); single-item requests carry the schema as structured outputs where the endpoint accepts it;
each answer is validated, a packed one item by item, and bad ones are re-asked alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from thinkcraft.label.report import Tracker
from thinkcraft.label.store import ResultStore, result_row
from thinkcraft.label.template import Template, pack_prompt, parse_output, parse_packed, response_format

if TYPE_CHECKING:
    from thinkcraft.label.pipeline import WorkItem



@dataclass
class _Job:
    items: list[WorkItem]
    attempt: int = 1
    first: bool = True
    """The items' first answer (not a re-ask of a packed item): counts for the first-pass rate."""


async def label_remote(endpoints_file: Any, items: Sequence[WorkItem], template: Template, store: ResultStore,
                       tracker: Tracker, pack_size: int, max_new_tokens: int, temperature: float,
                       schema_retries: int, seed: int = 0, structured: bool = False) -> list[Any]:
    """Label over every endpoint; returns the Endpoint objects (their stats go into the report).
    `structured`: single-item requests carry the schema as `response_format` (packed ones are parsed)."""
    import httpx

    from thinkcraft.label.providers import (
        Endpoint, EndpointStopped, JobBoard, RequestFailed, serve_jobs,
    )

    fmt = response_format(dict(template.output.schema)) if structured and template.output.is_json else None  # type: ignore[arg-type]

    sampling = {"temperature": temperature, "seed": seed}
    n_conn = sum(e.max_concurrency for e in endpoints_file.endpoints)
    model = endpoints_file.model
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n_conn + 4)) as client:
        eps = [Endpoint(c, client, sampling) for c in endpoints_file.endpoints]
        board = JobBoard(eps)
        for i in range(0, len(items), pack_size):
            board.put(_Job(list(items[i:i + pack_size])))

        async def handle(ep: Endpoint, job: _Job) -> None:
            k = len(job.items)
            if k == 1:
                system, user = template.instructions, job.items[0].text
            else:
                system, user = template.prefix, pack_prompt(template, [it.text for it in job.items])
            try:
                ans = await ep.complete(system, user, max_new_tokens * k, fmt if k == 1 else None)
            except EndpointStopped:
                raise
            except RequestFailed as e:
                kind = "request"
                cause = e.__cause__
                if cause is not None and hasattr(cause, "status"):
                    kind = f"http_{cause.status}"
                elif cause is not None and "Timeout" in type(cause).__name__:
                    kind = "timeout"
                for it in job.items:
                    tracker.fail(it, kind, str(e))
                return
            ep.stats.items += k
            # a packed request's usage is shared evenly by its items
            p_tok, c_tok, cached = ans.prompt_tokens // k, ans.completion_tokens // k, ans.cached_tokens // k
            results = [parse_output(ans.text, template.output)] if k == 1 else parse_packed(ans.text, k, template.output)
            for it, parsed in zip(job.items, results):
                if parsed.error is None:
                    text = ans.text if k == 1 else (parsed.value if isinstance(parsed.value, str) else json.dumps(parsed.value))
                    store.add(result_row(it, parsed.value, text, model, ep.cfg.name, p_tok, c_tok, cached,
                                         ans.latency_s, k, job.attempt))
                    tracker.ok(p_tok, c_tok, cached, attempt=job.attempt if job.first else job.attempt + 1,
                               key=it.key)
                elif k > 1:
                    # malformed or missing in a packed answer: ask this item alone
                    tracker.reasked += 1
                    board.put(_Job([it], job.attempt, first=False))
                elif job.attempt <= schema_retries:
                    tracker.reasked += 1
                    board.put(_Job([it], job.attempt + 1, first=False))
                else:
                    tracker.fail(it, "schema", parsed.error, answer=ans.text, attempts=job.attempt)

        await serve_jobs(eps, board, handle)
        remaining = [it for q in board.queues.values() for job in q for it in job.items]
        for it in remaining:
            tracker.errors["not_sent"] += 1
            tracker.failures.append({"key": it.key, "row": it.row, "kind": "not_sent",
                                     "error": "every endpoint stopped", "attempts": 0, "answer": None})
        return eps
