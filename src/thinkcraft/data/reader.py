"""Read a trajectory store: find its files, prune columns, stream batches, apply filters.

Bad input never becomes a traceback: a directory that is not a store and a file of another schema
version raise `StoreError` (a `UserError`: the CLI prints one line); a corrupt file is skipped,
counted in the `ReadReport` and named in a warning on the `thinkcraft.data` logger.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from thinkcraft.data.filters import Filter, FilterReport, apply_filters
from thinkcraft.data.schema import (
    COLUMNS,
    KIND,
    META_KIND_KEY,
    META_VERSION_KEY,
    SCHEMA_VERSION,
    TOP_LEVEL,
    StoreError,
    TrajectoryRecord,
    parquet_paths,
    table_to_records,
)
from thinkcraft.data.writer import MARKER_NAME

log = logging.getLogger("thinkcraft.data")
_PART_RE = re.compile(r"^(run|step)=(.*)$")


@dataclass
class StoreFile:
    path: Path
    num_rows: int
    size_bytes: int
    run: str | None
    learner_step: int | None
    metadata: pq.FileMetaData


@dataclass
class StoreScan:
    """What a store directory holds, without reading any data pages (footers only)."""

    root: Path
    files: list[StoreFile] = field(default_factory=list)
    corrupt: list[tuple[Path, str]] = field(default_factory=list)
    """Unreadable files: (path, reason)."""
    other_version: list[tuple[Path, str]] = field(default_factory=list)
    """thinkcraft trajectory files of another schema version: (path, version)."""
    foreign: list[Path] = field(default_factory=list)
    """Parquet files that are not thinkcraft trajectory files (skipped)."""
    stale_tmp: list[Path] = field(default_factory=list)
    """'.tmp-*' leftovers of writers killed mid-file (never read)."""
    has_marker: bool = False

    @property
    def num_rows(self) -> int:
        return sum(f.num_rows for f in self.files)

    def check_version(self) -> None:
        if self.other_version:
            path, v = self.other_version[0]
            more = f" (and {len(self.other_version) - 1} more)" if len(self.other_version) > 1 else ""
            raise StoreError(
                f"{path} has trajectory schema version {v}{more}; this thinkcraft reads version {SCHEMA_VERSION}. "
                "Use the thinkcraft version that wrote it, or move those files out of the store."
            )


@dataclass
class ReadReport:
    """Filled in by `read_trajectories` / `iter_batches` when passed: what was read and dropped."""

    files_read: int = 0
    rows_read: int = 0
    bytes_read: int = 0
    corrupt: list[tuple[Path, str]] = field(default_factory=list)
    filters: FilterReport = field(default_factory=FilterReport)


def _partition(path: Path, root: Path) -> tuple[str | None, int | None]:
    run: str | None = None
    step: int | None = None
    for part in path.relative_to(root).parts[:-1]:
        m = _PART_RE.match(part)
        if m and m.group(1) == "run":
            run = m.group(2)
        elif m and m.group(1) == "step":
            try:
                step = int(m.group(2))
            except ValueError:
                pass
    return run, step


def scan_store(
    root: str | os.PathLike,
    run: str | None = None,
    learner_steps: Iterable[int] | None = None,
) -> StoreScan:
    """Find the store's files and read their footers (cheap); optionally keep one run / some steps."""
    root = Path(root)
    if not root.exists():
        raise StoreError(f"{root}: no such file or directory")
    if root.is_file():
        if root.suffix != ".parquet":
            raise StoreError(f"{root} is not a trajectory store (a directory) nor one of its .parquet files")
        candidates, base, has_marker = [root], root.parent, False
    else:
        base, has_marker = root, (root / MARKER_NAME).is_file()
        if not _is_store_dir(root):
            raise StoreError(
                f"{root} is not a trajectory store: no {MARKER_NAME} in it or above it and no run=* partitions "
                "(point at the directory a TrajectoryWriter wrote)"
            )
        candidates = []
        stale: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith(".tmp-"):
                    stale.append(Path(dirpath) / name)
                elif name.endswith(".parquet") and not name.startswith("."):
                    candidates.append(Path(dirpath) / name)
    scan = StoreScan(root=root, has_marker=has_marker)
    if not root.is_file():
        scan.stale_tmp = stale
    steps = set(learner_steps) if learner_steps is not None else None
    for path in candidates:
        prun, pstep = _partition(path, base)
        if run is not None and prun is not None and prun != run:
            continue
        if steps is not None and pstep is not None and pstep not in steps:
            continue
        try:
            md = pq.read_metadata(path)
        except Exception as e:  # noqa: BLE001 - any footer failure means the file is unusable
            scan.corrupt.append((path, _reason(e)))
            continue
        kv = md.metadata or {}
        if kv.get(META_KIND_KEY) != KIND:
            scan.foreign.append(path)
            continue
        version = kv.get(META_VERSION_KEY, b"?").decode(errors="replace")
        if version != str(SCHEMA_VERSION):
            scan.other_version.append((path, version))
            continue
        scan.files.append(StoreFile(path, md.num_rows, path.stat().st_size, prun, pstep, md))
    if root.is_file() and scan.foreign:
        raise StoreError(f"{root} is a Parquet file but not a thinkcraft trajectory file (no {META_KIND_KEY.decode()} metadata)")
    return scan


def _is_store_dir(root: Path) -> bool:
    """A store has the writer's marker file at its root; a partition directory has it above."""
    if any((d / MARKER_NAME).is_file() for d in [root, *root.resolve().parents]):
        return True
    return any(p.is_dir() for p in root.glob("run=*"))  # marker lost (files copied): Hive layout still says so


def _reason(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:200]


def _needed_columns(columns: Sequence[str] | None, filters: Sequence[Filter]) -> tuple[list[str], list[str]]:
    """(requested user columns, user columns to read = requested + what the filters need)."""
    requested = list(TOP_LEVEL) if columns is None else list(columns)
    for c in requested:
        if c not in COLUMNS:
            raise StoreError(f"unknown column {c!r}; known: {', '.join(COLUMNS)}")
    to_read = list(requested)
    for f in filters:
        for c in f.columns:
            if c not in to_read:
                to_read.append(c)
    return requested, to_read


def _project(table: pa.Table, requested: Sequence[str]) -> pa.Table:
    """Drop top-level columns read only for the filters."""
    keep_top = {c.split(".", 1)[0] for c in requested}
    return table.select([n for n in table.column_names if n in keep_top])


def _skip_corrupt(report: ReadReport | None, path: Path, e: BaseException) -> None:
    reason = _reason(e)
    log.warning("skipping corrupt trajectory file %s (%s)", path, reason)
    if report is not None:
        report.corrupt.append((path, reason))


def read_table(
    root: str | os.PathLike,
    columns: Sequence[str] | None = None,
    filters: Sequence[Filter] = (),
    run: str | None = None,
    learner_steps: Iterable[int] | None = None,
    report: ReadReport | None = None,
) -> pa.Table:
    """The whole (filtered) store as one Arrow table. Columns: see `schema.COLUMNS`.

    Filters run over all rows together (groups may span files), in the order given.
    """
    scan = scan_store(root, run=run, learner_steps=learner_steps)
    scan.check_version()
    if report is not None:
        report.corrupt.extend(scan.corrupt)
    for path, reason in scan.corrupt:
        log.warning("skipping corrupt trajectory file %s (%s)", path, reason)
    requested, to_read = _needed_columns(columns, filters)
    paths = parquet_paths(to_read)
    table = read_files(scan.files, paths, report)
    if filters:
        table = apply_filters(table, filters, report.filters if report is not None else None)
    return _project(table, requested)


def read_files(files: Sequence[StoreFile], paths: list[str], report: ReadReport | None = None) -> pa.Table:
    """Read Parquet column paths from scanned files into one table; corrupt files are skipped and counted."""
    tables = []
    for f in files:
        try:
            t = pq.ParquetFile(f.path, page_checksum_verification=True).read(columns=paths)
        except Exception as e:  # noqa: BLE001 - a damaged data page: skip, count, name
            _skip_corrupt(report, f.path, e)
            continue
        tables.append(t)
        if report is not None:
            report.files_read += 1
            report.rows_read += t.num_rows
            report.bytes_read += _column_bytes(f.metadata, paths)
    if tables:
        return pa.concat_tables(tables)
    return pa.Table.from_batches([], schema=_empty_schema(paths))


def _empty_schema(paths: list[str]) -> pa.Schema:
    from thinkcraft.data.schema import ARROW_SCHEMA

    tops = []
    for p in paths:
        top = p.split(".", 1)[0]
        if top not in tops:
            tops.append(top)
    return pa.schema([ARROW_SCHEMA.field(t) for t in tops])


def _column_bytes(md: pq.FileMetaData, paths: Sequence[str]) -> int:
    """Compressed bytes of the column chunks a pruned read touches (from the footer)."""
    total = 0
    for rg in range(md.num_row_groups):
        g = md.row_group(rg)
        for i in range(g.num_columns):
            c = g.column(i)
            if any(c.path_in_schema == p or c.path_in_schema.startswith(p + ".") for p in paths):
                total += c.total_compressed_size
    return total


def read_trajectories(
    root: str | os.PathLike,
    columns: Sequence[str] | None = None,
    filters: Sequence[Filter] = (),
    run: str | None = None,
    learner_steps: Iterable[int] | None = None,
    as_table: bool = False,
    report: ReadReport | None = None,
) -> list[TrajectoryRecord] | pa.Table:
    """Episodes of a store (or one file) as `TrajectoryRecord`s, or as an Arrow table with `as_table`.

    `columns` prunes what is read (e.g. `SUMMARY_COLUMNS`: everything but the token columns); fields
    not read keep their dataclass defaults in the records. `filters` (see `thinkcraft.data.filters`)
    are applied in order over all rows; `report` collects files read, corrupt files and filter drops.
    """
    table = read_table(root, columns, filters, run=run, learner_steps=learner_steps, report=report)
    return table if as_table else table_to_records(table)


def iter_batches(
    root: str | os.PathLike,
    batch_size: int = 256,
    columns: Sequence[str] | None = None,
    filters: Sequence[Filter] = (),
    run: str | None = None,
    learner_steps: Iterable[int] | None = None,
    as_table: bool = False,
    report: ReadReport | None = None,
) -> Iterator[list[TrajectoryRecord] | pa.Table]:
    """Stream the store in batches of `batch_size` rows read (fewer after filters; memory ~ one batch).

    Filters apply per batch: a group filter sees the groups within a batch, the duplicate filter
    remembers what it kept across batches, the balance filter balances each batch.
    """
    if batch_size < 1:
        raise StoreError(f"batch_size must be >= 1, got {batch_size}")
    scan = scan_store(root, run=run, learner_steps=learner_steps)
    scan.check_version()
    for path, reason in scan.corrupt:
        log.warning("skipping corrupt trajectory file %s (%s)", path, reason)
    if report is not None:
        report.corrupt.extend(scan.corrupt)
    requested, to_read = _needed_columns(columns, filters)
    paths = parquet_paths(to_read)

    def emit(batches: list[pa.RecordBatch]):
        t = pa.Table.from_batches(batches)
        if filters:
            t = apply_filters(t, filters, report.filters if report is not None else None)
        t = _project(t, requested)
        return t if as_table else table_to_records(t)

    def file_batches(f: StoreFile) -> Iterator[pa.RecordBatch]:
        try:
            pf = pq.ParquetFile(f.path, page_checksum_verification=True)
            for b in pf.iter_batches(batch_size=batch_size, columns=paths):
                yield b
        except Exception as e:  # noqa: BLE001 - a damaged data page: skip the rest of the file, count it
            _skip_corrupt(report, f.path, e)
            return
        if report is not None:
            report.files_read += 1
            report.bytes_read += _column_bytes(f.metadata, paths)

    pending: list[pa.RecordBatch] = []
    num_pending = 0
    for f in scan.files:
        for b in file_batches(f):
            if report is not None:
                report.rows_read += b.num_rows
            pending.append(b)
            num_pending += b.num_rows
            while num_pending >= batch_size:
                t = pa.Table.from_batches(pending)
                head, rest = t.slice(0, batch_size), t.slice(batch_size)
                yield emit(head.to_batches())
                pending = rest.to_batches()
                num_pending = rest.num_rows
    if num_pending:
        yield emit(pending)
