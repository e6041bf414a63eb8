"""The Qwen3-Omni thinker through the staged commands on files: a verl table mixing text-only, image, audio
(two clips, one a WAV path at another sampling rate), image + audio and video (frames) rows goes through sample → score →
logprob → advantage → update (grpo, dapo, gspo); the replay matches the rollout to 1e-5 in every mode and
the update reports the routers' expert loads."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import fails, ins, run, torchrun
from PIL import Image

from stages.sample.vlm_audio import wav_bytes
from stages.score.text_rewards import verl_compute_score
from stages.shards.reader import ShardSet

N = 4
MAX_NEW = 8


@verl_compute_score
def vowel_share(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """A dense reward, so every group has a learning signal."""
    return sum(ch in "aeiou" for ch in solution_str.lower()) / max(1, len(solution_str))


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), colour).save(buf, format="PNG")
    return buf.getvalue()


def _clip(seconds: float, rate: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * rate)) * 0.1).astype(np.float32)


def omni_rows(folder: Path) -> list[dict]:
    (folder / "clips").mkdir()
    (folder / "clips" / "beep.wav").write_bytes(wav_bytes(_clip(0.4, 8000, 1), 8000))
    wav = {"bytes": wav_bytes(_clip(0.5, 16000, 2), 16000), "path": None}
    frames = [{"bytes": _png((40 * k, 90, 160)), "path": None} for k in range(3)]
    rows = [
        ("What is two plus two?", [], [], []),
        ("<image>What colour is it?", [{"bytes": _png((200, 30, 30)), "path": None}], [], []),
        ("<audio>Which is longer, this<audio>?", [], [wav, {"bytes": None, "path": "clips/beep.wav"}], []),
        ("Describe the picture and the sound.", [{"bytes": _png((30, 30, 200)), "path": None}], [wav], []),
        ("<video>What changes?", [], [], [frames]),
    ]
    return [
        {
            "data_source": "omni",
            "prompt": [{"role": "user", "content": text}],
            "images": images,
            "audios": audios,
            "videos": videos,
            "reward_model": {"style": "rule", "ground_truth": "4"},
            "extra_info": {"index": k},
        }
        for k, (text, images, audios, videos) in enumerate(rows)
    ]


@pytest.fixture(scope="module")
def omni_run(tmp_path_factory: pytest.TempPathFactory, tiny_omni: Path) -> dict:
    root = tmp_path_factory.mktemp("omni_run")
    data = root / "omni.parquet"
    pq.write_table(pa.Table.from_pylist(omni_rows(root)), data)
    paths = {name: root / name for name in ("samples", "rewards", "logprobs", "advantages")}
    common = ["--max-new-tokens", str(MAX_NEW), "--max-prompt-length", "96", "--batch-size", "8"]
    run(
        "sample",
        "--model",
        str(tiny_omni),
        "--prompts",
        str(data),
        "-n",
        str(N),
        *common,
        "--num-shards",
        "2",
        "--out",
        str(paths["samples"]),
    )
    run(
        "score",
        *ins(paths["samples"]),
        "--reward",
        "test_vlm_omni_stages:vowel_share",
        "--out",
        str(paths["rewards"]),
    )
    replay = run(
        "logprob",
        "--model",
        str(tiny_omni),
        *ins(paths["samples"]),
        "--reference",
        "--out",
        str(paths["logprobs"]),
    )
    run(
        "advantage",
        *ins(paths["samples"], paths["rewards"]),
        "--estimator",
        "grpo_verl",
        "--out",
        str(paths["advantages"]),
    )
    return {**paths, "data": data, "replay": replay, "root": root}


def test_every_input_mode_replays_its_rollout(omni_run: dict, tiny_omni: Path) -> None:
    from stages.models.vlm_families import load_processor

    tok = load_processor(tiny_omni).tokenizer
    rows = pq.read_table(omni_run["data"]).to_pylist()
    data = ShardSet(omni_run["samples"]).read_all()
    assert ShardSet(omni_run["samples"]).columns["audios"].kind == "audio_list"
    beep = (omni_run["root"] / "clips" / "beep.wav").read_bytes()
    video_pad = tok.convert_tokens_to_ids("<|video_pad|>")
    for i in range(len(rows) * N):
        k, member = divmod(i, N)
        want = [a["bytes"] if a["bytes"] is not None else beep for a in rows[k]["audios"]]
        assert data["audios"][i] == (want if member == 0 else [])  # once per prompt, the files as given
        ids = data["prompt_ids"][i][data["prompt_mask"][i]]
        assert int((ids == tok.audio_token_id).sum()) == [0, 0, 7 + 5, 7, 0][k]  # 0.5 s → 7, 0.4 s → 5 tokens
        assert int((ids == tok.image_token_id).sum()) == [0, 4, 0, 4, 0][k]  # 64² px → 2×2 tokens
        # 3 frames of 64² px → ⌈3/2⌉ temporal patches × 2×2 tokens
        assert int((ids == video_pad).sum()) == [0, 0, 0, 0, 2 * 4][k]
        want = [[f["bytes"] for f in v] for v in rows[k]["videos"]]
        assert data["videos"][i] == (want if member == 0 else [])
    assert data["prompt"][8] == "Which is longer, this?"
    assert omni_run["replay"]["abs_delta_max"] <= 1e-5
    lp = ShardSet(omni_run["logprobs"]).read_all()
    mask = data["response_mask"]
    per_row = (lp["old_log_probs"] - data["log_probs"]).abs().masked_fill(~mask, 0).amax(-1)
    assert float(per_row.max()) <= 1e-5 and torch.equal(lp["ref_log_probs"], lp["old_log_probs"])


@pytest.mark.parametrize("algo", ["grpo", "dapo", "gspo"])
def test_update_trains_the_thinker_and_reports_expert_loads(
    omni_run: dict, tiny_omni: Path, tmp_path: Path, algo: str
) -> None:
    out = tmp_path / "policy"
    args = [
        "--model",
        str(tiny_omni),
        *ins(omni_run["samples"], omni_run["logprobs"], omni_run["advantages"]),
    ]
    args += ["--algo", algo, "--lr", "1e-2", "--lora-rank", "4", "--micro-batch", "20", "--no-shuffle"]
    run("update", *args, "--router-aux-loss-coef", "0.01", "--out", str(out))
    (first,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert first["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # micro-batches other than sampling
    experts, top_k, layers = 4, 2, 2
    for i in range(layers):
        assert 0.0 < first[f"moe/load_entropy/layer{i}"] <= 1.0
        assert 1 / experts <= first[f"moe/max_load/layer{i}"] <= 1 / top_k
    assert first["moe/load_entropy"] == pytest.approx(
        np.mean([first[f"moe/load_entropy/layer{i}"] for i in range(layers)])
    )
    assert first["moe/aux_loss"] >= 1.0  # E·Σ f·P ≥ 1, with equality only when balanced
    after = run(
        "logprob",
        "--model",
        str(tiny_omni),
        "--adapter",
        str(out),
        *ins(omni_run["samples"]),
        "--out",
        str(tmp_path / "lp"),
    )
    assert after["abs_delta_max"] > 1e-4  # the adapter moved the policy
    data = ShardSet(omni_run["samples"]).read_all()
    new = ShardSet(tmp_path / "lp").read_all()["old_log_probs"]
    adv = ShardSet(omni_run["advantages"]).read_all()["advantages"][:, 0]
    delta = ((new - data["log_probs"]) * data["response_mask"]).sum(-1)
    assert float((adv * delta).sum()) > 0  # along the advantages


@pytest.mark.distributed
def test_two_ranks_equal_one_process(omni_run: dict, tiny_omni: Path, tmp_path: Path) -> None:
    """2 gloo ranks × 1 micro-batch = 1 process × 2 accumulated micro-batches on the MoE thinker with
    audio rows: same loss, gradient and adapter."""
    from safetensors.torch import load_file

    common = [
        "--model",
        str(tiny_omni),
        *ins(omni_run["samples"], omni_run["logprobs"], omni_run["advantages"]),
    ]
    common += ["--no-shuffle", "--micro-batch", "10", "--lora-rank", "4", "--lr", "1e-2", "--algo", "grpo"]
    run("update", *common, "--grad-accum", "2", "--out", str(tmp_path / "one"))
    torchrun("update", *common, "--grad-accum", "1", "--out", str(tmp_path / "two"))
    m1 = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert m2[0][key] == pytest.approx(m1[0][key], rel=1e-5, abs=1e-9)
    one = load_file(tmp_path / "one" / "adapter_model.safetensors")
    two = load_file(tmp_path / "two" / "adapter_model.safetensors")
    assert one.keys() == two.keys()
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6)


def test_sample_refuses_a_row_whose_audio_does_not_decode(tiny_omni: Path, tmp_path: Path) -> None:
    rows = omni_rows(tmp_path)
    rows[2]["audios"][1] = {"bytes": b"ID3 but no frames", "path": None}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    args = ["sample", "--model", str(tiny_omni), "--prompts", str(tmp_path / "bad.parquet"), "-n", "2"]
    fails([*args, "--out", str(tmp_path / "s")], "bad.parquet", "row 2", "does not decode")
    rows[2]["audios"] = rows[2]["audios"][:1]  # two <audio> placeholders, one clip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "short.parquet")
    args[4] = str(tmp_path / "short.parquet")
    fails(
        [*args, "--out", str(tmp_path / "s2")],
        "short.parquet",
        "row 2",
        "2 <audio> placeholders but column 'audios' holds 1 audios",
    )


def test_audio_key_names_another_column(tiny_omni: Path, tmp_path: Path) -> None:
    row = omni_rows(tmp_path)[3]
    row["sounds"] = row.pop("audios")
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "sounds.parquet")
    args = ["--model", str(tiny_omni), "--prompts", str(tmp_path / "sounds.parquet"), "-n", "1"]
    run("sample", *args, "--max-new-tokens", "2", "--audio-key", "sounds", "--out", str(tmp_path / "s"))
    assert ShardSet(tmp_path / "s").read_all()["audios"] == [[row["sounds"][0]["bytes"]]]


def test_thinker_video_processor_matches_its_image_processor_and_times_each_video(tiny_omni: Path) -> None:
    """The thinker's frames video processor (16-px patches): two equal frames give its image processor's
    pixel rows and grid exactly (a still image is a 2-frame video of itself), the prompt gets
    grid_t·h·w/4 video pads, and each video in a batch is timed by its own frame rate."""
    from stages.models.vlm import VLMPolicy
    from stages.models.vlm_families import load_processor

    processor = load_processor(tiny_omni)
    frame = Image.open(io.BytesIO(_png((120, 60, 10))))
    other = Image.open(io.BytesIO(_png((10, 60, 120))))
    image = processor.image_processor(images=[frame], return_tensors="pt")
    video = processor.video_processor([[frame, frame]], return_tensors="pt")
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert torch.equal(video["pixel_values_videos"], image["pixel_values"])
    policy = VLMPolicy.for_prompts(tiny_omni)
    messages = [
        [{"role": "user", "content": [{"type": "video", "fps": fps}, {"type": "text", "text": "?"}]}]
        for fps in (4.0, 2.0)
    ]
    inputs = policy.chat_inputs(messages, [[], []], videos=[[[frame, frame, other]], [[other, frame]]])
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 4], [1, 4, 4]]
    pads = (inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")).sum(-1)
    assert pads.tolist() == [2 * 4, 4]
    assert inputs["video_second_per_grid"].tolist() == [0.5, 1.0]  # temporal patch 2 / fps


def whole_qwen3_omni(thinker_dir: Path, out: Path) -> Path:
    """A whole `qwen3_omni_moe` folder (thinker + tiny talker + tiny code2wav, as the published
    checkpoints hold them) whose thinker has `thinker_dir`'s weights, with its processor."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from stages.models.vlm import VLMPolicy

    thinker = VLMPolicy.load(thinker_dir)
    layer = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "interleaved": True}
    moe = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16}
    codec = {"codec_pad_id": 58, "codec_bos_id": 59, "codec_eos_token_id": 60, "codec_nothink_id": 61}
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker.module.config.to_dict(),
        talker_config={
            "text_config": {
                **layer,
                **moe,
                "num_key_value_heads": 1,
                "head_dim": 16,
                "vocab_size": 64,
                "shared_expert_intermediate_size": 16,
                "rope_parameters": rope,
            },
            "code_predictor_config": {
                **layer,
                "num_key_value_heads": 1,
                "head_dim": 16,
                "vocab_size": 64,
                "num_code_groups": 2,
            },
            "num_code_groups": 2,
            "thinker_hidden_size": 64,
            "accept_hidden_layer": 1,
            "spatial_merge_size": 2,
            "codec_think_bos_id": 62,
            "codec_think_eos_id": 63,
            **codec,
        },
        code2wav_config={
            **layer,
            "num_key_value_heads": 2,
            "codebook_size": 64,
            "num_quantizers": 2,
            "upsample_rates": [2, 2],
            "upsampling_ratios": [2],
            "decoder_dim": 32,
            "sliding_window": 8,
        },
    )
    whole = Qwen3OmniMoeForConditionalGeneration(config)
    whole.thinker.load_state_dict(thinker.module.state_dict())
    whole.generation_config = thinker.module.generation_config
    assert sum(p.numel() for p in whole.talker.parameters()) > 0
    whole.save_pretrained(out)
    thinker.processor.save_pretrained(out)
    return out


def test_a_whole_qwen3_omni_folder_loads_as_its_thinker(
    omni_run: dict, tiny_omni: Path, tmp_path: Path
) -> None:
    """`--model` on a whole Qwen3-Omni folder (model_type qwen3_omni_moe) loads only its thinker: the
    same rollout as the thinker-only folder with the same weights, replayed to 1e-5."""
    from safetensors.torch import load_file

    from stages.models.vlm import VLMPolicy
    from stages.models.vlm_families import is_vlm_model

    whole = whole_qwen3_omni(tiny_omni, tmp_path / "whole")
    assert {k.split(".")[0] for k in load_file(whole / "model.safetensors")} == {
        "thinker",
        "talker",
        "code2wav",
    }
    assert is_vlm_model(whole)
    policy = VLMPolicy.load(whole)
    assert type(policy.module).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    assert not any(n.startswith(("talker", "code2wav")) for n, _ in policy.module.named_parameters())
    assert policy.stop_ids == VLMPolicy.load(tiny_omni).stop_ids
    args = ["--prompts", str(omni_run["data"]), "-n", "2", "--max-new-tokens", "4", "--batch-size", "8"]
    for name, model in (("a", tiny_omni), ("b", whole)):
        run("sample", "--model", str(model), *args, "--out", str(tmp_path / name))
    a, b = (ShardSet(tmp_path / name).read_all() for name in "ab")
    assert torch.equal(a["response_ids"], b["response_ids"]) and torch.equal(a["log_probs"], b["log_probs"])
    replay = run("logprob", "--model", str(whole), *ins(tmp_path / "b"), "--out", str(tmp_path / "lp"))
    assert replay["abs_delta_max"] <= 1e-5
