"""The staged Flow-GRPO chain on the tiny SD3 model, through the real CLI and real files.

Invariants: the same seed gives bit-identical samples; replaying a rollout under its own weights
reproduces the rollout log-probs exactly; the ODE sampler reproduces diffusers' own pipeline; the
written adapter loads in diffusers and gives the policy's images; a second update resumes the first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, ins, run, runner, sample_args

from omnirl_cli.app import app
from stages.shards.reader import ShardSet


def test_samples_follow_the_trajectory_schema(staged: dict[str, Path]) -> None:
    s = ShardSet(staged["samples"])
    assert s.num_rows == 6 and s.num_shards == 2
    cols = s.columns
    assert cols["latents"].shape == (5, 16, 8, 8)  # K+1 stored latents, 4 SDE steps at 32 px
    assert (
        cols["log_probs"].shape == (4,) and cols["sigmas"].shape == (5,) and cols["timesteps"].shape == (4,)
    )
    assert cols["final_latent"].shape == (16, 8, 8)
    data = s.read_all()
    rollout = data["group_id"][0][:8]  # the rollout id prefixes every id
    assert data["group_id"] == [f"{rollout}-g00000{k}" for k in (0, 0, 1, 1, 2, 2)]
    assert len(set(data["sample_id"])) == 6
    # the last stored latent of an all-SDE rollout is the final latent
    assert torch.equal(data["latents"][:, -1], data["final_latent"])
    assert torch.allclose(data["timesteps"], data["sigmas"][:, :-1] * 1000)
    assert data["image"][0][:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_reproduces_rollout_log_probs_exactly(staged: dict[str, Path]) -> None:
    rollout = ShardSet(staged["samples"]).read_all(columns=["log_probs"])["log_probs"]
    replay = ShardSet(staged["logprobs"]).read_all(columns=["old_log_probs"])["old_log_probs"]
    assert torch.equal(rollout, replay)
    manifest = ShardSet(staged["logprobs"]).manifest
    assert manifest.extra["abs_delta_max"] == 0.0


def test_same_seed_same_bytes_and_batch_size_does_not_change_a_sample(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    again = tmp_path / "again"
    run(*sample_args(staged["model"], staged["prompts"], again, "--batch-size", "2"))
    a = ShardSet(staged["samples"]).read_all()
    b = ShardSet(again).read_all()
    local = [[i.split("-", 1)[1] for i in ids] for ids in (a["sample_id"], b["sample_id"])]
    assert local[0] == local[1] and a["seed"].tolist() == b["seed"].tolist()
    torch.testing.assert_close(a["latents"], b["latents"], rtol=0, atol=1e-5)
    other = tmp_path / "other-seed"
    run(*sample_args(staged["model"], staged["prompts"], other, "--seed", "7"))
    assert not torch.allclose(ShardSet(other).read_all()["final_latent"], a["final_latent"])


@pytest.mark.parametrize(("height", "width"), [(32, 32), (32, 64)])
def test_ode_rollout_matches_the_diffusers_pipeline(tiny_sd3: Path, height: int, width: int) -> None:
    from diffusers import StableDiffusion3Pipeline

    from stages.models.diffusion import FlowPolicy
    from stages.sample.rollout import SampleConfig, rollout_batch

    policy = FlowPolicy.load(tiny_sd3)
    cfg = SampleConfig(steps=5, guidance=3.0, resolution=f"{height}x{width}", sampler="ode", batch_size=2)
    ours = rollout_batch(
        policy, cfg, PROMPTS[:2], ["", ""], [1, 2], [1, 2], groups=[0, 1], sample_ids=["a", "b"]
    )
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    pipe.set_progress_bar_config(disable=True)
    x_t = policy.initial_noise([1, 2], (height, width))
    assert x_t.shape[-1] * height == x_t.shape[-2] * width  # the latent grid keeps the aspect
    theirs = pipe(
        PROMPTS[:2],
        latents=x_t,
        num_inference_steps=5,
        guidance_scale=3.0,
        height=height,
        width=width,
        output_type="latent",
        max_sequence_length=128,
    ).images
    torch.testing.assert_close(ours["final_latent"], theirs.float(), rtol=1e-5, atol=1e-5)
    assert "log_probs" not in ours


def test_advantages_are_group_normalised_with_global_std(staged: dict[str, Path]) -> None:
    from stages.shards.reader import open_inputs

    data = open_inputs([staged["samples"], staged["rewards"], staged["advantages"]]).read_all(
        columns=["group_id", "reward", "advantages"]
    )
    r = data["reward"].double()
    std = r.std(unbiased=False)
    for g in set(data["group_id"]):
        idx = [i for i, x in enumerate(data["group_id"]) if x == g]
        expected = (r[idx] - r[idx].mean()) / (std + 1e-4)
        torch.testing.assert_close(data["advantages"][idx, 0].double(), expected, rtol=1e-5, atol=1e-6)
    assert data["advantages"].shape == (6, 4)


def test_update_writes_a_diffusers_loadable_adapter_and_resumes(staged: dict[str, Path]) -> None:
    from diffusers import StableDiffusion3Pipeline

    from stages.models.diffusion import FlowPolicy
    from stages.update.trainer import load_state

    cfg1 = json.loads((staged["policy1"] / "omnirl_adapter.json").read_text())
    cfg2 = json.loads((staged["policy2"] / "omnirl_adapter.json").read_text())
    assert cfg1["kind"] == "lora" and cfg1["step"] == 2  # 6 samples in micro-batches of 3
    assert cfg2["step"] == 4 and cfg2["parent_adapter"] == str(staged["policy1"])
    metrics = [json.loads(line) for line in (staged["policy1"] / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for key in (
        "actor/pg_loss",
        "actor/ratio_mean",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/grad_norm",
        "actor/lr",
    ):
        assert key in metrics[0]
    # on-policy, the first micro-batch replays the rollout exactly
    assert metrics[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    state1, step1 = load_state(staged["policy1"])
    assert step1 == 2 and state1["optimizer"]["state"] and state1["ema"] is None
    policy = FlowPolicy.load(staged["model"], adapter=staged["policy1"])
    assert policy.lora
    pipe = StableDiffusion3Pipeline.from_pretrained(staged["model"])
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(staged["policy1"]))
    x_t = policy.initial_noise([3], 32)
    ours = policy.pipe(
        ["a red apple"],
        latents=x_t,
        num_inference_steps=3,
        guidance_scale=1.0,
        height=32,
        width=32,
        output_type="latent",
    ).images
    theirs = pipe(
        ["a red apple"],
        latents=x_t,
        num_inference_steps=3,
        guidance_scale=1.0,
        height=32,
        width=32,
        output_type="latent",
    ).images
    torch.testing.assert_close(ours, theirs)
    base = (
        FlowPolicy.load(staged["model"])
        .pipe(
            ["a red apple"],
            latents=x_t,
            num_inference_steps=3,
            guidance_scale=1.0,
            height=32,
            width=32,
            output_type="latent",
        )
        .images
    )
    assert not torch.equal(base, ours)  # the adapter changed the policy


def test_rerun_is_a_no_op_and_inspect_shows_lineage(staged: dict[str, Path]) -> None:
    before = (staged["rewards"] / "_manifest.json").read_bytes()
    out = run(
        "score",
        "--in",
        str(staged["samples"]),
        "--reward",
        "jpeg_compressibility",
        "--out",
        str(staged["rewards"]),
    )
    assert out["rows"] == 6
    assert (staged["rewards"] / "_manifest.json").read_bytes() == before
    info = run("inspect", str(staged["advantages"]))
    parents = [p["path"] for p in info["lineage"]]
    assert any(p.endswith("samples") for p in parents) and any(p.endswith("rewards") for p in parents)


def test_bad_inputs_exit_2_with_one_line(staged: dict[str, Path], tmp_path: Path) -> None:
    result = runner.invoke(app, ["advantage", "--in", str(staged["samples"]), "--out", str(tmp_path / "a")])
    assert result.exit_code == 2 and "reward" in result.output
    result = runner.invoke(
        app,
        ["score", "--in", str(staged["samples"]), "--reward", "no_such_reward", "--out", str(tmp_path / "r")],
    )
    assert result.exit_code == 2 and "no_such_reward" in result.output
    result = runner.invoke(
        app,
        [
            "sample",
            "--model",
            str(tmp_path),
            "--prompts",
            str(staged["prompts"]),
            "--out",
            str(tmp_path / "s"),
        ],
    )
    assert result.exit_code == 2 and "model_index.json" in result.output
    result = runner.invoke(
        app, [*sample_args(staged["model"], staged["prompts"], tmp_path / "s2"), "--sampler", "magic"]
    )
    assert result.exit_code == 2 and "--sampler magic" in result.output


def test_nan_reward_is_reported_not_trained_on(staged: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    plugin = tmp_path / "nan_reward_plugin.py"
    plugin.write_text("def score(images, prompts, meta):\n    return [float('nan')] * len(images)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = runner.invoke(
        app,
        [
            "score",
            "--in",
            str(staged["samples"]),
            "--reward",
            "nan_reward_plugin:score",
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert result.exit_code == 2
    assert "g000000-000" in result.output
    assert not (tmp_path / "r" / "_manifest.json").exists()


FLAKY_REWARD = """
def score(images, prompts, meta):
    # fails the first 'a red apple' of each batch and every 'a blue sky': 3 of the 6 staged samples
    seen, out = set(), []
    for prompt in prompts:
        failed = prompt == "a blue sky" or (prompt == "a red apple" and prompt not in seen)
        seen.add(prompt)
        out.append(None if failed else 0.25 + 0.5 * len(out))
    return out
"""


def test_failed_rewards_are_counted_and_never_trained_on(
    staged: dict[str, Path], tmp_path: Path, monkeypatch
) -> None:
    """score --on-error zero → advantage → update: each stage counts the 3 failed rows (--json and
    manifest); advantage gives them 0 and the apple group (one scored sample left) 0; update reads only
    the 3 scored rows."""
    from helpers import staged_update_args

    from stages.shards.manifest import read_manifest

    (tmp_path / "flaky_reward_plugin.py").write_text(FLAKY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards, advantages = tmp_path / "rewards", tmp_path / "advantages"
    scored = run(
        "score", "--in", str(staged["samples"]), "--reward", "flaky_reward_plugin:score", "--on-error", "zero",
        "--out", str(rewards),
    )  # fmt: skip
    data = open_inputs_all([staged["samples"], rewards], ["prompt", "reward", "reward_failed"])
    failed = data["reward_failed"]
    assert int(failed.sum()) == 3 and scored["reward_failed"] == 3
    assert read_manifest(rewards).extra["reward_failed"] == 3
    assert scored["reward/mean"] == pytest.approx(float(data["reward"][~failed].mean()))  # not the stored 0s

    adv = run("advantage", *ins(staged["samples"], rewards), "--out", str(advantages))
    assert adv["reward_failed"] == 3 and read_manifest(advantages).extra["stats"]["reward_failed"] == 3
    out = open_inputs_all([staged["samples"], advantages], ["prompt", "advantages", "reward_failed"])
    assert out["reward_failed"].tolist() == failed.tolist()
    moved = [p == 'a sign that says "hello"' for p in out["prompt"]]
    assert out["advantages"][~torch.tensor(moved)].eq(0).all()  # failed rows and the lone apple
    assert out["advantages"][torch.tensor(moved)].abs().min() > 0.5

    policy = tmp_path / "policy"
    args = staged_update_args(staged, policy, "--no-shuffle")
    args[args.index(str(staged["advantages"]))] = str(advantages)
    result = run(*args)
    assert result["reward_failed"] == 3 and result["rows_read"] == 3  # the failed rows are not even read
    assert json.loads((policy / "omnirl_adapter.json").read_text())["reward_failed"] == 3


def open_inputs_all(paths: list[Path], columns: list[str]) -> dict:
    from stages.shards.reader import open_inputs

    return open_inputs(paths).read_all(columns=columns)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_kl_to_the_frozen_reference_starts_at_zero_then_grows(
    staged: dict[str, Path], tmp_path: Path, mode: str
) -> None:
    inputs = [
        *ins(staged["samples"], staged["logprobs"], staged["advantages"]),
    ]
    extra = ["--full"] if mode == "full" else ["--lora-rank", "4", "--lora-alpha", "8"]
    run(
        "update",
        "--model",
        str(staged["model"]),
        *inputs,
        "--beta",
        "0.04",
        "--lr",
        "1e-2",
        "--no-shuffle",
        *extra,
        "--out",
        str(tmp_path / "p"),
    )
    metrics = [json.loads(line) for line in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["actor/kl_loss"] == 0.0  # policy == reference before the first optimizer step
    assert metrics[1]["actor/kl_loss"] > 0.0
    kind = json.loads((tmp_path / "p" / "omnirl_adapter.json").read_text())["kind"]
    assert kind == mode


def test_logprob_reference_means(staged: dict[str, Path], tmp_path: Path) -> None:
    run(
        "logprob",
        "--model",
        str(staged["model"]),
        "--adapter",
        str(staged["policy1"]),
        "--in",
        str(staged["samples"]),
        "--reference",
        "--out",
        str(tmp_path / "lp"),
    )
    data = ShardSet(tmp_path / "lp").read_all()
    assert data["ref_means"].shape == (6, 4, 16, 8, 8)
    # under the trained adapter the replayed log-probs move away from the rollout's
    rollout = ShardSet(staged["samples"]).read_all(columns=["log_probs"])["log_probs"]
    assert not torch.equal(data["old_log_probs"], rollout)


def test_stored_reference_means_give_the_same_kl_as_recomputing(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    """`update` reads ref_means from `logprob --reference` instead of a second forward: same numbers."""
    run(
        "logprob",
        "--model",
        str(staged["model"]),
        "--in",
        str(staged["samples"]),
        "--reference",
        "--out",
        str(tmp_path / "lp"),
    )
    common = [
        "update",
        "--model",
        str(staged["model"]),
        *ins(staged["samples"], staged["advantages"]),
        "--beta",
        "0.04",
        "--lr",
        "1e-2",
        "--no-shuffle",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
    ]
    run(*common, "--in", str(staged["logprobs"]), "--out", str(tmp_path / "recomputed"))
    run(*common, "--in", str(tmp_path / "lp"), "--out", str(tmp_path / "stored"))
    a = [json.loads(x) for x in (tmp_path / "recomputed" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "stored" / "metrics.jsonl").read_text().splitlines()]
    assert a[1]["actor/kl_loss"] > 0
    for x, y in zip(a, b, strict=True):
        assert y["actor/kl_loss"] == pytest.approx(x["actor/kl_loss"], rel=1e-5, abs=1e-12)


def test_every_stage_reads_and_writes_webdataset(staged: dict[str, Path], tmp_path: Path) -> None:
    """The same chain with WebDataset shards: same rollout bytes, same rewards as the Parquet run."""
    wds = {name: tmp_path / name for name in ("samples", "rewards", "logprobs", "advantages", "policy")}
    run(
        *sample_args(
            staged["model"], staged["prompts"], wds["samples"], "--num-shards", "2", "--format", "webdataset"
        )
    )
    assert sorted(p.name for p in wds["samples"].glob("train-*")) == [
        "train-00000-of-00002.tar",
        "train-00001-of-00002.tar",
    ]
    run(
        "score",
        "--in",
        str(wds["samples"]),
        "--reward",
        "jpeg_compressibility",
        "--format",
        "webdataset",
        "--out",
        str(wds["rewards"]),
    )
    run(
        "logprob", "--model", str(staged["model"]), "--in", str(wds["samples"]), "--out", str(wds["logprobs"])
    )
    run("advantage", *ins(wds["samples"], wds["rewards"]), "--out", str(wds["advantages"]))
    run(
        "update",
        "--model",
        str(staged["model"]),
        *ins(wds["samples"], wds["logprobs"], wds["advantages"]),
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--out",
        str(wds["policy"]),
    )
    parquet = ShardSet(staged["samples"]).read_all()
    tar = ShardSet(wds["samples"]).read_all()
    assert torch.equal(parquet["latents"], tar["latents"]) and parquet["image"] == tar["image"]
    assert torch.equal(
        ShardSet(staged["rewards"]).read_all()["reward"], ShardSet(wds["rewards"]).read_all()["reward"]
    )
    assert torch.equal(ShardSet(wds["logprobs"]).read_all()["old_log_probs"], tar["log_probs"])
