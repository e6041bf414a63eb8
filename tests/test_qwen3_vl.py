"""Qwen3-VL, dense and MoE, through the staged commands on every VLM input mode (text only, one image, several images,
video as frames and as an MP4 file, mixed), as tests/test_vlm_modes.py runs Qwen2.5-VL: the rollout's
image and video pad tokens (16-px patches, 2x2 merge; each video frame pair behind its timestamp),
the replay of each mode's log-probs by `logprob` within 1e-5, padded and packed, and a LoRA update on the language model
with the vision tower frozen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ins, run
from test_vlm_modes import MAX_NEW, MODES, N, by_mode, write_rows

from stages.shards.reader import ShardSet


@pytest.fixture(scope="module", params=["tiny_qwen3_vl", "tiny_qwen3_vl_moe"])
def qwen3_vl_run(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Path]:
    tiny_qwen3_vl = request.getfixturevalue(request.param)
    root = tmp_path_factory.mktemp("qwen3_vl")
    data, _, _ = write_rows(root)
    names = ("samples", "rewards", "logprobs", "packed", "advantages", "policy")
    paths = {name: root / name for name in names}
    paths["model"] = tiny_qwen3_vl
    model = ["--model", str(tiny_qwen3_vl)]
    run(
        "sample",
        *model,
        *("--prompts", str(data), "-n", str(N), "--max-new-tokens", str(MAX_NEW)),
        *("--max-prompt-length", "128", "--batch-size", str(4 * N), "--out", str(paths["samples"])),
    )
    run("score", *ins(paths["samples"]), "--reward", "omnirl_length", "--out", str(paths["rewards"]))
    paths["replay"] = run("logprob", *model, *ins(paths["samples"]), "--out", str(paths["logprobs"]))
    paths["packed_replay"] = run(
        "logprob", *model, *ins(paths["samples"]), "--packing", "on", "--out", str(paths["packed"])
    )
    run("advantage", *ins(paths["samples"], paths["rewards"]), "--out", str(paths["advantages"]))
    paths["update"] = run(
        "update",
        *model,
        *ins(paths["samples"], paths["logprobs"], paths["advantages"]),
        *("--lora-rank", "4", "--lr", "1e-2", "--micro-batch", "16", "--no-shuffle", "--algo", "grpo"),
        *("--out", str(paths["policy"])),
    )
    return paths


def test_every_mode_is_sampled_with_its_pad_tokens_and_replays_within_1e5(
    qwen3_vl_run: dict[str, Path],
) -> None:
    from stages.models.qwen3_vl import load_processor

    data = ShardSet(qwen3_vl_run["samples"]).read_all()
    old = ShardSet(qwen3_vl_run["logprobs"]).read_all()["old_log_probs"]
    packed = ShardSet(qwen3_vl_run["packed"]).read_all()["old_log_probs"]
    rows = by_mode(data)
    assert sorted(rows) == sorted(MODES)
    tok = load_processor(qwen3_vl_run["model"]).tokenizer
    image_pad, video_pad, start = tok.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>"]
    )
    # 56 px → 64 (2×2 merged patches of 32 px), 84 → 96 (3×3); 4 frames → 2 temporal patches of 2×2,
    # each its own <|vision_start|> span behind a timestamp (plus the video part's own marker)
    pads = {
        "image": (4, 0, 1),
        "images": (13, 0, 2),
        "frames": (0, 8, 3),
        "mp4": (0, 8, 3),
        "mixed": (4, 8, 4),
    }
    for mode, members in rows.items():
        ids = data["prompt_ids"][members[0]][data["prompt_mask"][members[0]]]
        counts = tuple(int((ids == t).sum()) for t in (image_pad, video_pad, start))
        assert counts == pads.get(mode, (0, 0, 0)), mode
        if mode in ("frames", "mp4"):
            assert "<0.2 seconds>" in tok.decode(ids) and "<1.2 seconds>" in tok.decode(ids)
        valid = data["response_mask"][members]
        for replayed in (old, packed):
            delta = (replayed[members] - data["log_probs"][members]).abs()[valid]
            assert delta.numel() > 0 and float(delta.max()) < 1e-5, mode
    assert qwen3_vl_run["replay"]["abs_delta_max"] < 1e-5
    assert qwen3_vl_run["packed_replay"]["abs_delta_max"] < 1e-5


def test_update_trains_a_language_model_lora_with_the_vision_tower_frozen(
    qwen3_vl_run: dict[str, Path],
) -> None:
    from safetensors.torch import load_file

    metrics = json.loads((qwen3_vl_run["policy"] / "metrics.jsonl").read_text())
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: replay == rollout
    assert metrics["actor/grad_norm"] > 0
    weights = load_file(qwen3_vl_run["policy"] / "adapter_model.safetensors")
    assert weights and all("language_model" in k and "visual" not in k for k in weights)
    assert max(float(weights[k].abs().max()) for k in weights if "lora_B" in k) > 1e-4
