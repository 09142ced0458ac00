"""Trajectory store: round trip, atomic files under SIGKILL, concurrent writers, pruning, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from thinkcraft.data import (
    SCHEMA_VERSION,
    SUMMARY_COLUMNS,
    TOKEN_COLUMNS,
    ReadReport,
    StoreError,
    TrajectoryMetadata,
    TrajectoryRecord,
    TrajectoryWriter,
    Turn,
    iter_batches,
    read_trajectories,
    scan_store,
)
from thinkcraft.data.schema import TOKEN_FIELDS

ROOT = Path(__file__).resolve().parents[1]


def make_record(i: int, num_turns: int = 3, num_tokens: int = 8, rng: np.random.Generator | None = None) -> TrajectoryRecord:
    rng = rng or np.random.default_rng(i)
    turns = []
    for j in range(num_turns):
        n_resp = num_tokens // 2
        turns.append(
            Turn(
                think=f"épisode {i} pensée {j} 🌲",
                act=["move_left", "do", "noop"][(i + j) % 3],
                obs=f"obs {i}/{j}\nhealth 9",
                reward=float((i + j) % 2),
                done=j == num_turns - 1,
                prompt_token_ids=rng.integers(0, 49152, num_tokens).astype(np.int32),
                response_token_ids=list(rng.integers(0, 49152, n_resp).tolist()),  # a list, not numpy
                logprobs=(-rng.random(n_resp)).astype(np.float32),
                loss_mask=[1] * (n_resp - 1) + [0],
            )
        )
    md = TrajectoryMetadata(env_version="craftax-1.6.1", wall_time=0.5 + i, truncated=i % 4 == 0, env_errors=i % 5 == 0,
                            policy_version=i // 2, seed=1000 + i, extra={"note": f"n{i}", "k": [i, i + 1]})
    return TrajectoryRecord.build(f"task-{i % 3}", turns, md, trajectory_id=f"traj-{i:04d}")


def by_id(records):
    return {r.trajectory_id: r for r in records}


def test_round_trip_nested_records(tmp_path):
    records = [make_record(i) for i in range(7)]
    # edge cases: no turns at all, a turn with every list empty
    records.append(TrajectoryRecord.build("empty", [], trajectory_id="traj-empty"))
    records.append(TrajectoryRecord.build("bare", [Turn(act="noop")], trajectory_id="traj-bare"))
    with TrajectoryWriter(tmp_path, run="rt", max_per_file=3) as w:
        for r in records:
            w.add(r, learner_step=5)
    assert len(w.files_written) == 3 and w.num_written == len(records)
    back = read_trajectories(tmp_path)
    assert [r.trajectory_id for r in back] == [r.trajectory_id for r in records]  # file order = write order
    for r in back:
        orig = by_id(records)[r.trajectory_id]
        assert r == orig
        assert r.metadata.extra == orig.metadata.extra
        for t in r.turns:
            for name, (_, dtype) in TOKEN_FIELDS.items():
                assert isinstance(getattr(t, name), np.ndarray) and getattr(t, name).dtype == dtype
    assert back[0].total_reward == sum(t.reward for t in records[0].turns)
    assert back[0].metadata.total_tokens == sum(len(t.prompt_token_ids) + len(t.response_token_ids) for t in records[0].turns)
    # the files carry the schema version, the kind, zstd, and the partition keys (also as columns)
    f = w.files_written[0]
    assert f.parent == tmp_path / "run=rt" / "step=00000005"
    md = pq.read_metadata(f)
    assert md.metadata[b"thinkcraft.schema_version"] == str(SCHEMA_VERSION).encode()
    assert md.row_group(0).column(0).compression == "ZSTD"
    table = read_trajectories(tmp_path, columns=["run", "learner_step"], as_table=True)
    assert set(table.column("run").to_pylist()) == {"rt"} and set(table.column("learner_step").to_pylist()) == {5}


def test_torch_tensors_are_accepted(tmp_path):
    torch = pytest.importorskip("torch")
    turn = Turn(act="do", prompt_token_ids=torch.arange(5, dtype=torch.int64), response_token_ids=torch.tensor([7, 8]),
                logprobs=torch.tensor([-0.5, -0.25]), loss_mask=torch.tensor([True, False]))
    with TrajectoryWriter(tmp_path) as w:
        w.add(TrajectoryRecord.build("t", [turn], trajectory_id="x"))
    back = read_trajectories(tmp_path)[0].turns[0]
    assert back.prompt_token_ids.tolist() == [0, 1, 2, 3, 4] and back.loss_mask.tolist() == [1, 0]
    assert back.logprobs.tolist() == [-0.5, -0.25]


def test_partitions_and_selection(tmp_path):
    with TrajectoryWriter(tmp_path, run="a", max_per_file=100) as w:
        for i in range(6):
            w.add(make_record(i), learner_step=i % 3)
    with TrajectoryWriter(tmp_path, run="b") as w2:
        w2.add(make_record(99), learner_step=0)
    assert len(read_trajectories(tmp_path)) == 7
    assert {r.trajectory_id for r in read_trajectories(tmp_path, run="b")} == {"traj-0099"}
    assert len(read_trajectories(tmp_path, run="a", learner_steps=[1, 2])) == 4
    # a partition directory can be read on its own
    assert len(read_trajectories(tmp_path / "run=a" / "step=00000001")) == 2


def test_time_based_flush_without_close(tmp_path):
    w = TrajectoryWriter(tmp_path, run="t", max_per_file=1000, max_seconds=0.2)
    w.add(make_record(0))
    deadline = time.monotonic() + 10
    while not list(tmp_path.rglob("part-*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(read_trajectories(tmp_path)) == 1, "the timer thread should have written the lone trajectory"
    w.close()
    with pytest.raises(StoreError):
        w.add(make_record(1))


def test_writer_rejects_misaligned_logprobs(tmp_path):
    bad = TrajectoryRecord.build("x", [Turn(response_token_ids=[1, 2, 3], logprobs=[-0.1])])
    with TrajectoryWriter(tmp_path) as w, pytest.raises(ValueError, match="logprobs has 1 entries"):
        w.add(bad)


def test_concurrent_writers(tmp_path):
    """4 threads share one writer, 2 more threads use a second writer on the same store."""
    shared = TrajectoryWriter(tmp_path, run="c", max_per_file=7)
    other = TrajectoryWriter(tmp_path, run="c", max_per_file=5)
    errors: list[BaseException] = []

    def produce(writer: TrajectoryWriter, start: int, n: int) -> None:
        try:
            for i in range(start, start + n):
                writer.add(make_record(i, num_turns=2), learner_step=i % 2)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(shared, k * 100, 40)) for k in range(4)]
    threads += [threading.Thread(target=produce, args=(other, 1000 + k * 100, 30)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shared.close()
    other.close()
    assert not errors
    ids = [r.trajectory_id for r in read_trajectories(tmp_path)]
    expected = {f"traj-{i:04d}" for k in range(4) for i in range(k * 100, k * 100 + 40)}
    expected |= {f"traj-{i:04d}" for k in range(2) for i in range(1000 + k * 100, 1000 + k * 100 + 30)}
    assert len(ids) == len(expected) == 220 and set(ids) == expected  # every episode exactly once
    assert shared.num_written == 160 and other.num_written == 60


_KILL_SCRIPT = r"""
import sys, numpy as np
from thinkcraft.data import TrajectoryWriter, TrajectoryRecord, Turn
rng = np.random.default_rng(0)
# ~1.3 MB per file before compression, random ids (incompressible): writes take long enough to be hit
turns = [Turn(act="do", prompt_token_ids=rng.integers(0, 2**31 - 1, 4000).astype(np.int32),
              response_token_ids=rng.integers(0, 2**31 - 1, 1000).astype(np.int32),
              logprobs=rng.random(1000).astype(np.float32), loss_mask=np.ones(1000, np.int8)) for _ in range(8)]
w = TrajectoryWriter(sys.argv[1], run="k", max_per_file=8, max_seconds=3600)
i = 0
while True:
    w.add(TrajectoryRecord.build("t", turns, trajectory_id=f"{i}"), learner_step=0)
    i += 1
"""


def _kill_writer_after(store: Path, delay_s: float) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(store)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not list(store.rglob("part-*.parquet")) and time.monotonic() < deadline:
            assert proc.poll() is None, "writer subprocess died"
            time.sleep(0.01)
        time.sleep(delay_s)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_writer_killed_mid_file_leaves_only_whole_files(tmp_path):
    hit_mid_write = 0
    for k, delay_s in enumerate([0.0, 0.13, 0.37, 0.05, 0.21, 0.6]):
        store = tmp_path / f"store{k}"
        _kill_writer_after(store, delay_s)
        scan = scan_store(store)
        assert scan.files and not scan.corrupt
        for f in scan.files:  # every visible file reads completely
            assert pq.read_table(f.path).num_rows == 8
        ids = [r.trajectory_id for r in read_trajectories(store, columns=["trajectory_id"])]
        assert ids == [str(i) for i in range(len(ids))]
        # whatever was in flight is a '.tmp-' file, which readers never open
        visible = {f.path for f in scan.files} | {store / "_thinkcraft_store.json"}
        leftovers = [p for p in store.rglob("*") if p.is_file() and p not in visible]
        assert all(p.name.startswith(".tmp-") for p in leftovers), leftovers
        assert len(scan.stale_tmp) == len(leftovers)
        hit_mid_write += bool(leftovers)
        if hit_mid_write >= 2 and k >= 2:
            break
    # the writer spends most of its time writing, so kills land mid-file: the test really exercised that case
    assert hit_mid_write >= 1


class CountingFile:
    """A read-only file object that counts the bytes pyarrow pulls from it."""

    def __init__(self, path: Path, counter: list[int]) -> None:
        self._f = open(path, "rb")
        self._counter = counter
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        b = self._f.read(n)
        self._counter[0] += len(b)
        return b

    def seek(self, off: int, whence: int = 0) -> int:
        return self._f.seek(off, whence)

    def tell(self) -> int:
        return self._f.tell()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self._f.close()
        self.closed = True

    def size(self) -> int:
        return os.fstat(self._f.fileno()).st_size


def test_column_pruning_reads_no_token_columns(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    with TrajectoryWriter(tmp_path, run="p", max_per_file=10) as w:
        for i in range(10):
            w.add(make_record(i, num_turns=5, num_tokens=2000, rng=rng))
    path = w.files_written[0]
    md = pq.read_metadata(path)
    token_bytes = sum(
        md.row_group(0).column(i).total_compressed_size
        for i in range(md.num_columns)
        if any(f".{n}." in md.row_group(0).column(i).path_in_schema for n in TOKEN_FIELDS)
    )
    file_size = path.stat().st_size
    assert token_bytes > 0.8 * file_size  # the test is only meaningful if tokens dominate

    counter = [0]
    real = pq.ParquetFile
    monkeypatch.setattr(pq, "ParquetFile", lambda src, *a, **k: real(CountingFile(Path(src), counter), *a, **k))
    report = ReadReport()
    table = read_trajectories(tmp_path, columns=list(SUMMARY_COLUMNS), as_table=True, report=report)
    turn_fields = {f.name for f in table.schema.field("turns").type.value_type}
    assert turn_fields == {"think", "act", "obs", "reward", "done"}
    assert not turn_fields & set(TOKEN_FIELDS)
    assert table.num_rows == 10
    assert 0 < counter[0] < file_size - token_bytes + 64 * 1024, (counter[0], file_size, token_bytes)
    assert report.bytes_read < file_size - token_bytes

    # the token columns alone come back too, and records built from a pruned read keep defaults
    recs = read_trajectories(tmp_path, columns=["trajectory_id", "turns.response_token_ids"])
    assert len(recs[0].turns[0].response_token_ids) == 1000 and recs[0].turns[0].obs == ""
    assert set(TOKEN_COLUMNS) == {f"turns.{n}" for n in TOKEN_FIELDS}


def test_iter_batches_streams_across_files(tmp_path):
    with TrajectoryWriter(tmp_path, run="s", max_per_file=4) as w:
        for i in range(11):
            w.add(make_record(i))
    sizes, ids = [], []
    for batch in iter_batches(tmp_path, batch_size=3):
        sizes.append(len(batch))
        ids += [r.trajectory_id for r in batch]
    assert sizes == [3, 3, 3, 2] and ids == [f"traj-{i:04d}" for i in range(11)]
    tables = list(iter_batches(tmp_path, batch_size=5, columns=["total_reward"], as_table=True))
    assert [t.num_rows for t in tables] == [5, 5, 1] and tables[0].column_names == ["total_reward"]


# ---------------------------------------------------------------- bad input


def test_not_a_store(tmp_path):
    with pytest.raises(StoreError, match="no such file"):
        read_trajectories(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(StoreError, match="not a trajectory store"):
        read_trajectories(tmp_path)
    (tmp_path / "other.parquet").write_bytes(b"")
    pq.write_table(pa.table({"a": [1]}), tmp_path / "other.parquet")
    with pytest.raises(StoreError, match="not a thinkcraft trajectory file"):
        read_trajectories(tmp_path / "other.parquet")
    with pytest.raises(StoreError, match="not a trajectory store"):
        read_trajectories(tmp_path / "notes.txt")
    from thinkcraft.utils.errors import UserError

    assert issubclass(StoreError, UserError)  # the CLI prints it as one line, exit 2
    with pytest.raises(StoreError, match="unknown column"):
        with TrajectoryWriter(tmp_path / "s") as w:
            w.add(make_record(0))
        read_trajectories(tmp_path / "s", columns=["turns.nope"])


def _rewrite_with_version(path: Path, version: str) -> None:
    t = pq.read_table(path)
    meta = dict(t.schema.metadata)
    meta[b"thinkcraft.schema_version"] = version.encode()
    pq.write_table(t.replace_schema_metadata(meta), path)


def test_other_schema_version_is_named(tmp_path):
    with TrajectoryWriter(tmp_path, run="v", max_per_file=2) as w:
        for i in range(4):
            w.add(make_record(i))
    _rewrite_with_version(w.files_written[1], "7")
    with pytest.raises(StoreError, match=r"schema version 7.*reads version 1") as e:
        read_trajectories(tmp_path)
    assert w.files_written[1].name in str(e.value)
    scan = scan_store(tmp_path)
    assert len(scan.files) == 1 and scan.other_version == [(w.files_written[1], "7")]


def test_corrupt_files_are_skipped_counted_named(tmp_path, caplog):
    with TrajectoryWriter(tmp_path, run="x", max_per_file=2) as w:
        for i in range(6):
            w.add(make_record(i, num_tokens=400))
    truncated, garbled, good = w.files_written
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])  # footer gone
    data = bytearray(garbled.read_bytes())
    mid = len(data) // 3
    data[mid : mid + 64] = bytes(64)  # a data page overwritten; footer intact
    garbled.write_bytes(bytes(data))
    report = ReadReport()
    with caplog.at_level("WARNING", logger="thinkcraft.data"):
        recs = read_trajectories(tmp_path, report=report)
    assert {r.trajectory_id for r in recs} == {"traj-0004", "traj-0005"}
    assert sorted(p.name for p, _ in report.corrupt) == sorted([truncated.name, garbled.name])
    assert truncated.name in caplog.text and garbled.name in caplog.text
    # streaming skips them too
    report2 = ReadReport()
    streamed = [r.trajectory_id for b in iter_batches(tmp_path, batch_size=10, report=report2) for r in b]
    assert streamed == ["traj-0004", "traj-0005"] and len(report2.corrupt) == 2


def test_write_failure_is_a_store_error_and_close_does_not_hang(tmp_path, monkeypatch):
    import thinkcraft.data.writer as writer_mod

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    w = TrajectoryWriter(tmp_path, run="e", max_per_file=2)
    monkeypatch.setattr(writer_mod.pq, "write_table", disk_full)
    w.add(make_record(0))
    with pytest.raises(StoreError, match="No space left"):
        w.add(make_record(1))  # fills the buffer: this producer writes the file
    w.add(make_record(2), learner_step=1)
    w.add(make_record(3), learner_step=2)
    with pytest.raises(StoreError, match="No space left"):
        w.close()  # both partitions are attempted; the first failure is raised, nothing hangs
    assert not list(tmp_path.rglob("*.parquet")) and not list(tmp_path.rglob(".tmp-*"))
