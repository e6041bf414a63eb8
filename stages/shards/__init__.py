"""Shard sets: directories of Parquet or WebDataset shards with a manifest written last.

See DESIGN.md "Shard sets". Write with `ShardSetWriter`, read with `ShardSet` or, for several
column groups of one rollout, `open_inputs`.
"""

from stages.shards.describe import describe
from stages.shards.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    Manifest,
    ShardInfo,
    config_hash,
    read_manifest,
)
from stages.shards.reader import ShardSet, ZippedShardSets, concat_batches, open_inputs, slice_batch
from stages.shards.schema import KINDS, Batch, Column, batch_num_rows, infer_columns
from stages.shards.writer import ShardSetWriter

__all__ = [
    "KINDS",
    "MANIFEST_NAME",
    "SCHEMA_VERSION",
    "Batch",
    "Column",
    "Manifest",
    "ShardInfo",
    "ShardSet",
    "ShardSetWriter",
    "ZippedShardSets",
    "batch_num_rows",
    "concat_batches",
    "config_hash",
    "describe",
    "infer_columns",
    "open_inputs",
    "read_manifest",
    "slice_batch",
]
