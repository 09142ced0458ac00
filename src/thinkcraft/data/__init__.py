"""Trajectory store: typed, versioned episode records written atomically as Parquet, read with column
pruning and streaming, filtered before training (seed 003 §6). The one place that writes and reads them.

    with TrajectoryWriter("runs/x/trajectories", run="x") as w:
        w.add(TrajectoryRecord.build("task-0", turns, TrajectoryMetadata(policy_version=3)), learner_step=3)
    summary = read_trajectories(root, columns=SUMMARY_COLUMNS, filters=[completeness_filter()], as_table=True)
"""

from thinkcraft.data.filters import (
    Filter,
    FilterDecision,
    FilterReport,
    apply_filters,
    balance_filter,
    completeness_filter,
    duplicate_filter,
    reward_outlier_filter,
    zero_reward_group_filter,
)
from thinkcraft.data.reader import ReadReport, StoreScan, iter_batches, read_table, read_trajectories, scan_store
from thinkcraft.data.schema import (
    ARROW_SCHEMA,
    COLUMNS,
    SCHEMA_VERSION,
    SUMMARY_COLUMNS,
    TOKEN_COLUMNS,
    StoreError,
    TrajectoryMetadata,
    TrajectoryRecord,
    Turn,
    records_to_table,
    table_to_records,
)
from thinkcraft.data.writer import TrajectoryWriter

__all__ = [
    "ARROW_SCHEMA",
    "COLUMNS",
    "SCHEMA_VERSION",
    "SUMMARY_COLUMNS",
    "TOKEN_COLUMNS",
    "Filter",
    "FilterDecision",
    "FilterReport",
    "ReadReport",
    "StoreError",
    "StoreScan",
    "TrajectoryMetadata",
    "TrajectoryRecord",
    "TrajectoryWriter",
    "Turn",
    "apply_filters",
    "balance_filter",
    "completeness_filter",
    "duplicate_filter",
    "iter_batches",
    "read_table",
    "read_trajectories",
    "records_to_table",
    "reward_outlier_filter",
    "scan_store",
    "table_to_records",
    "zero_reward_group_filter",
]
