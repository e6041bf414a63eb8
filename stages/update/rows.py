"""The rows `update` holds: light columns whole, heavy ones only for this rank's micro-batches.

A rollout of 1152 samples × 1024 px latents is ~13 GB; under a launcher every rank used to read it
all to train on its 1/N. The trainer plans its micro-batches first (the plan depends only on the row
count, the train mask, the seed and, for DPO, the groups' rewards, all light columns) and then reads
the heavy columns (per-row tensors of two or more dimensions: latents, final latents, step means) for
the rows of its own slots only, one shard at a time (`ZippedShardSets.read_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from stages.score.scoring import failed_rewards
from stages.shards.reader import KEY_COLUMN, ZippedShardSets
from stages.shards.schema import Column

HEAVY_RANK = 2  # per-row tensor dimensions from which a column is read per rank


def is_heavy(column: Column) -> bool:
    """A tensor column whose rows are at least 2-D ([K+1, *latent] latents, [*latent] final latents; a
    latent is [C, h, w], or [C, F, h, w] for video)."""
    return column.kind == "tensor" and len(column.shape) >= HEAVY_RANK


class HeldRows:
    """A tensor column [N, *shape] of which only some rows are in memory.

    It answers `.shape` and `.dtype` for all N rows and is indexed like the tensor it stands for, with
    global row numbers as the first index (a LongTensor, a list or an int), e.g. `latents[index, j]`.
    Asking for a row that was not read is a programming error (the plan and the loop disagree).
    """

    def __init__(self, name: str, num_rows: int, shape: Sequence[int], dtype: torch.dtype) -> None:
        self.name = name
        self.shape = torch.Size((num_rows, *shape))
        self.dtype = dtype
        self._local = torch.full((num_rows,), -1, dtype=torch.int64)
        self.values = torch.empty((0, *shape), dtype=dtype)

    def hold(self, rows: Sequence[int], values: torch.Tensor) -> None:
        """Keep `values` [len(rows), *shape] as rows `rows` (ascending global row numbers)."""
        self._local.fill_(-1)
        self._local[torch.as_tensor(list(rows), dtype=torch.int64)] = torch.arange(len(rows))
        self.values = values

    @property
    def held(self) -> int:
        """How many rows are in memory."""
        return int(self.values.shape[0])

    def __getitem__(self, key: Any) -> torch.Tensor:
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        local = self._local[torch.as_tensor(first, dtype=torch.int64)]
        if bool((local < 0).any()):
            missing = torch.as_tensor(first, dtype=torch.int64).reshape(-1)[(local < 0).reshape(-1)]
            raise RuntimeError(f"column {self.name}: row {int(missing[0])} was not read by this rank")
        return self.values[(local, *rest)]


def trained_rows(data: Mapping[str, Any]) -> list[int]:
    """The rows `update` trains on, ascending: those `train_mask` keeps (`advantage --drop-zero-std`)
    whose reward did not fail (`failed_rewards`: flagged in reward_failed, or NaN). Every objective
    reads only these rows, so a failed reward gives no gradient, whether the loss uses its advantage
    or the reward itself (DPO's pairs)."""
    keep = ~failed_rewards(data, len(data["prompt"]))
    if "train_mask" in data:
        keep &= torch.as_tensor(data["train_mask"], dtype=torch.bool)
    return keep.nonzero().flatten().tolist()


def split_columns(inputs: ZippedShardSets, names: Sequence[str]) -> tuple[list[str], list[str]]:
    """`names` as (light, heavy): heavy ones are read per rank (`is_heavy`)."""
    heavy = [n for n in names if is_heavy(inputs.columns[n])]
    return [n for n in names if n not in heavy], heavy


def held_columns(
    inputs: ZippedShardSets, heavy: Sequence[str]
) -> tuple[dict[str, HeldRows], Callable[[list[int]], dict[str, torch.Tensor]]]:
    """Empty `HeldRows` for the `heavy` columns of `inputs`, and the function that fills them.

    The function takes the rows the trainer plans to touch, reads them (with their sample_id) and
    returns what it read, for the finiteness check.
    """
    held = {
        n: HeldRows(n, inputs.num_rows, inputs.columns[n].shape, inputs.columns[n].tensor_dtype.torch)
        for n in heavy
    }

    def load(rows: list[int]) -> dict[str, torch.Tensor]:
        rows = sorted(set(rows))
        batch = inputs.read_rows(rows, [*held, KEY_COLUMN]) if held else {}
        for name, column in held.items():
            column.hold(rows, batch[name])
        return batch

    return held, load
