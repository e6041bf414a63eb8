"""Shared fixtures: tiny offline models and small shard sets, built once per test session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from pathlib import Path

import pytest
import torch

# Tiny models run several times faster single-threaded on a shared 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD3 pipeline folder (seed 0), loadable with `from_pretrained`."""
    from stages.models.factory import init_model

    out = tmp_path_factory.mktemp("models") / "sd3-tiny"
    init_model("sd3", out, size="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_shard_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-row, 2-shard Parquet shard set with a tensor, a scalar, strings and JSON."""
    from stages.shards.writer import ShardSetWriter

    out = tmp_path_factory.mktemp("shards") / "set"
    writer = ShardSetWriter(out, num_shards=2, command="test", config={"k": 1}, kinds={"meta": "json"})
    for s in range(2):
        ids = [f"g{s}-{i}" for i in range(3)]
        writer.write_shard(
            s,
            {
                "sample_id": ids,
                "group_id": [f"g{s}"] * 3,
                "reward": torch.arange(3, dtype=torch.float32) + s,
                "latents": torch.ones(3, 2, 4, 4) * s,
                "meta": [{"i": i} for i in range(3)],
            },
        )
    writer.finalize()
    return out
