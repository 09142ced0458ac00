"""Crash-safe result store: a write-ahead journal plus atomic Parquet shards, keyed by item key.

Every finished item is appended to `journal.jsonl` (flushed per line) the moment its answer is
validated, so a crash or a kill loses only requests still in flight. Every `shard_items` items (and on
close) the journal is compacted into one Parquet shard, written through `atomic_path` (readers never see
a partial shard), and then truncated. On open, a leftover journal is recovered into a shard, skipping
keys a shard already holds (a crash between the shard rename and the truncation) — so a key is stored
exactly once. One process at a time per directory (an advisory lock says so clearly).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from thinkcraft.utils.errors import UserError
from thinkcraft.utils.io import atomic_path

SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("row", pa.int64()),
        ("output", pa.string()),
        ("parsed_json", pa.string()),
        ("model", pa.string()),
        ("endpoint", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("cached_tokens", pa.int64()),
        ("latency_s", pa.float64()),
        ("pack_size", pa.int64()),
        ("attempts", pa.int64()),
        ("created_unix_s", pa.float64()),
    ]
)
COLUMNS = SCHEMA.names
SHARD_DIR = "shards"
JOURNAL = "journal.jsonl"


def result_row(item: Any, value: Any, text: str, model: str, endpoint: str, prompt_tokens: int,
               completion_tokens: int, cached_tokens: int, latency_s: float, pack_size: int, attempts: int
               ) -> dict[str, Any]:
    """One stored result (the SCHEMA columns but `created_unix_s`) of an item (`.key`, `.row`)."""
    return {
        "key": item.key, "row": item.row, "output": text,
        "parsed_json": json.dumps(value) if not isinstance(value, str) else None,
        "model": model, "endpoint": endpoint, "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens, "cached_tokens": cached_tokens, "latency_s": latency_s,
        "pack_size": pack_size, "attempts": attempts,
    }


def shard_paths(out_dir: str | os.PathLike) -> list[Path]:
    d = Path(out_dir) / SHARD_DIR
    return sorted(p for p in d.glob("part-*.parquet")) if d.exists() else []


def read_results(out_dir: str | os.PathLike, columns: list[str] | None = None) -> pa.Table:
    """All stored results (every shard), one row per key."""
    paths = shard_paths(out_dir)
    if not paths:
        return SCHEMA.empty_table() if columns is None else SCHEMA.empty_table().select(columns)
    return pa.concat_tables([pq.read_table(p, columns=columns, schema=SCHEMA) for p in paths])


def _read_journal(path: Path) -> list[dict[str, Any]]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # torn last line of a killed run: that item was in flight
    return rows


class ResultStore:
    """`with ResultStore(out_dir) as st: st.done_keys(); st.add(row); ...` (flushes on exit)."""

    def __init__(self, out_dir: str | os.PathLike, shard_items: int = 1000) -> None:
        self.out_dir = Path(out_dir)
        self.shard_items = shard_items
        self._buffer: list[dict[str, Any]] = []
        self._journal_f = None
        self._lock_f = None
        self._done: set[str] = set()
        self.num_shards_written = 0
        self.num_recovered = 0

    def __enter__(self) -> "ResultStore":
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._lock_f = open(self.out_dir / ".lock", "w")
        try:
            fcntl.flock(self._lock_f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_f.close()
            raise UserError(f"{self.out_dir} is in use by another label run (lock held); wait for it or use another --out-dir")
        self._done = set(read_results(self.out_dir, ["key"]).column("key").to_pylist())
        jpath = self.out_dir / JOURNAL
        recovered = [r for r in _read_journal(jpath) if r["key"] not in self._done]
        if recovered:
            seen: set[str] = set()
            uniq = [r for r in recovered if not (r["key"] in seen or seen.add(r["key"]))]
            self._write_shard(uniq)
            self.num_recovered = len(uniq)
        jpath.unlink(missing_ok=True)
        self._journal_f = open(jpath, "a", encoding="utf-8")
        return self

    def done_keys(self) -> set[str]:
        return set(self._done)

    def add(self, row: dict[str, Any]) -> bool:
        """Store one finished item; returns False (and stores nothing) when its key is already stored."""
        if row["key"] in self._done:
            return False
        row = {c: row.get(c) for c in COLUMNS}
        row["created_unix_s"] = row["created_unix_s"] or time.time()
        assert self._journal_f is not None, "use ResultStore as a context manager"
        self._journal_f.write(json.dumps(row) + "\n")
        self._journal_f.flush()
        self._done.add(row["key"])
        self._buffer.append(row)
        if len(self._buffer) >= self.shard_items:
            self.flush()
        return True

    def flush(self) -> None:
        if not self._buffer:
            return
        self._write_shard(self._buffer)
        self._buffer = []
        # the shard now holds everything the journal did: start it afresh
        assert self._journal_f is not None
        self._journal_f.truncate(0)
        self._journal_f.seek(0)

    def _write_shard(self, rows: Iterable[dict[str, Any]]) -> None:
        rows = list(rows)
        table = pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in rows], schema=SCHEMA)
        # time-ordered names: shards sort in write order; uuid keeps concurrent names apart
        name = f"part-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"
        with atomic_path(self.out_dir / SHARD_DIR / name) as tmp:
            pq.write_table(table, tmp)
        self._done.update(r["key"] for r in rows)
        self.num_shards_written += 1

    def __exit__(self, *exc: Any) -> None:
        try:
            self.flush()
        finally:
            if self._journal_f is not None:
                self._journal_f.close()
                if not self._buffer:  # everything is in shards; a failed flush keeps the journal
                    (self.out_dir / JOURNAL).unlink(missing_ok=True)
            if self._lock_f is not None:
                fcntl.flock(self._lock_f, fcntl.LOCK_UN)
                self._lock_f.close()
