"""`sample`, `score`, `encode` and `logprob` under mixed precision (issue 12: a launcher setting takes
effect or is refused, never ignored).

ACCELERATE_MIXED_PRECISION (what `accelerate launch --mixed_precision bf16` sets) runs the model forwards
under bf16 autocast exactly as `--mixed-precision bf16` does, the setting enters each output's identity,
and `logprob` replays a bf16 rollout under bf16 by default, so the rollout log-probs reproduce exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import test_online
import test_vlm_stages
import torch
from helpers import PROMPTS, fails, online_args, run, sample_args

from stages.models.clip import build_tiny_clip
from stages.models.diffusion import FlowPolicy
from stages.models.vlm import VLMPolicy
from stages.shards.manifest import read_manifest
from stages.shards.reader import ShardSet

LAUNCHER = "ACCELERATE_MIXED_PRECISION"


def _data_files(out: Path) -> dict[str, bytes]:
    """Every shard file's bytes by name (the manifest, which records when it was written, left out)."""
    manifest = read_manifest(out)
    names = [p for p in sorted(out.rglob("*")) if p.is_file() and "manifest" not in p.name]
    assert names and manifest.config is not None
    return {str(p.relative_to(out)): p.read_bytes() for p in names}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mp") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def rollouts(tiny_sd3: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same rollout three ways: fp32, under the launcher's bf16, and with --mixed-precision bf16."""
    root = tmp_path_factory.mktemp("rollouts")
    out = {name: root / name for name in ("fp32", "launcher", "explicit")}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(LAUNCHER, raising=False)
        run(*sample_args(tiny_sd3, prompts, out["fp32"]))
        run(*sample_args(tiny_sd3, prompts, out["explicit"], "--mixed-precision", "bf16"))
        mp.setenv(LAUNCHER, "bf16")
        run(*sample_args(tiny_sd3, prompts, out["launcher"]))
    return out


def test_the_launchers_bf16_samples_as_the_option_does_and_not_as_fp32(rollouts: dict[str, Path]) -> None:
    launched, explicit, fp32 = (_data_files(rollouts[k]) for k in ("launcher", "explicit", "fp32"))
    assert launched == explicit  # byte for byte
    assert launched.keys() == fp32.keys() and launched != fp32
    for name in ("launcher", "explicit"):
        manifest = read_manifest(rollouts[name])
        assert manifest.config["mixed_precision"] == "bf16"
        assert manifest.extra["sample_config"]["mixed_precision"] == "bf16"
    assert read_manifest(rollouts["fp32"]).config["mixed_precision"] == "no"
    bf16 = ShardSet(rollouts["launcher"]).read_all(["log_probs"])["log_probs"]
    full = ShardSet(rollouts["fp32"]).read_all(["log_probs"])["log_probs"]
    assert not torch.equal(bf16, full) and torch.isfinite(bf16).all()


def test_sample_runs_the_transformer_under_bf16_autocast(
    tiny_sd3: Path, prompts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []
    velocity = FlowPolicy.velocity

    def recording(self: FlowPolicy, *args: Any) -> torch.Tensor:
        kind = self.device.type
        seen.append(torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None)
        return velocity(self, *args)

    monkeypatch.setattr(FlowPolicy, "velocity", recording)
    monkeypatch.setenv(LAUNCHER, "bf16")
    run(*sample_args(tiny_sd3, prompts, tmp_path / "s", "--num-prompts", "1"))
    assert seen and set(seen) == {torch.bfloat16}


def test_logprob_replays_a_bf16_rollout_exactly_by_default(
    tiny_sd3: Path, rollouts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(LAUNCHER, raising=False)
    model = ["--model", str(tiny_sd3), "--in", str(rollouts["explicit"])]
    same = run("logprob", *model, "--out", str(tmp_path / "same"))
    assert same["abs_delta_max"] == 0.0 and same["abs_delta_mean"] == 0.0
    assert read_manifest(tmp_path / "same").config["mixed_precision"] == "bf16"
    # replaying in fp32 instead shows what the default avoids
    fp32 = run("logprob", *model, "--mixed-precision", "no", "--out", str(tmp_path / "fp32"))
    assert fp32["abs_delta_max"] > 0.0
    # the launcher's setting still wins over the rollout's
    monkeypatch.setenv(LAUNCHER, "no")
    launched = run("logprob", *model, "--out", str(tmp_path / "launched"))
    assert launched["abs_delta_max"] == fp32["abs_delta_max"]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("clip") / "clip-tiny"
    build_tiny_clip(out, seed=0)
    return out


def test_score_runs_a_clip_reward_under_the_launchers_bf16(
    tiny_clip: Path, rollouts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["score", "--in", str(rollouts["fp32"]), "--reward", "clipscore"]
    args += ["--reward-arg", f"clipscore.model={tiny_clip}"]
    monkeypatch.delenv(LAUNCHER, raising=False)
    run(*args, "--out", str(tmp_path / "fp32"))
    monkeypatch.setenv(LAUNCHER, "bf16")
    run(*args, "--out", str(tmp_path / "bf16"))
    assert read_manifest(tmp_path / "bf16").config["mixed_precision"] == "bf16"
    assert read_manifest(tmp_path / "fp32").config["mixed_precision"] == "no"
    bf16 = ShardSet(tmp_path / "bf16").read_all(["reward"])["reward"]
    fp32 = ShardSet(tmp_path / "fp32").read_all(["reward"])["reward"]
    assert not torch.equal(bf16, fp32)  # the CLIP forward ran in bf16 ...
    torch.testing.assert_close(bf16, fp32, rtol=0.05, atol=0.01)  # ... and still scores the same images
    # a reward that is no torch model computes as before; the setting is recorded
    jpeg = ["score", "--in", str(rollouts["fp32"]), "--reward", "jpeg_compressibility"]
    run(*jpeg, "--out", str(tmp_path / "j"))
    assert read_manifest(tmp_path / "j").config["mixed_precision"] == "bf16"


def test_encode_runs_the_vae_under_the_launchers_bf16(
    tiny_sd3: Path, rollouts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["encode", "--model", str(tiny_sd3), "--in", str(rollouts["fp32"]), "--resolution", "32"]
    monkeypatch.delenv(LAUNCHER, raising=False)
    run(*args, "--out", str(tmp_path / "fp32"))
    run(*args, "--mixed-precision", "bf16", "--out", str(tmp_path / "explicit"))
    monkeypatch.setenv(LAUNCHER, "bf16")
    run(*args, "--out", str(tmp_path / "bf16"))
    assert read_manifest(tmp_path / "bf16").config["mixed_precision"] == "bf16"
    assert _data_files(tmp_path / "bf16") == _data_files(tmp_path / "explicit")
    bf16 = ShardSet(tmp_path / "bf16").read_all(["final_latent"])["final_latent"]
    fp32 = ShardSet(tmp_path / "fp32").read_all(["final_latent"])["final_latent"]
    assert bf16.dtype == fp32.dtype == torch.float32 and not torch.equal(bf16, fp32)
    torch.testing.assert_close(bf16, fp32, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("command", ["sample", "score", "encode"])
def test_a_mixed_precision_the_stages_cannot_run_is_refused_in_one_line(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LAUNCHER, "fp8")
    args = {
        "sample": ["--model", str(tmp_path), "--prompts", str(tmp_path / "p.txt")],
        "score": ["--in", str(tmp_path / "x"), "--reward", "jpeg_compressibility"],
        "encode": ["--model", str(tmp_path), "--in", str(tmp_path / "x")],
    }[command]
    fails([command, *args, "--out", str(tmp_path / "o")], "--mixed-precision fp8", "no, bf16, fp16")


def test_online_samples_under_the_launchers_bf16_as_sample_does(
    staged: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stages.online.pipeline import RUN_FILE

    preset = tmp_path / "preset.yaml"
    preset.write_text(test_online.PRESET)
    monkeypatch.setenv(LAUNCHER, "bf16")
    out = tmp_path / "online"
    run(
        *online_args(
            preset,
            staged,
            out,
            "--reward",
            "jpeg_compressibility",
            "--iterations",
            "1",
            "--save-trajectories",
        )
    )
    monkeypatch.delenv(LAUNCHER)
    sampled = tmp_path / "sampled"
    model = ["--model", str(staged["model"]), "--prompts", str(staged["prompts"])]
    run("sample", "--config", str(preset), *model, "--mixed-precision", "bf16", "--out", str(sampled))
    online = ShardSet(out / "it0" / "samples").read_all(["latents", "log_probs"])
    staged_bf16 = ShardSet(sampled).read_all(["latents", "log_probs"])
    assert torch.equal(online["latents"], staged_bf16["latents"])
    assert torch.equal(online["log_probs"], staged_bf16["log_probs"])
    identity = json.loads((out / RUN_FILE).read_text())["settings"]
    assert identity["sample"]["mixed_precision"] == identity["update"]["mixed_precision"] == "bf16"


def test_a_vlm_rollout_generates_and_replays_under_the_launchers_bf16(
    tiny_vlm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []
    generate = VLMPolicy.generate

    def recording(self: VLMPolicy, *args: Any, **kwargs: Any) -> Any:
        kind = self.device.type
        seen.append(torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(VLMPolicy, "generate", recording)
    data = tmp_path / "dots.parquet"
    pq.write_table(pa.Table.from_pylist(test_vlm_stages.fix_placeholders(test_vlm_stages.verl_rows())), data)
    monkeypatch.setenv(LAUNCHER, "bf16")
    samples = tmp_path / "samples"
    args = ["--model", str(tiny_vlm), "--prompts", str(data), "-n", "2", "--max-new-tokens", "6"]
    run("sample", *args, "--max-prompt-length", "96", "--out", str(samples))
    assert seen and set(seen) == {torch.bfloat16}
    assert read_manifest(samples).extra["vlm_sample_config"]["mixed_precision"] == "bf16"
    monkeypatch.delenv(LAUNCHER)  # logprob then replays under the rollout's bf16
    replay = run("logprob", "--model", str(tiny_vlm), "--in", str(samples), "--out", str(tmp_path / "lp"))
    assert read_manifest(tmp_path / "lp").config["mixed_precision"] == "bf16"
    assert 0 <= replay["abs_delta_max"] < 0.1  # generate's cached decoding vs one forward, both in bf16


def test_a_rollout_servers_request_carries_the_mixed_precision_and_refuses_an_unknown_one() -> None:
    from stages.sample.rollout import SampleConfig
    from stages.sample.rollout_protocol import ProtocolError, decode_request, encode_request, refuse_settings

    cfg = SampleConfig(mixed_precision="bf16", resolution=512)
    body = encode_request("r", cfg, ["p"], [""], [1], [2], [0], ["s0"], {})
    assert decode_request(body, max_samples=4).cfg.mixed_precision == "bf16"  # the server autocasts as asked
    body["sampling_params"]["mixed_precision"] = "fp8"
    with pytest.raises(ProtocolError, match="--mixed-precision fp8"):
        refuse_settings(decode_request(body, max_samples=4).cfg)
