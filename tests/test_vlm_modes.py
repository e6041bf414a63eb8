"""Every VLM input mode through the staged commands on the tiny Qwen2.5-VL: text-only rows (no media
column, a null or an empty list), one image, several images, video as a list of frames and as an MP4
file, all in one rollout whose generate calls mix text-only and media rows. Each mode is checked for
what the rollout stores (media once per group, byte for byte; the prompt's pad tokens) and for the
replay of its log-probs by `logprob` and `update` (|Δ| ≤ 1e-5 against the rollout).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ins, run, torchrun
from PIL import Image

from stages.score.text_rewards import verl_compute_score
from stages.shards.reader import ShardSet

N = 2
MAX_NEW = 6
MODES = ("text", "text_null", "text_empty", "image", "images", "frames", "mp4", "mixed")


@verl_compute_score
def letter_share(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """A dense reward (share of letters), so every group has a learning signal."""
    return sum(ch.isalpha() for ch in solution_str) / max(1, len(solution_str))


def png(seed: int, size: int = 56) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def mp4(frames: int = 8, rate: int = 4, size: int = 56) -> bytes:
    """An MPEG-4 file of `frames` solid colours at `rate` frames per second (2 s by default)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for k in range(frames):
            image = Image.new("RGB", (size, size), (15 * k, 255 - 15 * k, 128))
            for packet in stream.encode(av.VideoFrame.from_image(image)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def write_rows(root: Path) -> tuple[Path, dict[str, list[bytes]], dict[str, list[list[bytes]]]]:
    """A verl JSONL table with one row per mode (media as files beside it, named by path) and the
    image and frame files of each mode; the text row has no media keys at all."""
    frames = [png(10 + k) for k in range(4)]
    images = {"image": [png(1)], "images": [png(2), png(3, size=84)], "mixed": [png(4)]}
    videos = {"frames": [frames], "mixed": [frames[:3]]}
    spec = {
        "text": "What is two plus two?",
        "text_null": "Name a colour.",
        "text_empty": "Say hi.",
        "image": "<image>What is shown?",
        "images": "Compare <image> with <image>.",
        "frames": "<video>What happens?",
        "mp4": "What moves in <video>?",
        "mixed": "<image> then <video>: same?",
    }
    (root / "clip.mp4").write_bytes(mp4())
    lines = []
    for k, (mode, prompt) in enumerate(spec.items()):
        row: dict = {
            "data_source": mode,
            "prompt": [{"role": "user", "content": prompt}],
            "reward_model": {"style": "rule", "ground_truth": "4"},
            "extra_info": {"index": k},
        }
        names = []
        for i, blob in enumerate(images.get(mode, [])):
            names.append(f"{mode}-{i}.png")
            (root / names[-1]).write_bytes(blob)
        clips = []
        for i, video in enumerate(videos.get(mode, [])):
            clips.append([])
            for j, blob in enumerate(video):
                clips[-1].append(f"{mode}-v{i}-{j}.png")
                (root / clips[-1][-1]).write_bytes(blob)
        if mode == "mp4":
            clips = ["clip.mp4"]
        if mode == "text_null":
            row["images"] = row["videos"] = None
        elif mode != "text":
            row["images"], row["videos"] = names, clips
        lines.append(json.dumps(row))
    (root / "modes.jsonl").write_text("\n".join(lines) + "\n")
    return root / "modes.jsonl", images, videos


@pytest.fixture(scope="module")
def modes_run(tmp_path_factory: pytest.TempPathFactory, tiny_vlm: Path) -> dict[str, Path]:
    """One staged iteration over every mode, 4 prompts per generate call, so text-only and media rows
    share calls."""
    root = tmp_path_factory.mktemp("modes")
    data, _, _ = write_rows(root)
    paths = {name: root / name for name in ("samples", "rewards", "logprobs", "advantages", "policy")}
    paths["data"] = data
    paths["sample"] = run(
        "sample",
        "--model",
        str(tiny_vlm),
        "--prompts",
        str(data),
        "-n",
        str(N),
        "--max-new-tokens",
        str(MAX_NEW),
        "--max-prompt-length",
        "96",
        "--batch-size",
        str(4 * N),
        "--out",
        str(paths["samples"]),
    )
    paths["score"] = run(
        "score",
        *ins(paths["samples"]),
        "--reward",
        "test_vlm_modes:letter_share",
        "--reward",
        "format_think_answer",
        "--reward",
        "omnirl_length=0.1",
        "--out",
        str(paths["rewards"]),
    )
    paths["replay"] = run(
        "logprob", "--model", str(tiny_vlm), *ins(paths["samples"]), "--out", str(paths["logprobs"])
    )
    run("advantage", *ins(paths["samples"], paths["rewards"]), "--out", str(paths["advantages"]))
    paths["update"] = run(
        "update",
        "--model",
        str(tiny_vlm),
        *ins(paths["samples"], paths["logprobs"], paths["advantages"]),
        "--lora-rank",
        "4",
        "--lr",
        "1e-2",
        "--micro-batch",
        "16",
        "--no-shuffle",
        "--algo",
        "grpo",
        "--out",
        str(paths["policy"]),
    )
    return paths


def by_mode(data: dict) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, meta in enumerate(data["prompt_meta"]):
        out.setdefault(meta["data_source"], []).append(i)
    return out


def test_rollout_stores_each_modes_media_once_per_group(modes_run: dict[str, Path], tiny_vlm: Path) -> None:
    from stages.models.qwen2_5_vl import load_processor

    _, images, videos = write_rows(modes_run["data"].parent)
    data = ShardSet(modes_run["samples"]).read_all()
    rows = by_mode(data)
    assert sorted(rows) == sorted(MODES) and all(len(r) == N for r in rows.values())
    tok = load_processor(tiny_vlm).tokenizer
    image_pad, video_pad = tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    # 56² px → 2×2 merged patches, 84² → 3×3; frames: ⌈T/2⌉ temporal patches × 2×2
    pads = {
        "image": (4, 0),
        "images": (4 + 9, 0),
        "frames": (0, 2 * 4),
        "mp4": (0, 2 * 4),
        "mixed": (4, 2 * 4),
    }
    for mode, members in rows.items():
        for m, i in enumerate(members):
            lead = m == 0
            assert data["images"][i] == (images.get(mode, []) if lead else [])
            if mode == "mp4":
                stored = data["videos"][i]
                assert (len(stored), len(stored[0]) if lead else 0) == ((1, 4) if lead else (0, 0))
            else:
                assert data["videos"][i] == (videos.get(mode, []) if lead else [])
            ids = data["prompt_ids"][i][data["prompt_mask"][i]]
            assert (int((ids == image_pad).sum()), int((ids == video_pad).sum())) == pads.get(mode, (0, 0))
        video_parts = [p for m in data["messages"][members[0]] for p in m["content"] if isinstance(p, dict)]
        fps = [p["fps"] for p in video_parts if p.get("type") == "video"]
        # frames default to 2 per second; the 8-frame 4 fps file keeps 4 frames: 4/8 · 4 = 2
        assert fps == ([2.0] if mode in ("frames", "mp4", "mixed") else [])
    # the text-only rows' messages stay plain strings, as verl keeps a row without media
    assert data["messages"][rows["text"][0]] == [{"role": "user", "content": "What is two plus two?"}]
    head = run("inspect", str(modes_run["samples"]), "--head", str(len(data["sample_id"])))["head"]
    lead = rows["frames"][0]
    size = sum(map(len, videos["frames"][0]))
    assert head[lead]["videos"] == f"<1 videos 4 frames {size} B>"
    assert head[lead + 1]["videos"] == "<0 videos 0 frames 0 B>"


def test_every_mode_replays_within_1e5(modes_run: dict[str, Path], tiny_vlm: Path) -> None:
    """`logprob` (sampling batches) and one forward over all rows at once, as an `update` micro-batch
    mixing every mode builds it, both give each mode's rollout log-probs back to 1e-5."""
    from stages.models.vlm import VLMPolicy
    from stages.sample.vlm_stage import prompt_inputs, response_batch, row_media, row_prompts

    assert modes_run["replay"]["abs_delta_max"] < 1e-5
    data = ShardSet(modes_run["samples"]).read_all()
    old = ShardSet(modes_run["logprobs"]).read_all()["old_log_probs"]
    policy = VLMPolicy.load(tiny_vlm)
    inputs = prompt_inputs(
        policy, row_prompts(data), row_media(data, "s"), data["prompt_ids"], data["prompt_mask"], "s"
    )
    tokens, mask = response_batch(data, policy.device)
    with torch.no_grad():
        mixed = policy.response_log_probs(inputs, tokens, mask)
    width = tokens.shape[1]
    for mode, members in by_mode(data).items():
        index = torch.tensor(members)
        valid = data["response_mask"][index]
        delta = (old[index] - data["log_probs"][index]).abs()[valid]
        assert delta.numel() > 0 and float(delta.max()) < 1e-5, mode
        together = (mixed[index] - data["log_probs"][index, :width]).abs()[mask[index]]
        assert float(together.max()) < 1e-5, mode


def test_update_replays_the_rollout_and_trains(modes_run: dict[str, Path]) -> None:
    metrics = [json.loads(x) for x in (modes_run["policy"] / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    assert metrics[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: replay == rollout
    assert metrics[0]["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics[0]["actor/grad_norm"] > 0


def test_truncated_responses_are_flagged_counted_and_get_format_zero(
    modes_run: dict[str, Path], tiny_vlm: Path
) -> None:
    """A response is truncated when it fills --max-new-tokens without a stop token (<|im_end|>,
    <|endoftext|>): the rollout flags it, score counts it and format_think_answer gives it 0."""
    from stages.models.qwen2_5_vl import load_processor
    from stages.score.text_rewards import omnirl_length_value

    tok = load_processor(tiny_vlm).tokenizer
    stops = torch.tensor(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    data = ShardSet(modes_run["samples"]).read_all()
    rewards = ShardSet(modes_run["rewards"]).read_all()
    length = data["response_length"]
    last = data["response_ids"].gather(1, (length - 1)[:, None])[:, 0]
    expected = (length == MAX_NEW) & ~torch.isin(last, stops)
    assert torch.equal(data["truncated"], expected)
    assert modes_run["score"]["truncated"] == int(expected.sum()) > 0
    assert (rewards["reward.format_think_answer"][expected] == 0).all()
    for i, text in enumerate(data["response_text"]):
        marks = sum(ch in ",.;!" for ch in text)
        value = omnirl_length_value(len(text), marks)
        assert rewards["reward.omnirl_length"][i].item() == pytest.approx(value, rel=1e-6, abs=1e-7)


@pytest.mark.distributed
def test_two_ranks_equal_one_process_on_a_mixed_batch(
    modes_run: dict[str, Path], tiny_vlm: Path, tmp_path: Path
) -> None:
    """torchrun with 2 gloo ranks × 1 micro-batch = 1 process × 2 accumulated micro-batches on the
    rollout that mixes text-only, image and video rows: same loss, gradient norm and weights."""
    from safetensors.torch import load_file

    common = [
        "--model",
        str(tiny_vlm),
        *ins(modes_run["samples"], modes_run["logprobs"], modes_run["advantages"]),
    ]
    common += ["--no-shuffle", "--micro-batch", "8", "--lora-rank", "4", "--lr", "1e-2", "--algo", "grpo"]
    run("update", *common, "--grad-accum", "2", "--out", str(tmp_path / "one"))
    torchrun("update", *common, "--grad-accum", "1", "--out", str(tmp_path / "two"))
    m1 = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [1]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ratio_mean"):
        assert m2[0][key] == pytest.approx(m1[0][key], rel=1e-5, abs=1e-9)
    one = load_file(tmp_path / "one" / "adapter_model.safetensors")
    two = load_file(tmp_path / "two" / "adapter_model.safetensors")
    assert one.keys() == two.keys()
    assert max(float(one[k].abs().max()) for k in one if "lora_B" in k) > 1e-4
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6)


def test_video_files_are_sampled_at_2_fps_and_bad_files_name_the_row(tmp_path: Path) -> None:
    """8 frames at 4 fps (2 s) → 2 s · 2 fps = 4 frames at indices round(k·7/3) = 0, 2, 5, 7, rate 2;
    16 frames at 4 fps → 8 frames; 2 frames → the minimum of 4 is capped at the file's 2."""
    from stages.errors import UserInputError
    from stages.sample.vlm_data import decode_video_file, video_frames

    frames, rate = decode_video_file(mp4(), "row 0")
    assert rate == 2.0 and len(frames) == 4
    reds = [np.asarray(Image.open(io.BytesIO(f)))[..., 0].mean() for f in frames]
    assert np.allclose(reds, [0, 30, 75, 105], atol=8)  # frame k is (15k, 255 − 15k, 128), lossy
    assert len(decode_video_file(mp4(frames=16), "r")[0]) == 8
    assert decode_video_file(mp4(frames=2), "r")[1] == 4.0  # both frames kept: 2/2 · 4 fps
    (tmp_path / "clip.mp4").write_bytes(mp4(frames=16))  # 4 s at 1 fps: frames 0, 5, 10, 15
    by_path, rate = video_frames({"video": "clip.mp4", "fps": 1.0}, tmp_path, "r")
    reds = [np.asarray(Image.open(io.BytesIO(f)))[..., 0].mean() for f in by_path]
    assert rate == 1.0 and np.allclose(reds, [0, 75, 150, 225], atol=8)
    listed = video_frames({"video": [png(1), png(2)], "fps": 3}, tmp_path, "r")
    assert listed == ([png(1), png(2)], 3.0)
    with pytest.raises(
        UserInputError,
        match=r"^data\.jsonl: row 3: a video file: not a readable video file \(.+\); or give the video as a list of frames$",
    ):
        decode_video_file(b"not a video", "data.jsonl: row 3")
    with pytest.raises(UserInputError, match="a video is an empty list of frames"):
        video_frames([], tmp_path, "r")


def test_frames_video_processor_lays_patches_out_as_the_image_processor(tiny_vlm: Path) -> None:
    """A still image is a 2-frame video of itself (Qwen-VL duplicates it over the temporal patch), so
    a video of two equal frames must give transformers' image processor's pixel rows and grid exactly;
    an odd frame count repeats the last frame, and the processor expands the video pad tokens and
    times each temporal patch as 2/fps seconds."""
    from stages.models.qwen2_5_vl import load_processor

    processor = load_processor(tiny_vlm)
    frame = Image.open(io.BytesIO(png(7, size=84)))
    image = processor.image_processor(images=[frame], return_tensors="pt")
    video = processor.video_processor([[frame, frame]], return_tensors="pt")
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist() == [[1, 6, 6]]
    assert torch.equal(video["pixel_values_videos"], image["pixel_values"])
    other = Image.open(io.BytesIO(png(8, size=84)))
    odd = processor.video_processor([[frame, frame, other]], return_tensors="pt")
    tail = processor.video_processor([[other, other]], return_tensors="pt")["pixel_values_videos"]
    assert odd["video_grid_thw"].tolist() == [[2, 6, 6]]
    assert torch.equal(odd["pixel_values_videos"], torch.cat([image["pixel_values"], tail]))
    from stages.models.vlm import VLMPolicy

    policy = VLMPolicy.for_prompts(tiny_vlm)
    messages = [{"role": "user", "content": [{"type": "video", "fps": 4.0}, {"type": "text", "text": "?"}]}]
    inputs = policy.chat_inputs([messages], [[]], videos=[[[frame, frame, other]]])
    video_pad = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert int((inputs["input_ids"] == video_pad).sum()) == 2 * 6 * 6 // 4
    assert int((inputs["mm_token_type_ids"] == 2).sum()) == 18
    assert inputs["second_per_grid_ts"].tolist() == [0.5]


def _update(modes_run: dict[str, Path], tiny_vlm: Path, out: Path, *extra: str) -> tuple[dict, dict]:
    """One `update` optimizer step over the 16 rows in 4 micro-batches; its metrics and adapter."""
    from safetensors.torch import load_file

    run(
        "update",
        "--model",
        str(tiny_vlm),
        *ins(modes_run["samples"], modes_run["logprobs"], modes_run["advantages"]),
        *("--no-shuffle", "--micro-batch", "4", "--grad-accum", "4", "--lora-rank", "4", "--lr", "1e-2"),
        *("--algo", "grpo", "--beta", "0.01", *extra, "--out", str(out)),
    )
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    return metrics[0], load_file(out / "adapter_model.safetensors")


def test_packing_and_token_balancing_leave_the_step_unchanged(
    modes_run: dict[str, Path], tiny_vlm: Path, tmp_path: Path
) -> None:
    """The step over every mode is the same padded (the default here: sdpa attention), packed, and
    packed with the rows dealt over the micro-batches by token count: loss, gradient norm and trained
    weights."""
    base, weights = _update(modes_run, tiny_vlm, tmp_path / "padded", "--packing", "off")
    assert max(float(weights[k].abs().max()) for k in weights if "lora_B" in k) > 1e-4
    for extra in (("--packing", "on"), ("--packing", "on", "--balance-tokens")):
        metrics, other = _update(modes_run, tiny_vlm, tmp_path / "-".join(extra), *extra)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
            assert metrics[key] == pytest.approx(base[key], rel=1e-5, abs=1e-7), (extra, key)
        for k in weights:  # Adam's first step is ±lr·(1e-2) wherever |grad| >> eps; 1e-5 is 0.1 % of it
            torch.testing.assert_close(other[k], weights[k], rtol=0, atol=1e-5)


def test_token_balancing_deals_a_step_evenly(modes_run: dict[str, Path]) -> None:
    """The objective's micro-batches of one step: row counts follow the tokens, every row once, and the
    heaviest micro-batch carries less above the mean than with --micro-batch rows each."""
    from stages.update.balance import imbalance
    from stages.update.token_objective import TokenPolicyGradient
    from stages.update.trainer import UpdateConfig

    data = ShardSet(modes_run["samples"]).read_all()
    tokens = (data["prompt_mask"].sum(-1) + data["response_mask"].sum(-1)).tolist()
    rows = list(range(len(tokens)))
    chunks = {}
    for balance in (False, True):
        cfg = UpdateConfig(algo="grpo", grad_accum=4, balance_tokens=balance)
        objective = TokenPolicyGradient.__new__(TokenPolicyGradient)  # epoch reads data and cfg only
        objective.data, objective.cfg, objective.counts = data, cfg, {}
        chunks[balance] = objective.epoch(rows, 4, None)
    assert [len(c) for c in chunks[False]] == [4, 4, 4, 4]
    assert sorted(i for c in chunks[True] for i in c) == rows and len(chunks[True]) == 4
    assert imbalance(tokens, chunks[True]) < imbalance(tokens, chunks[False])
    assert imbalance(tokens, chunks[True]) < 1.1


def test_a_token_budget_leaves_the_step_unchanged(
    modes_run: dict[str, Path], tiny_vlm: Path, tmp_path: Path
) -> None:
    """The step over 4 micro-batches of 4 rows = the step over micro-batches of at most 130 (or 60)
    prompt + response tokens, padded or packed: loss, gradient norm and trained weights."""
    base, weights = _update(modes_run, tiny_vlm, tmp_path / "fixed", "--packing", "off")
    assert max(float(weights[k].abs().max()) for k in weights if "lora_B" in k) > 1e-4
    for extra in (("--micro-batch-tokens", "130"), ("--packing", "on", "--micro-batch-tokens", "60")):
        metrics, other = _update(modes_run, tiny_vlm, tmp_path / "-".join(extra), *extra)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
            assert metrics[key] == pytest.approx(base[key], rel=1e-5, abs=1e-7), (extra, key)
        for k in weights:
            torch.testing.assert_close(other[k], weights[k], rtol=0, atol=1e-5)


def _budget_plan(data: dict, budget: int, ranks: int, accum: int, monkeypatch: pytest.MonkeyPatch) -> list:
    """The token objective's steps of the 16 rows in order, micro-batches of 4, over `ranks` ranks."""
    from stages.update.token_objective import TokenPolicyGradient
    from stages.update.trainer import UpdateConfig

    monkeypatch.setattr("stages.dist.data_parallel", lambda: (ranks, 0))
    objective = TokenPolicyGradient.__new__(TokenPolicyGradient)  # epoch reads data and cfg only
    objective.data, objective.counts = data, {}
    objective.cfg = UpdateConfig(algo="grpo", grad_accum=accum, micro_batch_tokens=budget)
    objective.epoch(list(range(16)), 4, None)
    return objective.plan


def test_a_token_budget_groups_each_ranks_rows_and_evens_the_counts(
    modes_run: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Budget 130 over the 16 rows (34-51 tokens): one process, all 676 tokens in 6 micro-batches
    (⌈676/130⌉); 2 ranks, rank 0's 8 rows (288 tokens) fit in 3 and rank 1's (388) need 4, so rank 0
    splits into 4 as well. Every micro-batch ≤ 130 tokens, every row once."""
    from stages.update.balance import budget_bins

    data = ShardSet(modes_run["samples"]).read_all()
    tokens = (data["prompt_mask"].sum(-1) + data["response_mask"].sum(-1)).tolist()
    assert (sum(tokens[:8]), sum(tokens[8:])) == (288, 388)
    assert (len(budget_bins(tokens[:8], 130)), len(budget_bins(tokens[8:], 130))) == (3, 4)
    for ranks, accum, counts in ((1, 4, [6]), (2, 2, [4, 4])):
        (step,) = _budget_plan(data, 130, ranks, accum, monkeypatch)
        assert [len(chunks) for chunks in step] == counts
        assert sorted(i for chunks in step for c in chunks for i in c) == list(range(16))
        assert max(sum(tokens[i] for i in c) for chunks in step for c in chunks) <= 130
    (step,) = _budget_plan(data, 130, 2, 2, monkeypatch)
    assert sorted(i for c in step[0] for i in c) == list(range(8))  # ranks keep their rows (no balancing)


@pytest.mark.distributed
def test_two_ranks_equal_one_process_with_a_token_budget(
    modes_run: dict[str, Path], tiny_vlm: Path, tmp_path: Path
) -> None:
    """torchrun with 2 gloo ranks, budget 130 (rank 0 runs 4 micro-batches where its rows fit in 3, to
    match rank 1) = 1 process with the same budget: same loss, gradient norm and weights."""
    from safetensors.torch import load_file

    common = [
        "--model",
        str(tiny_vlm),
        *ins(modes_run["samples"], modes_run["logprobs"], modes_run["advantages"]),
    ]
    common += ["--no-shuffle", "--micro-batch", "4", "--lora-rank", "4", "--lr", "1e-2", "--algo", "grpo"]
    common += ["--micro-batch-tokens", "130"]
    run("update", *common, "--grad-accum", "4", "--out", str(tmp_path / "one"))
    torchrun("update", *common, "--grad-accum", "2", "--out", str(tmp_path / "two"))
    m1 = json.loads((tmp_path / "one" / "metrics.jsonl").read_text())
    m2 = json.loads((tmp_path / "two" / "metrics.jsonl").read_text())
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ratio_mean"):
        # on-policy pg_loss is −mean(advantage) ≈ 0: a sum of other groupings rounds to ±1e-8
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    one = load_file(tmp_path / "one" / "adapter_model.safetensors")
    two = load_file(tmp_path / "two" / "adapter_model.safetensors")
    assert max(float(one[k].abs().max()) for k in one if "lora_B" in k) > 1e-4
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6)


def test_logprob_with_a_token_budget_equals_the_sampling_batches(
    modes_run: dict[str, Path], tiny_vlm: Path, tmp_path: Path
) -> None:
    """`logprob --micro-batch-tokens 100` (groups of 2-3 rows mixing the shard's modes, back in row
    order) gives the sampling batches' old and reference log-probs to 1e-5; 40 (below the longest
    rows, which then run alone) too."""
    base = ShardSet(modes_run["logprobs"]).read_all()
    ref = None
    for budget in ("100", "40"):
        out = tmp_path / budget
        common = ["--model", str(tiny_vlm), *ins(modes_run["samples"])]
        run("logprob", *common, "--reference", "--micro-batch-tokens", budget, "--out", str(out))
        got = ShardSet(out).read_all()
        assert list(got["sample_id"]) == list(base["sample_id"])
        torch.testing.assert_close(got["old_log_probs"], base["old_log_probs"], rtol=0, atol=1e-5)
        if ref is None:  # the first budget's reference log-probs are the others'
            ref = got["ref_log_probs"]
            assert torch.equal(ref != 0, base["old_log_probs"] != 0)
        torch.testing.assert_close(got["ref_log_probs"], ref, rtol=0, atol=1e-5)


def test_a_token_budget_below_one_is_refused_in_one_line(tmp_path: Path) -> None:
    from helpers import fails

    paths = ["--model", str(tmp_path), "--in", str(tmp_path), "--out", str(tmp_path / "out")]
    for command in ("update", "logprob"):
        for value in ("0", "-5"):
            line = fails([command, *paths, "--micro-batch-tokens", value], "--micro-batch-tokens")
            assert "greater than or equal to 1" in line


@pytest.mark.distributed
def test_two_ranks_equal_one_process_packed_and_token_balanced(
    modes_run: dict[str, Path], tiny_vlm: Path, tmp_path: Path
) -> None:
    """torchrun with 2 gloo ranks, each dealt its share of the step by token count, packed forwards =
    1 process with the same 4 micro-batches: same loss, gradient norm and weights."""
    from safetensors.torch import load_file

    common = [
        "--model",
        str(tiny_vlm),
        *ins(modes_run["samples"], modes_run["logprobs"], modes_run["advantages"]),
    ]
    common += ["--no-shuffle", "--micro-batch", "4", "--lora-rank", "4", "--lr", "1e-2", "--algo", "grpo"]
    common += ["--packing", "on", "--balance-tokens"]
    run("update", *common, "--grad-accum", "4", "--out", str(tmp_path / "one"))
    torchrun("update", *common, "--grad-accum", "2", "--out", str(tmp_path / "two"))
    m1 = json.loads((tmp_path / "one" / "metrics.jsonl").read_text())
    m2 = json.loads((tmp_path / "two" / "metrics.jsonl").read_text())
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ratio_mean"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-9)
    one = load_file(tmp_path / "one" / "adapter_model.safetensors")
    two = load_file(tmp_path / "two" / "adapter_model.safetensors")
    assert max(float(one[k].abs().max()) for k in one if "lora_B" in k) > 1e-4
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6)
