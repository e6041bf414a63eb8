"""NaN and ±inf stop every stage with one line naming the sample and the column (exit 2), and leave no
finished output: corrupt shard sets are rewritten through the project's own writer, so their manifests
are valid and only the values are wrong. A non-finite reward is the exception: advantage and update
take it as a failed reward (`failed_rewards`), left out like one `score --on-error zero` flags."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, fails, ins, run, sample_args
from transformers.utils import logging as transformers_logging

from stages.advantage.stage import compute_advantages
from stages.errors import NonFiniteError, UserInputError
from stages.finite import check_finite
from stages.shards.manifest import MANIFEST_NAME
from stages.shards.reader import ShardSet
from stages.shards.writer import ShardSetWriter

Change = Callable[[int, dict], dict]

# In this process transformers was imported before the CLI could silence its loading bars (a real
# `omnirl` process sets the variables first); turn them off so stderr holds only omnirl's own lines.
transformers_logging.disable_progress_bar()


def rewrite(src: Path, dst: Path, change: Change) -> None:
    """Copy the shard set `src` to `dst` through `ShardSetWriter`, shard s passed through change(s, batch).

    Command, config, lineage (the same parents), policy, column kinds and extra are kept.
    """
    source = ShardSet(src)
    m = source.manifest
    kinds = {c.name: c.kind for c in m.columns if c.kind not in ("tensor", "string")}
    writer = ShardSetWriter(
        dst,
        num_shards=source.num_shards,
        format=m.format,
        command=m.command,
        config=m.config,
        parents=[(src / p["path"]).resolve() for p in m.parents],
        policy=m.policy,
        kinds=kinds,
    )
    for s in range(source.num_shards):
        writer.write_shard(s, change(s, source.read_shard(s)))
    for stored in src.glob("conditioning-*.safetensors"):  # the prompt conditioning extra lists
        shutil.copy2(stored, dst / stored.name)
    writer.finalize(extra=m.extra)


def set_value(column: str, shard: int, row: int, value: object) -> Change:
    """A `rewrite` change that puts `value` into one element of `column` at (shard, row)."""

    def change(s: int, batch: dict) -> dict:
        if s == shard:
            values = batch[column].clone()
            values[row].view(-1)[-1] = value
            batch = {**batch, column: values}
        return batch

    return change


@pytest.fixture(scope="module")
def rollout(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-shard rollout of the tiny SD3 (3 prompts × 2) and its rewards."""
    root = tmp_path_factory.mktemp("nonfinite")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    p = {"samples": root / "samples", "rewards": root / "rewards", "prompts": prompts, "model": tiny_sd3}
    run(*sample_args(tiny_sd3, prompts, p["samples"], "--num-shards", "2"))
    run("score", "--in", str(p["samples"]), "--reward", "jpeg_compressibility", "--out", str(p["rewards"]))
    return p


@pytest.fixture(scope="module")
def nan_model(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny SD3 with one NaN in the transformer's output bias: every velocity is NaN (as an fp16
    overflow would make it)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("nan-model") / "sd3-nan"
    shutil.copytree(tiny_sd3, out)
    weights = out / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    state["proj_out.bias"][3] = math.nan
    save_file(state, weights)
    return out


def ids_of(path: Path, shard: int) -> list[str]:
    return list(ShardSet(path).read_shard(shard, ["sample_id"])["sample_id"])


def test_check_finite_names_the_first_bad_row_and_column() -> None:
    ids = ["a", "b", "c"]
    good = {"sample_id": ids, "x": torch.zeros(3, 2, 2), "n": torch.arange(3), "text": ["", "", ""]}
    check_finite(good, ids, hint="h")
    bad = torch.zeros(3, 2, 2)
    bad[2, 1, 0] = -math.inf
    bad[1, 0, 1] = math.nan
    with pytest.raises(NonFiniteError, match=r"^--in: x of sample 'b' is nan; fix it$"):
        check_finite({**good, "x": bad}, ids, hint="fix it", where="--in")
    with pytest.raises(NonFiniteError, match=r"^y of row 2 is -inf; h$"):
        check_finite({"y": torch.cat([torch.zeros(2, 2, 2), bad[2:]]).bfloat16()}, None, hint="h")
    check_finite({"empty": torch.zeros(0, 4)}, [], hint="h")


@pytest.mark.parametrize(
    ("column", "shard", "row"), [("latents", 1, 2), ("sigmas", 0, 1), ("log_probs", 1, 0)]
)
def test_logprob_stops_on_a_non_finite_stored_value(
    rollout: dict[str, Path], tmp_path: Path, column: str, shard: int, row: int
) -> None:
    corrupt, out = tmp_path / "samples", tmp_path / "logprobs"
    rewrite(rollout["samples"], corrupt, set_value(column, shard, row, math.nan))
    sample_id = ids_of(corrupt, shard)[row]
    line = fails(
        ["logprob", "--model", str(rollout["model"]), "--in", str(corrupt), "--out", str(out)],
        str(corrupt),
        column,
        repr(sample_id),
        "nan",
    )
    assert "sample it again" in line
    assert not (out / MANIFEST_NAME).exists()


def test_logprob_stops_on_non_finite_replayed_log_probs(
    rollout: dict[str, Path], nan_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "logprobs"
    first = ids_of(rollout["samples"], 0)[0]
    args = ["logprob", "--model", str(nan_model), "--in", str(rollout["samples"]), "--out", str(out)]
    line = fails([*args, "--means"], "logprob: old_log_probs", repr(first), "--adapter")
    assert "nan" in line
    assert not (out / MANIFEST_NAME).exists()


def test_sample_stops_on_non_finite_model_output(
    rollout: dict[str, Path], nan_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "samples"
    line = fails(sample_args(nan_model, rollout["prompts"], out), "sample: ", "g000000-000", "--dtype")
    assert any(f"{name} of sample" in line for name in ("final_latent", "latents", "log_probs"))
    assert not (out / MANIFEST_NAME).exists()


def test_advantage_leaves_out_a_non_finite_reward(rollout: dict[str, Path], tmp_path: Path) -> None:
    """A non-finite reward (written by another tool) is a failed reward, as one score flags: advantage
    0, flagged in reward_failed for update, counted."""
    rewards, out = tmp_path / "rewards", tmp_path / "advantages"
    rewrite(rollout["rewards"], rewards, set_value("reward", 1, 1, math.inf))
    sample_id = ids_of(rewards, 1)[1]
    result = run("advantage", *ins(rollout["samples"], rewards), "--out", str(out))
    assert result["reward_failed"] == 1
    written = ShardSet(out).read_all()
    row = written["sample_id"].index(sample_id)
    assert written["reward_failed"].nonzero().flatten().tolist() == [row]
    assert written["advantages"][row].eq(0).all()


def test_advantage_refuses_a_reward_column_of_strings(rollout: dict[str, Path], tmp_path: Path) -> None:
    rewards, out = tmp_path / "rewards", tmp_path / "advantages"

    def as_text(s: int, batch: dict) -> dict:
        return {**batch, "reward": [f"{v:.3f}" for v in batch["reward"].tolist()]}

    rewrite(rollout["rewards"], rewards, as_text)
    line = fails(
        ["advantage", *ins(rollout["samples"], rewards), "--out", str(out)], "column 'reward'", "str"
    )
    assert "omnirl score" in line
    assert not (out / MANIFEST_NAME).exists()


def test_compute_advantages_checks_columns_and_the_estimator_output(tmp_path: Path) -> None:
    ids, groups = ["s0", "s1", "s2", "s3"], ["a", "a", "b", "b"]
    data = {"sample_id": ids, "group_id": groups, "reward": torch.tensor([1.0, 2.0, 3.0, 5.0])}
    with pytest.raises(UserInputError, match=r"column 'reward' holds a \(2,\) tensor per sample"):
        compute_advantages({**data, "reward": torch.ones(4, 2)})
    bad = {**data, "reward.ocr": torch.tensor([0.0, math.nan, 1.0, 1.0])}  # s1 failed: a is left alone
    out, stats = compute_advantages(bad, weights={"ocr": 1.0})
    assert stats["reward_failed"] == 1 and out["advantages"][:2].eq(0).all()
    plugin = tmp_path / "broken_estimator.py"
    plugin.write_text(
        "import torch\n\n"
        "def estimate(rewards, group_ids, *, clip=None, sample_ids=None):\n"
        "    return torch.tensor([0.0, 0.0, float('inf'), 0.0])\n"
    )
    with pytest.raises(
        NonFiniteError, match=r"^advantages of sample 's2' is inf; --estimator .*fix the estimator"
    ):
        compute_advantages(data, estimator=f"{plugin}:estimate")


def test_update_names_the_sample_of_a_non_finite_advantage(rollout: dict[str, Path], tmp_path: Path) -> None:
    clean, corrupt, out = tmp_path / "advantages", tmp_path / "corrupt", tmp_path / "policy"
    run("advantage", *ins(rollout["samples"], rollout["rewards"]), "--out", str(clean))
    rewrite(clean, corrupt, set_value("advantages", 1, 0, math.nan))
    sample_id = ids_of(corrupt, 1)[0]
    args = ["update", "--model", str(rollout["model"]), *ins(rollout["samples"], corrupt), "--out", str(out)]
    fails(args, "--in: advantages", repr(sample_id), "nan")
    assert not out.exists()
