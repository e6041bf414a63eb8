"""Deferred media: `sample --defer-decode` runs no VAE decode and stores final latents only; `score`
decodes them to the pixels `sample` would have stored (rewards equal bit for bit), `--keep-media`
stores them; `online --media-every N` stores media only every N-th iteration; `report` and `inspect`
take sets without media."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, fails, ins, online_args, run, runner, sample_args
from test_online import PRESET

from omnirl_cli.app import app
from stages.media.deferred import DEFERRED, LatentDecoder
from stages.media.video import decode_mp4
from stages.models.diffusion import FlowPolicy
from stages.shards import ShardSet, read_manifest


def refuse_decode(self: FlowPolicy, x0: torch.Tensor) -> list:
    raise AssertionError("sample --defer-decode ran the VAE decode")


@pytest.fixture(scope="module")
def deferred(staged: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The staged fixture's rollout sampled again with --defer-decode (the same seeds and sharding), from
    a copy of its model (a test moves it away), with FlowPolicy.decode refusing to run."""
    root = tmp_path_factory.mktemp("deferred")
    model = root / "model"
    shutil.copytree(staged["model"], model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FlowPolicy, "decode", refuse_decode)
        run(*sample_args(model, staged["prompts"], root / "samples", "--num-shards", "2", "--defer-decode"))
    return {**staged, "deferred": root / "samples", "copy": model, "root": root}


def test_a_deferred_rollout_stores_final_latents_and_records_its_decode(deferred: dict[str, Path]) -> None:
    samples = ShardSet(deferred["deferred"])
    assert "image" not in samples.columns and "final_latent" in samples.columns
    extra = read_manifest(samples.path).extra
    assert extra[DEFERRED] == {"model": str(deferred["copy"].resolve()), "dtype": "fp32"}
    assert extra["modality"] == "image" and extra["family"] == "sd3"
    # the trajectory is the decoded rollout's, sample for sample
    mine = samples.read_all(["final_latent", "latents", "log_probs", "seed"])
    theirs = ShardSet(deferred["samples"]).read_all(["final_latent", "latents", "log_probs", "seed"])
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


def test_stages_after_sample_take_a_deferred_rollout(deferred: dict[str, Path], tmp_path: Path) -> None:
    run(
        "logprob",
        "--model",
        str(deferred["model"]),
        "--in",
        str(deferred["deferred"]),
        "--out",
        str(tmp_path / "lp"),
    )
    mine = ShardSet(tmp_path / "lp").read_all(["old_log_probs"])["old_log_probs"]
    assert torch.equal(mine, ShardSet(deferred["logprobs"]).read_all(["old_log_probs"])["old_log_probs"])


def test_score_decodes_in_the_rollouts_batches_to_equal_rewards(
    deferred: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[int] = []
    decode = LatentDecoder._decode

    def counted(self: LatentDecoder, latents: torch.Tensor) -> list:
        decoded.append(len(latents))
        return decode(self, latents)

    monkeypatch.setattr(LatentDecoder, "_decode", counted)
    out = tmp_path / "rewards"
    # scoring batches of 2 cut across the rollout's batches of 3 (shards of 2 and 4 rows)
    args = ["--reward", "jpeg_compressibility", "--batch-size", "2", "--keep-media", "--out", str(out)]
    run("score", "--in", str(deferred["deferred"]), *args)
    assert decoded == [2, 3, 1]  # every rollout batch decoded once, as sampled: [2] | [3, 1]
    mine, theirs = ShardSet(out).read_all(), ShardSet(deferred["rewards"]).read_all()
    assert torch.equal(mine["reward"], theirs["reward"])
    assert torch.equal(mine["reward.jpeg_compressibility"], theirs["reward.jpeg_compressibility"])
    # the kept PNGs are byte for byte the ones the decoded rollout stored
    assert mine["image"] == ShardSet(deferred["samples"]).read_all(["image"])["image"]
    assert ShardSet(out).columns["image"].kind == "image"


def test_deferred_media_misuse_is_one_line(deferred: dict[str, Path], tmp_path: Path) -> None:
    samples, model, prompts = deferred["samples"], deferred["model"], deferred["prompts"]
    out = str(tmp_path / "out")
    reward = ["--reward", "jpeg_compressibility", "--out", out]
    fails(["score", "--in", str(samples), "--keep-media", *reward], "--keep-media", "stores its media")
    # a preset's top-level model: key reaches score too: ignored (and no part of the identity) there
    again = run("score", "--in", str(samples), "--model", str(model), "--vae-tiling", *reward)
    assert again["reward/mean"] == run("score", "--in", str(samples), *reward)["reward/mean"]
    assert read_manifest(tmp_path / "out").config["model"] is None
    fails(
        sample_args(model, prompts, tmp_path / "s", "--defer-decode", "--vae-slicing"),
        "--vae-slicing",
        "score",
    )
    remote = ("--defer-decode", "--engine", "remote", "--server-url", "http://127.0.0.1:9")
    fails(sample_args(model, prompts, tmp_path / "s", *remote), "--defer-decode", "remote")
    away = deferred["root"] / "moved"
    deferred_out = ["--reward", "jpeg_compressibility", "--out", str(tmp_path / "deferred_rewards")]
    deferred["copy"].rename(away)
    try:
        fails(
            ["score", "--in", str(deferred["deferred"]), *deferred_out],
            "--model",
            str(deferred["copy"].resolve()),
        )
        run("score", "--in", str(deferred["deferred"]), "--model", str(model), *deferred_out)
    finally:
        away.rename(deferred["copy"])


def test_inspect_names_deferred_media(deferred: dict[str, Path]) -> None:
    result = runner.invoke(app, ["inspect", str(deferred["deferred"])])
    assert result.exit_code == 0, result.output
    assert "media: deferred" in result.stdout and str(deferred["copy"].resolve()) in result.stdout


# --- video ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Wan 2.1 rollouts of the same seeds, each scored with jpeg_compressibility@frames=mean: one
    with lossless frames, one deferred as run/it0/samples (scored with --keep-media into run/it0/rewards)."""
    root = tmp_path_factory.mktemp("wan-deferred")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    model = root / "wan"
    run("init-model", "--family", "wan2_1", "--size", "tiny", str(model))
    video = ("--frames", "5", "--steps", "3")
    it0 = root / "run" / "it0"
    run(*sample_args(model, prompts, root / "frames", *video, "--save-frames"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FlowPolicy, "decode", refuse_decode)
        run(*sample_args(model, prompts, it0 / "samples", *video, "--defer-decode"))
    reward = ("--reward", "jpeg_compressibility@frames=mean")
    run("score", "--in", str(root / "frames"), *reward, "--out", str(root / "frames_rewards"))
    keep = ("--batch-size", "4", "--keep-media", "--out", str(it0 / "rewards"))
    run("score", "--in", str(it0 / "samples"), *reward, *keep)
    return {"root": root, "run": root / "run", "it0": it0}


def test_a_deferred_video_scores_as_its_lossless_frames(wan: dict[str, Path]) -> None:
    samples = wan["it0"] / "samples"
    assert read_manifest(samples).extra["modality"] == "video" and "video" not in ShardSet(samples).columns
    mine = ShardSet(wan["it0"] / "rewards").read_all()
    assert torch.equal(
        mine["reward"], ShardSet(wan["root"] / "frames_rewards").read_all(["reward"])["reward"]
    )
    clips = [decode_mp4(blob) for blob in mine["video"]]
    assert [(len(c.frames), c.fps, c.frames[0].size) for c in clips] == [(5, 16.0, (32, 32))] * 6
    # an image reward on a deferred video is refused before any decode
    out = str(wan["root"] / "x")
    fails(
        ["score", "--in", str(samples), "--reward", "jpeg_compressibility", "--out", out],
        "--reward jpeg_compressibility",
        "@frames=",
    )


def test_report_draws_kept_media_and_names_iterations_without_any(wan: dict[str, Path]) -> None:
    run_dir, it1 = wan["run"], wan["run"] / "it1"
    shutil.copytree(wan["it0"] / "samples", it1 / "samples")
    reward = ("--reward", "jpeg_compressibility@frames=first")
    run("score", "--in", str(it1 / "samples"), *reward, "--out", str(it1 / "rewards"))
    result = run("report", str(run_dir))
    assert result["grids"] == [str(run_dir / "it0" / "grid.png")]
    assert result["previews"] == [str(run_dir / "it0" / "preview.gif")]
    assert result["no_media"] == [1] and not (it1 / "grid.png").exists()
    plain = runner.invoke(app, ["report", str(run_dir)])
    assert plain.exit_code == 0 and "it1: no grid" in plain.stderr and "--keep-media" in plain.stderr


# --- online -----------------------------------------------------------------------------------------


def test_online_stores_media_every_n_th_iteration_and_the_last(
    staged: dict[str, Path], tmp_path: Path
) -> None:
    preset = tmp_path / "preset.yaml"
    preset.write_text(PRESET)
    out = tmp_path / "run"
    args = online_args(preset, staged, out, "--reward", "jpeg_compressibility", "--iterations", "4")
    fails([*args, "--media-every", "2"], "--media-every", "--save-trajectories")
    run(*args, "--save-trajectories", "--media-every", "2")
    stored = {k: "image" in ShardSet(out / f"it{k}" / "samples").columns for k in range(4)}
    assert stored == {0: True, 1: False, 2: True, 3: True}  # 0, 2 and the last
    extra = read_manifest(out / "it1" / "samples").extra
    assert extra[DEFERRED] == {"model": str(Path(staged["model"]).resolve()), "dtype": "fp32"}
    assert extra["modality"] == "image" and DEFERRED not in read_manifest(out / "it2" / "samples").extra
    # the iteration without media scores from its latents to the rewards online computed in memory
    rescored = tmp_path / "rescored"
    run("score", *ins(out / "it1" / "samples"), "--reward", "jpeg_compressibility", "--out", str(rescored))
    assert torch.equal(
        ShardSet(rescored).read_all(["reward"])["reward"],
        ShardSet(out / "it1" / "rewards").read_all(["reward"])["reward"],
    )
