"""`thinkcraft label`: label items with a local engine or remote OpenAI-compatible endpoints, resumably.

Phases: (1) read the input (Parquet file/folder or JSONL) and render each item through the template;
(2) key every item by hash(prompt, model, template) and skip keys already stored in `out_dir`;
(3) label the rest — local: large batches through one engine with the shared prefix passed apart so
it is prefilled once; remote: jobs of `pack_size` items over every endpoint within its limits;
(4) validate each answer (a packed answer item by item; bad ones are re-asked alone); store it at once
(journal + atomic Parquet shards, see store.py); (5) print and save the report (`report.json`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa

from thinkcraft.label.store import ResultStore, read_results
from thinkcraft.label.template import (
    OutputSpec, Template, item_key, load_template, pack_prompt, parse_output, parse_packed, schema_from_fields,
)
from thinkcraft.utils.errors import ConfigError, UserError, check
from thinkcraft.utils.io import atomic_write_json, atomic_write_text
from thinkcraft.utils.progress import RunProgress, console
from thinkcraft.utils.signals import sigterm_as_interrupt


@dataclass
class LabelConfig:
    input: str
    """Items to label: a Parquet file, a folder of Parquet files (e.g. `thinkcraft collect` output), or JSONL."""
    out_dir: str = "runs/label"
    """Where results go (Parquet shards, journal, report.json). Re-running with the same one resumes."""
    template: str | None = None
    """TOML/JSON file with `prefix`, `item` and optionally `fields` or `schema` (overrides the three flags below)."""
    prefix: str = "You label states of the game Craftax.\n"
    """Shared prefix: instructions identical for every item (prefilled once / provider-cached)."""
    item: str | None = None
    """Per-item part, a format string over input columns (default: `{prompt}`, `{text}` or `{compact_text}`, whichever exists)."""
    fields: str | None = None
    """JSON output fields, e.g. `action:string,subgoal:string,confidence:number` (default: free text)."""
    schema: str | None = None
    """Path to a JSON-Schema (object) the JSON output must satisfy; alternative to --fields."""
    engine: str = "auto:default"
    """Local engine spec: `auto:<model>` (vLLM offline when installed and a GPU is present, else hf),
    `hf:<model>`, `vllm:<path>`; <model> is `default` (bundled) or a local folder. Unused with --endpoints."""
    endpoints: str | None = None
    """TOML/JSON file of OpenAI-compatible endpoints (RPM/TPM/concurrency, weights): label remotely. Each
    endpoint's key comes from `api_key_env = "VAR"` (an environment variable) or `api_key_file = "path"`
    (first line of a file), so it never shows on the command line; `api_key` inline also works."""
    batch_size: int = 64
    """Items per local engine call."""
    pack_size: int = 1
    """Items per remote request (numbered list in, JSON list out); 1 = no packing."""
    max_new_tokens: int = 128
    """Answer length cap per item (a packed request may use pack_size times this)."""
    temperature: float = 0.0
    """0 = greedy."""
    schema_retries: int = 1
    """How many times an answer that fails validation is asked again alone."""
    limit: int | None = None
    """Label at most this many of the not-yet-labelled items (for trial runs)."""
    shard_items: int = 500
    """Results per Parquet shard (the journal makes every finished item durable in between)."""
    seed: int = 0

    def __post_init__(self) -> None:
        check(self.batch_size >= 1, "batch_size", "must be >= 1")
        check(self.pack_size >= 1, "pack_size", "must be >= 1")
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(self.temperature >= 0, "temperature", "must be >= 0")
        check(self.schema_retries >= 0, "schema_retries", "must be >= 0")
        check(self.shard_items >= 1, "shard_items", "must be >= 1")
        check(self.limit is None or self.limit >= 0, "limit", "must be >= 0")
        check(not (self.fields and self.schema), "schema", "give --fields or --schema, not both")
        check(Path(self.input).exists(), "input", f"{self.input} does not exist")
        check(self.endpoints is None or Path(self.endpoints).exists(), "endpoints", f"{self.endpoints} does not exist")
        check(self.pack_size == 1 or self.endpoints is not None, "pack_size",
              "packing is for remote endpoints (--endpoints); local engines batch instead (--batch-size)")


# --- inputs ---------------------------------------------------------------------------------------


def read_input(path: str | Path) -> pa.Table:
    """A Parquet file, a folder of Parquet files (recursively, skipping temp files), or JSONL."""
    import pyarrow.parquet as pq

    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.parquet") if not f.name.startswith(".tmp-"))
        if not files:
            raise UserError(f"--input: no .parquet files under {p}")
        table = pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
    elif p.suffix == ".parquet":
        table = pq.read_table(p)
    elif p.suffix in (".jsonl", ".json", ".ndjson"):
        rows = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UserError(f"--input: {p} line {n} is not JSON: {e}") from None
        table = pa.Table.from_pylist(rows) if rows else pa.table({})
    else:
        raise UserError(f"--input: {p} must be .parquet, .jsonl or a folder of Parquet files")
    if table.num_rows == 0:
        raise UserError(f"--input: {p} has no rows: nothing to label")
    return table


def build_template(cfg: LabelConfig, columns: Sequence[str]) -> Template:
    if cfg.template:
        return load_template(cfg.template)
    schema = None
    if cfg.fields:
        schema = schema_from_fields(cfg.fields)
    elif cfg.schema:
        try:
            schema = json.loads(Path(cfg.schema).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError("schema", f"cannot read {cfg.schema}: {e}") from None
    item = cfg.item
    if item is None:
        col = next((c for c in ("prompt", "text", "compact_text") if c in columns), None)
        if col is None:
            raise ConfigError("item", f"the input has no prompt/text/compact_text column ({list(columns)}); "
                              "say which to use, e.g. --item '{my_column}'")
        item = "{" + col + "}"
    return Template(prefix=cfg.prefix, item=item, output=OutputSpec(schema))


@dataclass(frozen=True)
class WorkItem:
    key: str
    row: int
    """Index of the item's (first) row in the input."""
    text: str
    """The rendered per-item part (sent after the shared prefix)."""


def prepare_items(table: pa.Table, template: Template, model: str) -> tuple[list[WorkItem], int]:
    """Rendered, keyed, de-duplicated items (first occurrence wins) and the number of duplicates."""
    cols = [c for c in dict.fromkeys(template.columns)]
    missing = [c for c in cols if c not in table.column_names]
    if missing:
        raise UserError(f"template uses columns {missing} that the input lacks (it has {table.column_names})")
    digest = template.digest()
    instr = template.instructions
    out: list[WorkItem] = []
    seen: set[str] = set()
    for i, row in enumerate(table.select(cols).to_pylist()):
        text = template.render_item(row)
        key = item_key(instr + text, model, digest)
        if key not in seen:
            seen.add(key)
            out.append(WorkItem(key, i, text))
    return out, table.num_rows - len(out)


# --- progress and report --------------------------------------------------------------------------


@dataclass
class Tracker:
    """Counts shown on the progress bar and written to the report."""

    total: int
    progress: RunProgress | None = None
    labelled: int = 0
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

    def ok(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> None:
        self.labelled += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.cached_tokens += cached_tokens
        self.tick()

    def fail(self, item: WorkItem, kind: str, message: str) -> None:
        self.errors[kind] += 1
        if kind == "schema":
            self.invalid += 1
        else:
            self.failed += 1
        self.failures.append({"key": item.key, "row": item.row, "kind": kind, "error": message[:500]})
        self.tick()

    def tick(self) -> None:
        if self.progress is None:
            return
        dt = max(self.elapsed_s(), 1e-9)
        finished = self.labelled + self.invalid + self.failed
        rate = self.labelled / dt
        eta_s = (self.total - finished) / rate if rate > 0 else float("nan")
        self.progress.update(finished, items_per_s=rate, tok_per_s=self.completion_tokens / dt,
                             errors=sum(self.errors.values()), eta_s=eta_s)


def _store_row(item: WorkItem, value: Any, text: str, model: str, endpoint: str, prompt_tokens: int,
               completion_tokens: int, cached_tokens: int, latency_s: float, pack_size: int, attempts: int
               ) -> dict[str, Any]:
    return {
        "key": item.key, "row": item.row, "output": text,
        "parsed_json": json.dumps(value) if not isinstance(value, str) else None,
        "model": model, "endpoint": endpoint, "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens, "cached_tokens": cached_tokens, "latency_s": latency_s,
        "pack_size": pack_size, "attempts": attempts,
    }


# --- local engine ---------------------------------------------------------------------------------


def label_with_engine(engine: Any, items: Sequence[WorkItem], template: Template, model: str, store: ResultStore,
                      tracker: Tracker, batch_size: int, max_new_tokens: int, temperature: float,
                      schema_retries: int, seed: int = 0, endpoint_name: str = "local") -> None:
    """Large batches through one in-process engine; the shared prefix goes apart (`Batch.prefix`)."""
    from thinkcraft.llm.protocol import Batch, SamplingParams

    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, logprobs=False, seed=seed)
    queue: deque[tuple[WorkItem, int]] = deque((it, 1) for it in items)
    prefix = template.instructions
    while queue:
        chunk = [queue.popleft() for _ in range(min(batch_size, len(queue)))]
        t0 = time.monotonic()
        comps = engine.generate(Batch(items=[it.text for it, _ in chunk], prefix=prefix), sampling)
        latency_s = time.monotonic() - t0
        if len(comps) != len(chunk):
            raise RuntimeError(f"engine returned {len(comps)} completions for {len(chunk)} items")
        for (it, attempt), c in zip(chunk, comps):
            p_tok = len(c.prompt_token_ids)
            c_tok = len(c.token_ids)
            parsed = parse_output(c.text, template.output)
            if parsed.error is None:
                store.add(_store_row(it, parsed.value, c.text, model, endpoint_name, p_tok, c_tok, 0,
                                     latency_s, 1, attempt))
                tracker.ok(p_tok, c_tok)
            elif attempt <= schema_retries:
                tracker.reasked += 1
                queue.append((it, attempt + 1))
            else:
                tracker.fail(it, "schema", parsed.error)


# --- remote endpoints -----------------------------------------------------------------------------


@dataclass
class _Job:
    items: list[WorkItem]
    attempt: int = 1


async def label_remote(endpoints_file: Any, items: Sequence[WorkItem], template: Template, store: ResultStore,
                       tracker: Tracker, pack_size: int, max_new_tokens: int, temperature: float,
                       schema_retries: int, seed: int = 0) -> list[Any]:
    """Label over every endpoint; returns the Endpoint objects (their stats go into the report)."""
    import httpx

    from thinkcraft.label.providers import Endpoint, EndpointStopped, JobBoard, RequestFailed, serve_jobs

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
                ans = await ep.complete(system, user, max_new_tokens * k)
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
                    store.add(_store_row(it, parsed.value, text, model, ep.cfg.name, p_tok, c_tok, cached,
                                         ans.latency_s, k, job.attempt))
                    tracker.ok(p_tok, c_tok, cached)
                elif k > 1:
                    # malformed or missing in a packed answer: ask this item alone
                    tracker.reasked += 1
                    board.put(_Job([it], job.attempt))
                elif job.attempt <= schema_retries:
                    tracker.reasked += 1
                    board.put(_Job([it], job.attempt + 1))
                else:
                    tracker.fail(it, "schema", parsed.error)

        await serve_jobs(eps, board, handle)
        remaining = [it for q in board.queues.values() for job in q for it in job.items]
        for it in remaining:
            tracker.errors["not_sent"] += 1
            tracker.failures.append({"key": it.key, "row": it.row, "kind": "not_sent",
                                     "error": "every endpoint stopped"})
        return eps


# --- command --------------------------------------------------------------------------------------


def resolve_engine_spec(spec: str) -> str:
    """`auto:<model>` -> `vllm:<folder>` when vLLM is installed and CUDA is present, else `hf:<model>`
    (`llm.registry.resolve_auto`); other specs as they are."""
    from thinkcraft.llm.registry import parse_spec, resolve_auto

    es = parse_spec(spec)
    return str(resolve_auto(es)) if es.scheme == "auto" else spec


def make_local_engine(spec: str) -> Any:
    from thinkcraft.llm import make_engine

    return make_engine(resolve_engine_spec(spec))


def label(cfg: LabelConfig, engine: Any | None = None, model_name: str | None = None) -> dict[str, Any]:
    """Run the pipeline; returns the report (also saved as `<out_dir>/report.json`).

    `engine` (an object with the Engine protocol's `generate`) overrides `cfg.engine`, for callers that
    already hold a model (distill); `model_name` then names it in the item keys."""
    from thinkcraft.label.providers import all_stopped_error, load_endpoints

    out_dir = Path(cfg.out_dir)
    ep_file = load_endpoints(cfg.endpoints) if cfg.endpoints else None  # config errors before any work
    table = read_input(cfg.input)
    template = build_template(cfg, table.column_names)
    # keys name the model, not the backend: hf and vllm runs of one model share their labels
    model = ep_file.model if ep_file else (model_name or _model_of(cfg.engine))
    items, n_dup = prepare_items(table, template, model)

    report: dict[str, Any] = {
        "input": str(cfg.input), "out_dir": str(out_dir), "model": model,
        "engine": f"endpoints:{cfg.endpoints}" if ep_file else (model_name or resolve_engine_spec(cfg.engine)),
        "template_digest": template.digest(), "items_in_input": table.num_rows,
        "duplicates_in_input": n_dup, "unique_items": len(items),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "label_config.json", {**asdict(cfg), "model": model,
                                                      "template": asdict(template)})
    eps: list[Any] = []
    with ResultStore(out_dir, shard_items=cfg.shard_items) as store:
        done = store.done_keys()
        todo = [it for it in items if it.key not in done]
        report["already_done"] = len(items) - len(todo)
        report["recovered_from_journal"] = store.num_recovered
        if cfg.limit is not None:
            todo = todo[: cfg.limit]
        report["to_label"] = len(todo)
        tracker = Tracker(total=len(todo))
        interrupted = False
        try:
            if todo:
                with RunProgress(len(todo), "label", log_every_s=5.0, unit="items") as prog:
                    tracker.progress = prog
                    if ep_file is not None:
                        eps = asyncio.run(label_remote(ep_file, todo, template, store, tracker, cfg.pack_size,
                                                       cfg.max_new_tokens, cfg.temperature, cfg.schema_retries,
                                                       cfg.seed))
                    else:
                        own = engine is None
                        eng = make_local_engine(cfg.engine) if own else engine
                        try:
                            label_with_engine(eng, todo, template, model, store, tracker, cfg.batch_size,
                                              cfg.max_new_tokens, cfg.temperature, cfg.schema_retries, cfg.seed)
                        finally:
                            if own:
                                eng.close()
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            report.update(_tracker_report(tracker, eps))
            report["interrupted"] = interrupted
            report["shards_written"] = store.num_shards_written + (1 if store._buffer else 0)
            _save_report(out_dir, report, tracker)
    if not interrupted:
        print_report(report)
    if eps and not any(e.alive for e in eps) and report["remaining"] > 0:
        raise all_stopped_error(eps, report["remaining"])
    return report


def _model_of(spec: str) -> str:
    """`hf:default` / `auto:default` / `vllm:/m/x` -> the model part (greedy answers depend on it alone)."""
    from thinkcraft.llm.registry import parse_spec

    return parse_spec(spec).model


def _tracker_report(tr: Tracker, eps: Sequence[Any]) -> dict[str, Any]:
    dt = max(tr.elapsed_s(), 1e-9)
    return {
        "labelled": tr.labelled, "invalid": tr.invalid, "failed": tr.failed,
        "remaining": tr.total - tr.labelled, "reasked": tr.reasked,
        "errors": dict(tr.errors), "elapsed_s": round(dt, 3),
        "items_per_s": tr.labelled / dt, "tokens_per_s": tr.completion_tokens / dt,
        "prompt_tokens": tr.prompt_tokens, "completion_tokens": tr.completion_tokens,
        "cached_tokens": tr.cached_tokens,
        "endpoints": {e.cfg.name: asdict(e.stats) for e in eps},
        "failures_sample": tr.failures[:20],
    }


def _save_report(out_dir: Path, report: dict[str, Any], tr: Tracker) -> None:
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_text(out_dir / "failures.jsonl", "".join(json.dumps(f) + "\n" for f in tr.failures))


def print_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"label report — {report['out_dir']}", show_header=False)
    rows = [
        ("model", report["model"]), ("items in input", report["items_in_input"]),
        ("duplicates in input", report["duplicates_in_input"]), ("already done (skipped)", report["already_done"]),
        ("labelled now", report["labelled"]), ("invalid (schema)", report["invalid"]),
        ("failed (requests)", report["failed"]), ("not labelled", report["remaining"]),
        ("re-asked", report["reasked"]), ("items/s", f"{report['items_per_s']:.2f}"),
        ("tokens/s (generated)", f"{report['tokens_per_s']:.1f}"), ("elapsed", f"{report['elapsed_s']:.1f} s"),
    ]
    if report["cached_tokens"]:
        rows.append(("cached prompt tokens", report["cached_tokens"]))
    for k, v in sorted(report["errors"].items()):
        rows.append((f"errors: {k}", v))
    for name, st in report["endpoints"].items():
        parts = [f"{st['ok']}/{st['requests']} ok", f"{st['items']} items"]
        for k in ("http_429", "http_5xx", "http_4xx", "timeouts", "connect_errors", "retries", "failed_requests"):
            if st[k]:
                parts.append(f"{k} {st[k]}")
        if st["stopped"]:
            parts.append(f"[red]STOPPED: {st['stopped']}[/red]")
        rows.append((f"endpoint {name}", ", ".join(parts)))
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)


@sigterm_as_interrupt("every finished item is in the journal; run the same command again to continue")
def run(cfg: LabelConfig) -> int:
    """CLI entry: 0 when every item is labelled, 1 when some are not (see report.json / failures.jsonl)."""
    report = label(cfg)
    return 0 if report["remaining"] == 0 else 1


def read_labels(out_dir: str | Path) -> pa.Table:
    """Every stored label of a run (`key`, `row`, `output`, `parsed_json`, usage columns)."""
    return read_results(out_dir)
