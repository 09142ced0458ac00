"""Buffered, thread-safe, atomic Parquet writer: one file per N trajectories or per T seconds.

Layout (Hive-style partitions, so other tools can read it too):

    <root>/_thinkcraft_store.json                       marks the directory as a store (format, version)
    <root>/run=<run>/step=<learner_step:08d>/part-<time_ns>-<pid>-<uuid>.parquet

Each file is written to a '.tmp-*' name in the same directory and renamed when complete
(`thinkcraft.utils.io.atomic_path`); readers skip dot-files, so a process killed mid-write never
leaves a partial visible file. Producers only hold the lock to append to a buffer; conversion,
compression and the write happen outside it, so several threads can add while one file is written.
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType

import pyarrow.parquet as pq

from thinkcraft.data.schema import SCHEMA_VERSION, StoreError, TrajectoryRecord, records_to_table
from thinkcraft.utils.io import atomic_path, atomic_write_json

MARKER_NAME = "_thinkcraft_store.json"
FORMAT_NAME = "thinkcraft-trajectories"
_RUN_RE = re.compile(r"^[A-Za-z0-9._-]+$")


def partition_dir(root: str | os.PathLike, run: str, learner_step: int) -> Path:
    return Path(root) / f"run={run}" / f"step={learner_step:08d}"


def drop_partitions_from(root: str | os.PathLike, run: str, learner_step: int) -> list[Path]:
    """Delete run `run`'s partitions of learner steps >= `learner_step` (a resumed run regenerates them:
    without this, episodes of the steps after its checkpoint would be in the store twice)."""
    import shutil

    run_dir = Path(root) / f"run={run}"
    gone = [d for d in run_dir.glob("step=*") if d.is_dir() and d.name[5:].isdigit() and int(d.name[5:]) >= learner_step]
    for d in gone:
        shutil.rmtree(d)
    return gone


def write_marker(root: str | os.PathLike) -> None:
    path = Path(root) / MARKER_NAME
    if not path.exists():
        atomic_write_json(path, {"format": FORMAT_NAME, "schema_version": SCHEMA_VERSION})


class TrajectoryWriter:
    """Append episodes; files appear atomically under `<root>/run=<run>/step=<learner_step>/`.

    A file is written when a partition's buffer holds `max_per_file` trajectories, when its oldest
    trajectory has waited `max_seconds` (a background thread checks, so a quiet producer still gets
    its data on disk), on `flush()` and on `close()`. Use as a context manager.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        run: str = "run",
        max_per_file: int = 256,
        max_seconds: float = 60.0,
        compression: str = "zstd",
        compression_level: int = 3,
    ) -> None:
        if not _RUN_RE.match(run):
            raise StoreError(f"run name {run!r}: use letters, digits, '.', '_' or '-' (it becomes a directory name)")
        if max_per_file < 1:
            raise StoreError(f"max_per_file must be >= 1, got {max_per_file}")
        if max_seconds <= 0:
            raise StoreError(f"max_seconds must be > 0, got {max_seconds}")
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"{self.root} exists and is not a directory")
        self.run = run
        self.max_per_file = max_per_file
        self.max_seconds = max_seconds
        self.compression = compression
        self.compression_level = compression_level
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0  # files being written outside the lock; close() waits for them
        self._buffers: dict[int, list[TrajectoryRecord]] = {}
        self._first_add_s: dict[int, float] = {}
        self._closed = False
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self.files_written: list[Path] = []
        self.num_written = 0
        self.bytes_written = 0
        self.root.mkdir(parents=True, exist_ok=True)
        write_marker(self.root)

    # ------------------------------------------------------------ producers

    def add(self, record: TrajectoryRecord, learner_step: int = 0) -> None:
        """Buffer one episode (thread-safe); writes a file when the partition's buffer is full."""
        self._raise_pending()
        record.validate()
        full: list[TrajectoryRecord] | None = None
        with self._lock:
            if self._closed:
                raise StoreError("TrajectoryWriter.add after close()")
            buf = self._buffers.setdefault(learner_step, [])
            if not buf:
                self._first_add_s[learner_step] = time.monotonic()
            buf.append(record)
            if len(buf) >= self.max_per_file:
                full = self._buffers.pop(learner_step)
                self._first_add_s.pop(learner_step, None)
                self._inflight += 1
            if self._timer is None:
                self._timer = threading.Thread(target=self._timer_loop, name="TrajectoryWriter-timer", daemon=True)
                self._timer.start()
        if full is not None:
            self._write_tracked(full, learner_step)

    def add_many(self, records: list[TrajectoryRecord], learner_step: int = 0) -> None:
        for r in records:
            self.add(r, learner_step)

    def flush(self) -> None:
        """Write every buffered trajectory now (one file per partition with data)."""
        self._raise_pending()
        self._flush_where(lambda step, t0: True)
        self._raise_pending()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._timer is not None:
            self._timer.join()
        self._flush_where(lambda step, t0: True)
        with self._idle:  # producers may still be writing the files they filled
            while self._inflight:
                self._idle.wait()
        self._raise_pending()

    def __enter__(self) -> "TrajectoryWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _flush_where(self, pred) -> None:
        with self._lock:
            due = [s for s, t0 in self._first_add_s.items() if pred(s, t0)]
            batches = [(s, self._buffers.pop(s)) for s in due]
            for s in due:
                self._first_add_s.pop(s, None)
            self._inflight += len(batches)
        first_error: BaseException | None = None
        for step, recs in batches:  # write every partition even if one fails (each decrements _inflight)
            try:
                self._write_tracked(recs, step)
            except BaseException as e:  # noqa: BLE001
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def _write_tracked(self, records: list[TrajectoryRecord], learner_step: int) -> None:
        try:
            if records:
                self._write(records, learner_step)
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    def _timer_loop(self) -> None:
        period = min(1.0, self.max_seconds / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            try:
                self._flush_where(lambda step, t0: now - t0 >= self.max_seconds)
            except BaseException as e:  # surfaced on the producer's next call
                self._error = e
                return

    def _write(self, records: list[TrajectoryRecord], learner_step: int) -> None:
        table = records_to_table(records, run=self.run, learner_step=learner_step)
        d = partition_dir(self.root, self.run, learner_step)
        path = d / f"part-{time.time_ns()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.parquet"
        try:
            with atomic_path(path) as tmp:
                pq.write_table(
                    table,
                    tmp,
                    compression=self.compression,
                    compression_level=self.compression_level,
                    row_group_size=max(len(records), 1),
                    # page CRCs: a flipped byte in a data page is reported as corrupt, not read as data
                    write_page_checksum=True,
                )
        except OSError as e:
            raise StoreError(f"could not write {path}: {e}") from e
        size = path.stat().st_size
        with self._lock:
            self.files_written.append(path)
            self.num_written += len(records)
            self.bytes_written += size

    def _raise_pending(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise StoreError(f"trajectory writer failed writing to {self.root}: {type(e).__name__}: {e}") from e
