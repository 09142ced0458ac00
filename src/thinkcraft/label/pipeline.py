"""`thinkcraft label`: label items with a local engine or remote OpenAI-compatible endpoints, resumably.

Phases: (1) read the input (Parquet file/folder or JSONL) and render each item through the template;
(2) key every item by hash(prompt, model, template, prompt format) and skip keys already stored in
`out_dir`; (3) label the rest — local: large batches through one engine, prompted through the model's
chat template (prompts.py) with the shared prefix passed apart so it is prefilled once, and decoding
constrained to the JSON schema (llm/constrained.py) so every answer parses; remote: jobs of `pack_size`
items over every endpoint within its limits, the schema sent as `response_format` where the endpoint
accepts it; (4) validate each answer (a packed answer item by item; bad ones are re-asked alone, a
truncated one with twice the token budget); store it at once (journal + atomic Parquet shards, see
store.py); (5) print and save the cumulative report (`report.json`, `failures.jsonl`; report.py).

Exit code of `thinkcraft label`: 0 when every item the run attempted has a label, 1 when some stay
unlabelled (failures.jsonl lists them with the raw answer; re-running retries them), 2 on a usage error.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa

from thinkcraft.label.engines import (
    http_endpoints, is_http_spec, load_tokenizer, make_local_engine, model_of, resolve_engine_spec,
)
from thinkcraft.label.prompts import PromptFormat, make_prompts, resolved_format
from thinkcraft.label.remote import label_remote
from thinkcraft.label.report import Tracker, print_report, read_failures, save_report
from thinkcraft.label.store import ResultStore, read_results, result_row
from thinkcraft.label.template import (
    OutputSpec, Template, check_schema, item_key, load_template, parse_output, schema_from_fields,
)
from thinkcraft.label.threads import ThreadPolicy
from thinkcraft.utils.errors import ConfigError, UserError, check
from thinkcraft.utils.io import atomic_write_json
from thinkcraft.utils.progress import RunProgress
from thinkcraft.utils.signals import sigterm_as_interrupt


@dataclass
class LabelConfig:
    input: str
    """Items to label: a Parquet file, a folder of Parquet files (e.g. `thinkcraft collect` output), or JSONL."""
    out_dir: str = "runs/label"
    """Where results go (Parquet shards, journal, report.json, failures.jsonl). Re-running with the same one
    resumes and retries what failed. Exit code: 0 = every item this run attempted is labelled, 1 = some
    stay unlabelled (listed in failures.jsonl with the raw answer), 2 = usage error."""
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
    """Engine spec: `auto:<model>` (vLLM offline when installed and a GPU is present, else hf),
    `hf:<model>`, `vllm:<path>`; <model> is `default` (bundled) or a local folder. An HTTP server,
    `openai+http://host:port/v1` or `sglang+http://host:port`, is asked through chat completions (as one
    endpoint; --endpoints for limits and several). Unused with --endpoints."""
    prompt_format: PromptFormat = "auto"
    """Local engines: `chat` = instructions as the system turn and the item as the user turn of the model's
    chat template (shared prefix still prefilled once); `raw` = instructions + item as plain text (base
    models, hand-written few-shot prompts); `auto` = chat when the tokenizer has a chat template."""
    constrain: bool = True
    """With --fields/--schema: decode local answers under the schema (xgrammar), so each one parses by
    construction and ends at the closing brace; remote endpoints get the schema as `response_format`
    (OpenAI structured outputs; vLLM/SGLang guided decoding) and fall back to parse-and-re-ask where
    refused. --no-constrain: parse and re-ask only."""
    threads: int = 0
    """CPU threads for torch (local CPU engines); 0 = auto: usable cores (os.sched_getaffinity) minus the
    cores other processes keep busy, re-read before every batch, at least 1. torch's default (one per
    core) ran ~9x slower beside a single busy process on a 2-core machine."""
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
    """How many times an answer that fails validation is asked again alone (local engines: with twice the
    token budget when it was cut at --max-new-tokens)."""
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
        check(self.threads >= 0, "threads", "must be >= 0 (0 = auto)")
        check(self.prompt_format in ("auto", "chat", "raw"), "prompt_format", "must be auto, chat or raw")
        check(Path(self.input).exists(), "input", f"{self.input} does not exist")
        check(self.endpoints is None or Path(self.endpoints).exists(), "endpoints", f"{self.endpoints} does not exist")
        check(self.pack_size == 1 or self.endpoints is not None or is_http_spec(self.engine), "pack_size",
              "packing is for remote endpoints (--endpoints); local engines batch instead (--batch-size)")
        # template, item format and schema errors are one line here, before any model loads
        template = build_template(self, columns=None)
        if template.output.is_json and self.constrain and self.endpoints is None and not is_http_spec(self.engine):
            from thinkcraft.llm.constrained import check_schema as check_grammar

            check_grammar(dict(template.output.schema))  # type: ignore[arg-type]


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


def build_template(cfg: LabelConfig, columns: Sequence[str] | None) -> Template:
    """The run's template; `columns=None` (config validation, before the input is read) checks all but
    the default item column."""
    if cfg.template:
        return load_template(cfg.template)
    schema = None
    if cfg.fields:
        schema = schema_from_fields(cfg.fields)
    elif cfg.schema:
        try:
            schema = json.loads(Path(cfg.schema).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError("schema", f"cannot read {cfg.schema}: {e}") from None
        check_schema(schema, f"--schema {cfg.schema}")
    item = cfg.item
    if item is None and columns is None:
        item = "{text}"  # placeholder: the real default needs the input's columns
    elif item is None:
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


def prepare_items(table: pa.Table, template: Template, model: str, prompt_format: str = "raw"
                  ) -> tuple[list[WorkItem], int]:
    """Rendered, keyed, de-duplicated items (first occurrence wins) and the number of duplicates.
    A chat-formatted prompt is another prompt: its keys differ from raw ones (raw keys are unchanged)."""
    cols = [c for c in dict.fromkeys(template.columns)]
    missing = [c for c in cols if c not in table.column_names]
    if missing:
        raise UserError(f"template uses columns {missing} that the input lacks (it has {table.column_names})")
    digest = template.digest() + ("" if prompt_format == "raw" else f"+{prompt_format}")
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


# --- local engine ---------------------------------------------------------------------------------


def generate_completions(engine: Any, prompts: Any, texts: Sequence[str], sampling: Any) -> list[Any]:
    """One completion per text, in order: the texts go through `prompts` (chat or raw, prompts.py) into
    one or two engine batches."""
    comps: list[Any] = [None] * len(texts)
    for pb in prompts.batches(texts):
        out = engine.generate(pb.batch, sampling)
        if len(out) != len(pb.positions):
            raise RuntimeError(f"engine returned {len(out)} completions for {len(pb.positions)} items")
        for pos, c in zip(pb.positions, out):
            comps[pos] = c
    return comps


def label_with_engine(engine: Any, items: Sequence[WorkItem], template: Template, model: str, store: ResultStore,
                      tracker: Tracker, batch_size: int, max_new_tokens: int, temperature: float,
                      schema_retries: int, seed: int = 0, endpoint_name: str = "local", prompts: Any = None,
                      structured: Any = None, threads: ThreadPolicy | None = None) -> None:
    """Large batches through one in-process engine; the shared prefix goes apart (`Batch.prefix`).

    `prompts` (prompts.py; default raw) turns item texts into engine batches; `structured` (a
    `StructuredOutput`) constrains decoding. A failed answer is re-asked (up to `schema_retries` times),
    with twice the token budget when it was cut by the length limit."""
    from thinkcraft.label.prompts import RawPrompts
    from thinkcraft.llm.protocol import SamplingParams

    prompts = prompts or RawPrompts(template.instructions)
    queue: deque[tuple[WorkItem, int, int]] = deque((it, 1, max_new_tokens) for it in items)
    while queue:
        budget = queue[0][2]  # a batch shares one token budget: take the queue's head run of it
        chunk = []
        while queue and len(chunk) < batch_size and queue[0][2] == budget:
            chunk.append(queue.popleft())
        if threads is not None:
            threads.apply()
        sampling = SamplingParams(max_new_tokens=budget, temperature=temperature, logprobs=False, seed=seed,
                                  structured=structured)
        t0 = time.monotonic()
        comps = generate_completions(engine, prompts, [it.text for it, _, _ in chunk], sampling)
        latency_s = time.monotonic() - t0
        for (it, attempt, _), c in zip(chunk, comps):
            p_tok = len(c.prompt_token_ids)
            c_tok = len(c.token_ids)
            parsed = parse_output(c.text, template.output)
            if parsed.error is None:
                store.add(result_row(it, parsed.value, c.text, model, endpoint_name, p_tok, c_tok, 0,
                                     latency_s, 1, attempt))
                tracker.ok(p_tok, c_tok, attempt=attempt, key=it.key)
            elif attempt <= schema_retries:
                tracker.reasked += 1
                cut = c.finish_reason == "length"
                queue.append((it, attempt + 1, budget * 2 if cut else budget))
            else:
                why = parsed.error + (f" (cut at {budget} new tokens)" if c.finish_reason == "length" else "")
                tracker.fail(it, "schema", why, answer=c.text, attempts=attempt)


# --- command --------------------------------------------------------------------------------------


@dataclass
class RunPlan:
    """What a run will do, decided before any model loads (config and input errors surface here)."""

    endpoints: Any
    """An EndpointsFile (remote run) or None (local engine)."""
    template: Template
    model: str
    """The model name item keys carry (not the backend: hf and vllm runs of one model share labels)."""
    prompt_format: str
    key_format: str
    structured: bool
    tokenizer: Any
    threads: ThreadPolicy | None
    items: list[WorkItem]
    report: dict[str, Any]
    """The report's head: what the run is about."""


def plan_run(cfg: LabelConfig, engine: Any | None, model_name: str | None, tokenizer: Any | None) -> RunPlan:
    from thinkcraft.label.providers import load_endpoints

    ep_file = None
    if cfg.endpoints:
        ep_file = load_endpoints(cfg.endpoints)
    elif engine is None and is_http_spec(cfg.engine):
        ep_file = http_endpoints(cfg.engine)
    table = read_input(cfg.input)
    template = build_template(cfg, table.column_names)
    model = ep_file.model if ep_file else (model_name or model_of(cfg.engine))
    threads = None
    if ep_file is None:
        threads = ThreadPolicy(cfg.threads)
        threads.apply()
        if engine is None and cfg.prompt_format != "raw":
            tokenizer = load_tokenizer(cfg.engine)
        fmt = resolved_format(cfg.prompt_format, tokenizer)
    else:
        fmt = "chat" if all(e.api == "chat" for e in ep_file.endpoints) else "completions"
    structured = cfg.constrain and template.output.is_json
    key_format = fmt if ep_file is None else "raw"  # remote keys predate prompt formats: kept as they were
    items, n_dup = prepare_items(table, template, model, key_format)
    head = {
        "input": str(cfg.input), "out_dir": str(cfg.out_dir), "model": model,
        "engine": (f"endpoints:{cfg.endpoints}" if cfg.endpoints else cfg.engine) if ep_file
        else (model_name or resolve_engine_spec(cfg.engine)),
        "prompt_format": fmt, "constrained": structured,
        "template_digest": template.digest(), "items_in_input": table.num_rows,
        "duplicates_in_input": n_dup, "unique_items": len(items),
    }
    return RunPlan(ep_file, template, model, fmt, key_format, structured, tokenizer, threads, items, head)


def label(cfg: LabelConfig, engine: Any | None = None, model_name: str | None = None,
          tokenizer: Any | None = None) -> dict[str, Any]:
    """Run the pipeline; returns this run's report (merged into the cumulative `<out_dir>/report.json`).

    `engine` (an object with the Engine protocol's `generate`) overrides `cfg.engine`, for callers that
    already hold a model (distill); `model_name` then names it in the item keys, and `tokenizer` (the
    engine's) enables the chat prompt format (without it such an engine is prompted raw)."""
    from thinkcraft.label.providers import all_stopped_error

    out_dir = Path(cfg.out_dir)
    plan = plan_run(cfg, engine, model_name, tokenizer)
    template, items, threads = plan.template, plan.items, plan.threads
    report: dict[str, Any] = dict(plan.report)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "label_config.json", {
        **asdict(cfg), "model": plan.model, "prompt_format_used": plan.prompt_format, "key_format": plan.key_format,
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
        earlier_failures = {f["key"] for f in read_failures(out_dir)}
        tracker = Tracker(total=len(todo), retried={it.key for it in todo if it.key in earlier_failures})
        interrupted = False
        try:
            if todo:
                with RunProgress(len(todo), "label", log_every_s=5.0, unit="items") as prog:
                    tracker.progress = prog
                    if plan.endpoints is not None:
                        eps = asyncio.run(label_remote(plan.endpoints, todo, template, store, tracker, cfg.pack_size,
                                                       cfg.max_new_tokens, cfg.temperature, cfg.schema_retries,
                                                       cfg.seed, structured=plan.structured))
                    else:
                        from thinkcraft.llm.constrained import StructuredOutput  # torch: local runs only

                        own = engine is None
                        eng = make_local_engine(cfg.engine) if own else engine
                        prompts = make_prompts(plan.prompt_format, plan.tokenizer, template.instructions)
                        spec = StructuredOutput.from_schema(template.output.schema) if plan.structured else None
                        try:
                            label_with_engine(eng, todo, template, plan.model, store, tracker, cfg.batch_size,
                                              cfg.max_new_tokens, cfg.temperature, cfg.schema_retries, cfg.seed,
                                              prompts=prompts, structured=spec, threads=threads)
                        finally:
                            if own:
                                eng.close()
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            report.update(tracker.run_report(eps))
            report["interrupted"] = interrupted
            report["threads"] = threads.summary() if threads is not None else None
            report["shards_written"] = store.num_shards_written + (1 if store._buffer else 0)
            saved = save_report(out_dir, report, tracker, store.done_keys(), {it.key for it in items})
    if not interrupted:
        print_report(report, saved)
    if eps and not any(e.alive for e in eps) and report["remaining"] > 0:
        raise all_stopped_error(eps, report["remaining"])
    report["labelled_total"], report["unlabelled"] = saved["labelled"], saved["unlabelled"]
    return report


@sigterm_as_interrupt("every finished item is in the journal; run the same command again to continue")
def run(cfg: LabelConfig) -> int:
    """CLI entry. Exit code: 0 when every item this run attempted got a label; 1 when some stay
    unlabelled (report.json counts them, failures.jsonl lists them with the raw answer; re-run to retry)."""
    report = label(cfg)
    return 0 if report["remaining"] == 0 else 1


def read_labels(out_dir: str | Path) -> pa.Table:
    """Every stored label of a run (`key`, `row`, `output`, `parsed_json`, usage columns)."""
    return read_results(out_dir)
