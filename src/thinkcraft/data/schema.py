"""Trajectory schema (versioned): Python dataclasses <-> one Arrow table with nested columns.

One row per episode. Layout (seed 003 §6, plus what a token-in/token-out learner needs):

    task_id: string            trajectory_id: string        total_reward: float64
    turns: list<struct<think, act, obs: string, reward: float32, done: bool,
                       prompt_token_ids: list<int32>, response_token_ids: list<int32>,
                       logprobs: list<float32>, loss_mask: list<int8>>>
    metadata: struct<env_version: string, total_steps: int32, total_tokens: int64, wall_time: float64,
                     truncated: bool, env_errors: int32, policy_version: int64, seed: int64, extra: string(JSON)>
    run: string                learner_step: int64          (partition keys, also in the directory names)

Parquet stores every leaf of the nested struct as its own column chunk, so a reader can fetch
`turns.reward` + `metadata` without touching a byte of the token columns (see `parquet_paths`).
The version lives in each file's key-value metadata (`thinkcraft.schema_version`).

Token fields accept lists or 1-D numpy arrays; numpy is the fast path (one `np.concatenate`
instead of a per-integer Python conversion), and the reader hands back numpy views.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa

from thinkcraft.utils.errors import UserError

SCHEMA_VERSION = 1
# Parquet key-value metadata keys written into every file.
META_VERSION_KEY = b"thinkcraft.schema_version"
META_KIND_KEY = b"thinkcraft.kind"
KIND = b"trajectories"


class StoreError(UserError):
    """A trajectory store problem the user can fix: not a store, wrong schema version, unreadable files."""


TokenSeq = Sequence[int] | np.ndarray
FloatSeq = Sequence[float] | np.ndarray

# name -> (arrow value type, numpy dtype) of the four per-token fields of a turn.
TOKEN_FIELDS: dict[str, tuple[pa.DataType, type]] = {
    "prompt_token_ids": (pa.int32(), np.int32),
    "response_token_ids": (pa.int32(), np.int32),
    "logprobs": (pa.float32(), np.float32),
    "loss_mask": (pa.int8(), np.int8),
}
TEXT_TURN_FIELDS = ("think", "act", "obs")


@dataclass(eq=False)
class Turn:
    """One agent step: what the model thought and did, what it saw next, and the tokens to train on.

    `logprobs` and `loss_mask` are aligned with `response_token_ids` (one per sampled token; empty
    when not recorded). `loss_mask[i] = 1` means token i is trained on (0: e.g. a forced/parsed token).
    """

    think: str = ""
    act: str = ""
    obs: str = ""
    reward: float = 0.0
    done: bool = False
    prompt_token_ids: TokenSeq = field(default_factory=list)
    response_token_ids: TokenSeq = field(default_factory=list)
    logprobs: FloatSeq = field(default_factory=list)
    loss_mask: TokenSeq = field(default_factory=list)

    def validate(self, where: str = "turn") -> None:
        n = len(self.response_token_ids)
        for name in ("logprobs", "loss_mask"):
            m = len(getattr(self, name))
            if m not in (0, n):
                raise ValueError(f"{where}: {name} has {m} entries but response_token_ids has {n} (must match or be empty)")

    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.response_token_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Turn):
            return NotImplemented
        if (self.think, self.act, self.obs, bool(self.done)) != (other.think, other.act, other.obs, bool(other.done)):
            return False
        if not np.isclose(float(self.reward), float(other.reward), rtol=1e-6, atol=1e-6):
            return False
        for name, (_, dtype) in TOKEN_FIELDS.items():
            a = np.asarray(getattr(self, name), dtype=dtype)
            b = np.asarray(getattr(other, name), dtype=dtype)
            if a.shape != b.shape or not np.array_equal(a, b):
                return False
        return True


@dataclass
class TrajectoryMetadata:
    """Per-episode facts for reproducibility, filtering and staleness control."""

    env_version: str = ""
    total_steps: int = 0
    total_tokens: int = 0
    wall_time: float = 0.0
    """Seconds the episode took, wall clock."""
    truncated: bool = False
    """Stopped by a step/token limit, not by the environment's own end."""
    env_errors: int = 0
    policy_version: int = 0
    """Learner step of the weights that sampled the episode (off-policy lag = learner step - this)."""
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON-serialisable fields (stored as one JSON string)."""


@dataclass(eq=False)
class TrajectoryRecord:
    """One episode. Build with `TrajectoryRecord.build(...)` to fill ids, totals and counts."""

    task_id: str
    trajectory_id: str
    turns: list[Turn] = field(default_factory=list)
    total_reward: float = 0.0
    metadata: TrajectoryMetadata = field(default_factory=TrajectoryMetadata)

    @classmethod
    def build(
        cls,
        task_id: str,
        turns: list[Turn],
        metadata: TrajectoryMetadata | None = None,
        trajectory_id: str | None = None,
        total_reward: float | None = None,
    ) -> "TrajectoryRecord":
        """Fill the derived fields: a fresh uuid, total_reward = sum of turn rewards, step and token counts."""
        md = metadata if metadata is not None else TrajectoryMetadata()
        if md.total_steps == 0:
            md.total_steps = len(turns)
        if md.total_tokens == 0:
            md.total_tokens = sum(t.num_tokens() for t in turns)
        return cls(
            task_id=task_id,
            trajectory_id=trajectory_id or uuid.uuid4().hex,
            turns=turns,
            total_reward=float(sum(float(t.reward) for t in turns)) if total_reward is None else float(total_reward),
            metadata=md,
        )

    def validate(self) -> None:
        for i, t in enumerate(self.turns):
            t.validate(f"trajectory {self.trajectory_id} turn {i}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrajectoryRecord):
            return NotImplemented
        return (
            self.task_id == other.task_id
            and self.trajectory_id == other.trajectory_id
            and np.isclose(self.total_reward, other.total_reward)
            and self.metadata == other.metadata
            and len(self.turns) == len(other.turns)
            and all(a == b for a, b in zip(self.turns, other.turns))
        )


# ---------------------------------------------------------------- arrow schema

TURN_TYPE = pa.struct(
    [
        ("think", pa.string()),
        ("act", pa.string()),
        ("obs", pa.string()),
        ("reward", pa.float32()),
        ("done", pa.bool_()),
    ]
    + [(name, pa.list_(t)) for name, (t, _) in TOKEN_FIELDS.items()]
)
METADATA_TYPE = pa.struct(
    [
        ("env_version", pa.string()),
        ("total_steps", pa.int32()),
        ("total_tokens", pa.int64()),
        ("wall_time", pa.float64()),
        ("truncated", pa.bool_()),
        ("env_errors", pa.int32()),
        ("policy_version", pa.int64()),
        ("seed", pa.int64()),
        ("extra", pa.string()),
    ]
)
ARROW_SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("trajectory_id", pa.string()),
        ("total_reward", pa.float64()),
        ("turns", pa.list_(TURN_TYPE)),
        ("metadata", METADATA_TYPE),
        ("run", pa.string()),
        ("learner_step", pa.int64()),
    ],
    metadata={META_VERSION_KEY: str(SCHEMA_VERSION).encode(), META_KIND_KEY: KIND},
)

TURN_SUBFIELDS = tuple(f.name for f in TURN_TYPE)
METADATA_SUBFIELDS = tuple(f.name for f in METADATA_TYPE)
TOP_LEVEL = tuple(ARROW_SCHEMA.names)
# Column names a caller may ask for: top-level names, "turns.<field>", "metadata.<field>".
COLUMNS = (
    TOP_LEVEL
    + tuple(f"turns.{n}" for n in TURN_SUBFIELDS)
    + tuple(f"metadata.{n}" for n in METADATA_SUBFIELDS)
)
TOKEN_COLUMNS = tuple(f"turns.{n}" for n in TOKEN_FIELDS)
# Everything but the (large) per-token columns: what filtering and `data inspect` read.
SUMMARY_COLUMNS = (
    "task_id",
    "trajectory_id",
    "total_reward",
    *(f"turns.{n}" for n in TURN_SUBFIELDS if n not in TOKEN_FIELDS),
    "metadata",
    "run",
    "learner_step",
)


def parquet_paths(columns: Iterable[str]) -> list[str]:
    """User column names -> Parquet column paths for `ParquetFile.read(columns=...)` (nested pruning)."""
    out: list[str] = []
    for c in columns:
        if c not in COLUMNS:
            raise StoreError(f"unknown column {c!r}; known: {', '.join(COLUMNS)}")
        if c.startswith("turns."):
            p = "turns.list.element." + c.split(".", 1)[1]
        else:
            p = c
        if p not in out:
            out.append(p)
    # "turns" (whole) subsumes "turns.x"; same for "metadata".
    for whole, prefix in (("turns", "turns.list.element."), ("metadata", "metadata.")):
        if whole in out:
            out = [p for p in out if not p.startswith(prefix)]
    return out


# ---------------------------------------------------------------- records -> table


def _list_array(seqs: list, value_type: pa.DataType, dtype: type) -> pa.Array:
    """A list<value_type> array from per-row sequences; numpy rows are concatenated without Python loops.

    Rows may be lists, tuples, numpy arrays or anything `np.asarray` takes (e.g. CPU torch tensors)."""
    seqs = [s if isinstance(s, (np.ndarray, list, tuple)) else np.asarray(s, dtype=dtype) for s in seqs]
    if seqs and all(isinstance(s, np.ndarray) for s in seqs):
        lengths = np.fromiter((s.shape[0] for s in seqs), dtype=np.int64, count=len(seqs))
        offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.concatenate(seqs).astype(dtype, copy=False) if len(seqs) else np.zeros(0, dtype)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))
    return pa.array([np.asarray(s, dtype=dtype) if isinstance(s, np.ndarray) else s for s in seqs], type=pa.list_(value_type))


def records_to_table(records: Sequence[TrajectoryRecord], run: str = "", learner_step: int = 0) -> pa.Table:
    """Convert episodes to one Arrow table of `ARROW_SCHEMA` (validates the per-token alignment)."""
    all_turns: list[Turn] = []
    turn_offsets = np.zeros(len(records) + 1, dtype=np.int32)
    for i, r in enumerate(records):
        r.validate()
        all_turns.extend(r.turns)
        turn_offsets[i + 1] = len(all_turns)
    children = [
        pa.array([t.think for t in all_turns], type=pa.string()),
        pa.array([t.act for t in all_turns], type=pa.string()),
        pa.array([t.obs for t in all_turns], type=pa.string()),
        pa.array([float(t.reward) for t in all_turns], type=pa.float32()),
        pa.array([bool(t.done) for t in all_turns], type=pa.bool_()),
    ]
    for name, (vt, dt) in TOKEN_FIELDS.items():
        children.append(_list_array([getattr(t, name) for t in all_turns], vt, dt))
    turns_struct = pa.StructArray.from_arrays(children, fields=list(TURN_TYPE))
    turns = pa.ListArray.from_arrays(pa.array(turn_offsets), turns_struct)
    mds = [r.metadata for r in records]
    md = pa.StructArray.from_arrays(
        [
            pa.array([str(m.env_version) for m in mds], pa.string()),
            pa.array([int(m.total_steps) for m in mds], pa.int32()),
            pa.array([int(m.total_tokens) for m in mds], pa.int64()),
            pa.array([float(m.wall_time) for m in mds], pa.float64()),
            pa.array([bool(m.truncated) for m in mds], pa.bool_()),
            pa.array([int(m.env_errors) for m in mds], pa.int32()),
            pa.array([int(m.policy_version) for m in mds], pa.int64()),
            pa.array([int(m.seed) for m in mds], pa.int64()),
            pa.array([json.dumps(m.extra, sort_keys=True) if m.extra else "" for m in mds], pa.string()),
        ],
        fields=list(METADATA_TYPE),
    )
    n = len(records)
    return pa.Table.from_arrays(
        [
            pa.array([r.task_id for r in records], pa.string()),
            pa.array([r.trajectory_id for r in records], pa.string()),
            pa.array([float(r.total_reward) for r in records], pa.float64()),
            turns,
            md,
            pa.array([run] * n, pa.string()),
            pa.array([learner_step] * n, pa.int64()),
        ],
        schema=ARROW_SCHEMA,
    )


# ---------------------------------------------------------------- table -> records


def _flat_lists(arr: pa.Array, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) numpy views of a list array (nulls read as empty lists)."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    offsets = arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    values = arr.values.to_numpy(zero_copy_only=False)
    if values.dtype != dtype:
        values = values.astype(dtype)
    return values, offsets


def table_to_records(table: pa.Table) -> list[TrajectoryRecord]:
    """Rows -> records. Columns absent from `table` (pruned reads) take the dataclass defaults.

    Token fields come back as numpy arrays that are views of one buffer per column (no per-token copy).
    """
    n = table.num_rows
    names = set(table.column_names)
    col = {c: table.column(c).to_pylist() for c in ("task_id", "trajectory_id", "total_reward") if c in names}
    turns_per_row: list[list[Turn]] = [[] for _ in range(n)]
    if "turns" in names and n:
        turns_arr = table.column("turns").combine_chunks()
        outer = turns_arr.offsets.to_numpy(zero_copy_only=False)
        structs = turns_arr.values
        present = [structs.type.field(i).name for i in range(structs.type.num_fields)]
        simple = {k: structs.field(k).to_pylist() for k in present if k not in TOKEN_FIELDS}
        tokens = {k: _flat_lists(structs.field(k), TOKEN_FIELDS[k][1]) for k in present if k in TOKEN_FIELDS}
        num_turns = len(structs)
        made: list[Turn] = []
        for j in range(num_turns):
            kw: dict[str, Any] = {k: v[j] for k, v in simple.items() if v[j] is not None}
            for k, (vals, offs) in tokens.items():
                kw[k] = vals[offs[j] : offs[j + 1]]
            made.append(Turn(**kw))
        for i in range(n):
            turns_per_row[i] = made[outer[i] : outer[i + 1]]
    mds: list[TrajectoryMetadata] = [TrajectoryMetadata() for _ in range(n)]
    if "metadata" in names:
        for i, d in enumerate(table.column("metadata").to_pylist()):
            d = {k: v for k, v in (d or {}).items() if v is not None}
            if "extra" in d:
                d["extra"] = json.loads(d["extra"]) if d["extra"] else {}
            mds[i] = TrajectoryMetadata(**d)
    return [
        TrajectoryRecord(
            task_id=col["task_id"][i] if "task_id" in col else "",
            trajectory_id=col["trajectory_id"][i] if "trajectory_id" in col else "",
            turns=turns_per_row[i],
            total_reward=col["total_reward"][i] if "total_reward" in col else 0.0,
            metadata=mds[i],
        )
        for i in range(n)
    ]


def record_to_json_dict(rec: TrajectoryRecord, include_tokens: bool = True) -> dict[str, Any]:
    """A plain dict for JSON export (numpy arrays -> lists)."""
    turns = []
    for t in rec.turns:
        d: dict[str, Any] = {k: getattr(t, k) for k in ("think", "act", "obs")}
        d["reward"] = float(t.reward)
        d["done"] = bool(t.done)
        if include_tokens:
            for k, (_, dt) in TOKEN_FIELDS.items():
                d[k] = np.asarray(getattr(t, k), dtype=dt).tolist()
        turns.append(d)
    md = {f.name: getattr(rec.metadata, f.name) for f in fields(TrajectoryMetadata)}
    return {
        "task_id": rec.task_id,
        "trajectory_id": rec.trajectory_id,
        "total_reward": float(rec.total_reward),
        "turns": turns,
        "metadata": md,
    }
