"""vLLM-Omni RL mode for real (`make test-gpu`): `omnirl sample --engine vllm-omni` without --server-url
runs `Omni` with omnirl's custom pipeline (stages/sample/vllm_omni_pipeline.py) on the accelerator; the
trajectories it returns replay under `omnirl logprob` with ratio 1 and equal the diffusers engine's.

Skipped unless vllm-omni (the `vllm-omni` extra, with a matching vllm) is installed and an accelerator is
present: vLLM-Omni has no CPU platform.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers import run

from stages.shards.reader import ShardSet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm_omni") is None or not torch.accelerator.is_available(),
        reason="needs vllm-omni (pip install 'omnirl[vllm-omni]') and an accelerator",
    ),
]

PROMPTS = ["a red circle", "two blue squares", "a sign that says omnirl"]
SAMPLING = ("-n", "4", "--steps", "8", "--resolution", "256", "--guidance", "4.5", "--batch-size", "4")
WINDOW = ("--sde-window", "2", "--sde-window-range", "0", "6")


def test_rl_mode_trajectories_replay_with_ratio_one_and_equal_the_diffusers_ones(tmp_path: Path) -> None:
    model, prompts = tmp_path / "model", tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    run("init-model", "--family", "sd3", "--size", "small", "--seed", "0", str(model))
    common = ("--model", str(model), "--prompts", str(prompts), *SAMPLING, *WINDOW)
    run("sample", *common, "--engine", "vllm-omni", "--out", str(tmp_path / "omni"))
    run("sample", *common, "--out", str(tmp_path / "local"))
    engine = json.loads((tmp_path / "omni" / "_manifest.json").read_text())["extra"]["engine"]
    assert engine["name"] == "vllm-omni" and engine["mode"] == "rl"
    omni, local = ShardSet(tmp_path / "omni").read_all(), ShardSet(tmp_path / "local").read_all()
    assert omni["latents"].shape == local["latents"].shape and omni["latents"].dtype == torch.float32
    gap = float((omni["log_probs"] - local["log_probs"]).abs().max())
    print(f"\n[gpu] vllm-omni RL mode vs diffusers engine: max |Δ rollout log-prob| {gap:.3g}")
    replay = run(
        "logprob", "--model", str(model), "--in", str(tmp_path / "omni"), "--out", str(tmp_path / "lp")
    )
    assert replay["abs_delta_max"] <= 1e-6, replay
