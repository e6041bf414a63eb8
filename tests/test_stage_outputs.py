"""The library side of the stage commands, called without the CLI: `stages.outputs.map_shards` (resume,
progress), `stages.shards.describe.head_rows` (`inspect --head`), `stages.installation` (`env`) and
`stages.sample.engines.check_engine_options` (`sample`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


class Recorder:
    """A progress display that records its tasks' totals and how far each advanced."""

    def __init__(self) -> None:
        self.tasks: list[dict[str, Any]] = []

    def add_task(self, label: str, total: float | None = None, **fields: Any) -> int:
        self.tasks.append({"label": label, "total": total, "done": 0})
        return len(self.tasks) - 1

    def advance(self, task: int, n: float = 1) -> None:
        self.tasks[task]["done"] += n


def test_map_shards_skips_a_finished_shard_and_advances_over_every_row(
    tiny_shard_set: Path, tmp_path: Path
) -> None:
    from stages.outputs import finalize, map_shards, open_inputs
    from stages.shards.reader import ShardSet
    from stages.shards.writer import ShardSetWriter

    src = open_inputs([tiny_shard_set])
    writer = ShardSetWriter(
        tmp_path / "out", num_shards=2, command="test", config={}, parents=[tiny_shard_set]
    )
    writer.write_shard(0, {"sample_id": ["g0-0", "g0-1", "g0-2"], "twice": torch.full((3,), -1.0)})
    seen: list[list[str]] = []

    def twice(shard: dict, advance: Any) -> dict:
        seen.append(list(shard["sample_id"]))
        advance(len(shard["sample_id"]))
        return {"sample_id": shard["sample_id"], "twice": shard["reward"] * 2}

    display = Recorder()
    written = map_shards(src, writer, "doubling", ["sample_id", "reward"], twice, display=display)
    assert written == [1] and seen == [["g1-0", "g1-1", "g1-2"]]  # shard 0 was done: resumed, not redone
    assert display.tasks == [{"label": "doubling", "total": 6, "done": 6}]
    assert finalize(writer)
    assert ShardSet(tmp_path / "out").read_all()["twice"].tolist() == [-1, -1, -1, 2, 4, 6]


def test_head_rows_shows_each_column_short(tiny_shard_set: Path) -> None:
    from stages.shards.describe import head_rows, short_number
    from stages.shards.reader import ShardSet

    rows = head_rows(ShardSet(tiny_shard_set), 2)
    assert rows[1] == {
        "sample_id": "g0-1", "group_id": "g0", "reward": "1", "latents": "[2×4×4]", "meta": "{'i': 1}"
    }  # fmt: skip
    assert head_rows(ShardSet(tiny_shard_set), 0) == []
    assert [short_number(x) for x in (0.1234567, 3.0, 2e6, 7)] == ["0.12346", "3", "2e+06", "7"]


def test_installation_environment_keeps_run_variables_and_redacts_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from stages.installation import environment

    monkeypatch.setenv("OMNIRL_API_TOKEN", "s3cret")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("CUSTOM_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    found = environment()
    assert found["OMNIRL_API_TOKEN"] == "<redacted>" and found["HF_HUB_OFFLINE"] == "1"
    assert found["CUSTOM_VISIBLE_DEVICES"] == "0,1" and "UNRELATED_VARIABLE" not in found


@pytest.mark.parametrize(
    ("engine", "changes", "option", "needle"),
    [
        ("remote", {"vae_tiling": True}, "--vae-tiling", "decodes elsewhere"),
        ("remote", {"defer_decode": True}, "--defer-decode", "returns decoded media"),
        ("diffusers", {"defer_decode": True, "vae_slicing": True}, "--vae-slicing", "pass --vae-slicing to"),
        ("remote", {"sp_degree": 2}, "--sp-degree", "runs its model elsewhere"),
        ("remote", {"compile": True}, "--compile", "runs its model elsewhere"),
    ],
)
def test_options_only_the_in_process_engine_honours_are_refused(
    engine: str, changes: dict[str, Any], option: str, needle: str
) -> None:
    from dataclasses import replace

    from stages.errors import UserInputError
    from stages.models.kernels import Kernels
    from stages.parallelism import ModelParallel
    from stages.sample.config import SampleConfig
    from stages.sample.engines import check_engine_options, engine_class

    c = replace(SampleConfig(), **changes)
    parallel = ModelParallel(sp_degree=c.sp_degree, sp_kind=c.sp_kind, tp_degree=c.tp_degree)
    kernels = Kernels(attention_backend=c.attention_backend, compile=c.compile)
    with pytest.raises(UserInputError, match=needle) as refused:
        check_engine_options(c, engine_class(engine), parallel, kernels)
    assert option in str(refused.value).split(":")[0]  # the line names the option to drop
    check_engine_options(
        replace(c, engine="diffusers", defer_decode=False), engine_class("diffusers"), parallel, kernels
    )
