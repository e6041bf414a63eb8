"""The VLM path through the staged commands: sample → score → logprob → advantage → update on files.

A verl-format Parquet (drawn images, ground truths) goes through `omnirl sample` with the tiny
Qwen2.5-VL; every later stage reads only the files. Values are checked against independent
computations: decoded ids, text rewards on the stored strings, the GRPO formula, replayed log-probs.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import ins, run, runner, torchrun
from PIL import Image, ImageDraw

from omnirl_cli.app import app
from stages.score.text_rewards import soft_overlong_penalty, verl_compute_score
from stages.shards.reader import ShardSet

N = 4
MAX_NEW = 12


def vowel_share_rule(text: str) -> float:
    return sum(ch in "aeiou" for ch in text.lower()) / max(1, len(text))


@verl_compute_score
def vowel_share(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> dict:
    """A dense reward in verl's compute_score form (returns a dict with "score")."""
    assert data_source == "dots" and ground_truth in ("1", "2", "3") and "index" in extra_info
    return {"score": vowel_share_rule(solution_str), "length": len(solution_str)}


def png(colour: tuple[int, int, int], dots: int, size: int = 56) -> bytes:
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for k in range(dots):
        draw.ellipse((4 + 12 * k, 22, 12 + 12 * k, 30), fill=colour)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def verl_rows() -> list[dict]:
    """Three verl rows: one image, two images (different sizes), and one image with extra_info."""
    return [
        {
            "data_source": "dots",
            "prompt": [{"role": "user", "content": f"<image>How many dots? {k}"}],
            "images": [{"bytes": png((200, 30, 30), k + 1), "path": None}]
            + ([{"bytes": png((30, 30, 200), 1, size=84), "path": None}] if k == 1 else []),
            "ability": "count",
            "reward_model": {"style": "rule", "ground_truth": str(k + 1)},
            "extra_info": {"split": "train", "index": k},
        }
        for k in range(3)
    ]


def fix_placeholders(rows: list[dict]) -> list[dict]:
    for row in rows:
        count = len(row["images"])
        row["prompt"][0]["content"] = "<image>" * count + row["prompt"][0]["content"].replace("<image>", "")
    return rows


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory: pytest.TempPathFactory, tiny_vlm: Path) -> dict[str, Path]:
    """One staged VLM iteration on files (group size 4, batches of 2 prompts)."""
    root = tmp_path_factory.mktemp("vlm_run")
    data = root / "dots.parquet"
    pq.write_table(pa.Table.from_pylist(fix_placeholders(verl_rows())), data)
    paths = {name: root / name for name in ("samples", "rewards", "logprobs", "advantages")}
    paths["data"] = data
    run(
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
        "8",
        "--num-shards",
        "2",
        "--out",
        str(paths["samples"]),
    )
    run(
        "score",
        *ins(paths["samples"]),
        "--reward",
        "length_penalty",
        "--reward",
        "accuracy=0.5",
        "--reward",
        "test_vlm_stages:vowel_share=2",
        "--out",
        str(paths["rewards"]),
    )
    paths["replay"] = run(
        "logprob",
        "--model",
        str(tiny_vlm),
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
    return paths


def test_verl_rows_round_trip_through_sample(vlm_run: dict[str, Path], tiny_vlm: Path) -> None:
    from stages.models.qwen2_5_vl import load_processor

    rows = pq.read_table(vlm_run["data"]).to_pylist()
    data = ShardSet(vlm_run["samples"]).read_all()
    tok = load_processor(tiny_vlm).tokenizer
    assert len(data["sample_id"]) == 3 * N
    assert data["response_ids"].shape == (3 * N, MAX_NEW) and data["prompt_ids"].shape == (3 * N, 96)
    rollout = data["sample_id"][0][:8]  # the rollout id prefixes every id
    for i, sid in enumerate(data["sample_id"]):
        k, member = divmod(i, N)
        assert sid == f"{rollout}-g{k:06d}-{member:03d}" and data["group_id"][i] == f"{rollout}-g{k:06d}"
        meta = data["prompt_meta"][i]
        assert meta["ground_truth"] == rows[k]["reward_model"]["ground_truth"]
        assert meta["data_source"] == "dots" and meta["extra_info"] == rows[k]["extra_info"]
        assert meta["max_response_length"] == MAX_NEW
        assert data["prompt"][i] == f"How many dots? {k}"
        # images once per prompt: the first row of the group holds the original files, byte for byte
        assert data["images"][i] == ([im["bytes"] for im in rows[k]["images"]] if member == 0 else [])
        mask = data["response_mask"][i]
        assert int(mask.sum()) == int(data["response_length"][i]) and bool(mask[0])
        assert not mask[int(mask.sum()) :].any()  # one valid prefix
        ids = data["response_ids"][i][mask]
        assert data["response_text"][i] == tok.decode(ids, skip_special_tokens=True)
        assert (data["log_probs"][i][mask] < 0).all() and (data["log_probs"][i][~mask] == 0).all()
        prompt = tok.decode(data["prompt_ids"][i][data["prompt_mask"][i]])
        assert f"How many dots? {k}<|im_end|>" in prompt
        image_tokens = int(
            (
                data["prompt_ids"][i][data["prompt_mask"][i]] == tok.convert_tokens_to_ids("<|image_pad|>")
            ).sum()
        )
        assert image_tokens == (4 if k != 1 else 4 + 9)  # 56² px → 2×2 merged patches; 84² → 3×3


def test_rollout_loads_in_hf_datasets_with_images_as_pil_lists(
    vlm_run: dict[str, Path], tmp_path: Path
) -> None:
    """`datasets` gives the manifest's shapes for the rollout and its column groups, and each row's
    images as a list of PIL images (the prompt's, in the first row of its group)."""
    import datasets
    import numpy as np

    rows = pq.read_table(vlm_run["data"]).to_pylist()
    for stage in ("samples", "logprobs", "advantages"):
        shard_set = ShardSet(vlm_run[stage])
        ds = datasets.load_dataset(
            "parquet", data_files=f"{vlm_run[stage]}/*.parquet", split="train", cache_dir=str(tmp_path)
        )
        as_numpy = ds.with_format("numpy")[:]
        for name, col in shard_set.columns.items():
            if col.kind == "tensor":
                assert as_numpy[name].shape == (shard_set.num_rows, *col.shape), (stage, name)
    ds = datasets.Dataset.from_parquet(f"{vlm_run['samples']}/*.parquet", cache_dir=str(tmp_path))
    assert ds.features["images"] == datasets.List(datasets.Image())
    for i, images in enumerate(ds["images"]):
        k, member = divmod(i, N)
        want = [im["bytes"] for im in rows[k]["images"]] if member == 0 else []
        assert len(images) == len(want) and all(isinstance(im, Image.Image) for im in images)
        for im, data in zip(images, want):
            assert np.array_equal(np.asarray(im), np.asarray(Image.open(io.BytesIO(data))))
    head = run("inspect", str(vlm_run["samples"]), "--head", "2")["head"]
    first = rows[0]["images"][0]["bytes"]
    assert [r["images"] for r in head] == [f"<1 images {len(first)} B>", "<0 images 0 B>"]


def test_score_reads_the_response_strings_and_lengths(vlm_run: dict[str, Path]) -> None:
    data = ShardSet(vlm_run["samples"]).read_all()
    rewards = ShardSet(vlm_run["rewards"]).read_all()
    assert rewards["sample_id"] == data["sample_id"]
    for i in range(len(data["sample_id"])):
        length = int(data["response_length"][i])
        expected = soft_overlong_penalty(length, MAX_NEW, int(0.2 * MAX_NEW))
        assert rewards["reward.length_penalty"][i].item() == pytest.approx(expected)
        text = data["response_text"][i]
        hit = text.strip() == data["prompt_meta"][i]["ground_truth"]
        assert rewards["reward.accuracy"][i].item() == float(hit)
        vowels = vowel_share_rule(text)
        assert rewards["reward.test_vlm_stages:vowel_share"][i].item() == pytest.approx(vowels)
        assert rewards["reward"][i].item() == pytest.approx(
            expected + 0.5 * float(hit) + 2 * vowels, abs=1e-6
        )
    assert rewards["reward"].view(3, N).std(1).min() > 0  # every group has a learning signal


def test_image_rewards_are_refused_for_text_rollouts(vlm_run: dict[str, Path], tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        ["score", *ins(vlm_run["samples"]), "--reward", "jpeg_compressibility", "--out", str(tmp_path / "r")],
    )
    assert result.exit_code == 2
    assert "jpeg_compressibility: it scores images but this rollout has text outputs" in result.output


def test_replay_reproduces_rollout_log_probs(vlm_run: dict[str, Path]) -> None:
    assert vlm_run["replay"]["abs_delta_max"] < 1e-5
    data = ShardSet(vlm_run["samples"]).read_all()
    lp = ShardSet(vlm_run["logprobs"]).read_all()
    mask = data["response_mask"]
    assert torch.allclose(lp["old_log_probs"][mask], data["log_probs"][mask], atol=1e-5)
    assert (lp["old_log_probs"][~mask] == 0).all()
    # no adapter: the reference policy is the sampling policy
    assert torch.equal(lp["ref_log_probs"], lp["old_log_probs"])


def test_grpo_verl_advantages_follow_the_formula(vlm_run: dict[str, Path]) -> None:
    rewards = ShardSet(vlm_run["rewards"]).read_all()["reward"].double().view(3, N)
    adv = ShardSet(vlm_run["advantages"]).read_all()["advantages"]
    assert adv.shape == (3 * N, 1)
    expected = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    assert torch.allclose(adv.view(3, N).double(), expected, atol=1e-5)


def update(vlm_run: dict[str, Path], model: Path, out: Path, *extra: str) -> dict:
    return run(
        "update",
        "--model",
        str(model),
        *ins(vlm_run["samples"], vlm_run["logprobs"], vlm_run["advantages"]),
        "--out",
        str(out),
        "--no-shuffle",
        *extra,
    )


def test_update_moves_log_probs_along_the_advantages(
    vlm_run: dict[str, Path], tiny_vlm: Path, tmp_path: Path
) -> None:
    result = update(
        vlm_run,
        tiny_vlm,
        tmp_path / "policy",
        "--algo",
        "grpo",
        "--lr",
        "1e-2",
        "--lora-rank",
        "8",
        "--micro-batch",
        "12",
        "--beta",
        "0.01",
    )
    assert result["step"] == 1
    metrics = [json.loads(line) for line in (tmp_path / "policy" / "metrics.jsonl").read_text().splitlines()]
    first = metrics[0]
    assert first["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy first step
    assert first["actor/pg_clipfrac"] == 0.0 and first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    config = json.loads((tmp_path / "policy" / "omnirl_adapter.json").read_text())
    assert config["kind"] == "lora" and (tmp_path / "policy" / "adapter_model.safetensors").is_file()
    after = run(
        "logprob",
        "--model",
        str(tiny_vlm),
        "--adapter",
        str(tmp_path / "policy"),
        *ins(vlm_run["samples"]),
        "--out",
        str(tmp_path / "lp"),
    )
    assert after["abs_delta_max"] > 1e-4  # the adapter changed the policy
    data = ShardSet(vlm_run["samples"]).read_all()
    new = ShardSet(tmp_path / "lp").read_all()["old_log_probs"]
    adv = ShardSet(vlm_run["advantages"]).read_all()["advantages"][:, 0]
    delta = ((new - data["log_probs"]) * data["response_mask"]).sum(-1)
    assert float((adv * delta).sum()) > 0


def test_token_mean_counts_the_tokens_of_the_whole_optimizer_step(
    vlm_run: dict[str, Path], tiny_vlm: Path
) -> None:
    """1 micro-batch of 12 rows and 3 accumulated micro-batches of 4 give the same gradient; averaging
    per-micro-batch token means instead (what a naive accumulation does) would not."""
    import random

    from stages.models.vlm import VLMPolicy
    from stages.sample.vlm_stage import vlm_sample_config_of
    from stages.shards.reader import open_inputs
    from stages.update.config import UpdateConfig
    from stages.update.losses import TOKEN_COLUMNS, get_algorithm
    from stages.update.objectives import make_objective

    src = open_inputs([vlm_run["samples"], vlm_run["logprobs"], vlm_run["advantages"]])
    data = src.read_all(columns=[c for c in (*TOKEN_COLUMNS, "prompt", "advantages") if c in src.columns])
    # responses of unequal lengths, else every normalisation agrees (the random model rarely stops)
    lengths = torch.tensor([3 + (5 * i) % 9 for i in range(12)])
    data["response_mask"] = data["response_mask"] & (torch.arange(MAX_NEW) < lengths[:, None])
    policy = VLMPolicy.load(tiny_vlm)
    policy.add_lora(rank=4, alpha=8)
    params = policy.trainable_parameters()
    with torch.no_grad():  # a non-zero LoRA B, so the loss has a gradient on every adapter weight
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    scfg = vlm_sample_config_of(src.manifests)

    def gradient(micro: int, accum: int, global_count: bool = True) -> torch.Tensor:
        cfg = UpdateConfig(algo="dapo", micro_batch=micro, grad_accum=accum, lr=0.0)
        objective = make_objective(policy, data, scfg, cfg, get_algorithm("dapo"))
        chunks = objective.epoch(list(range(12)), micro, random.Random(0))
        if not global_count:
            objective.counts = {c[0]: (float(data["response_mask"][c].sum()), float(len(c))) for c in chunks}
        for p in params:
            p.grad = None
        for chunk in chunks:
            for loss, _ in objective.losses(chunk):
                (loss / accum).backward()
        return torch.cat([p.grad.flatten() for p in params])

    whole, accumulated = gradient(12, 1), gradient(4, 3)
    naive = gradient(4, 3, global_count=False)
    scale = float(whole.abs().max())
    assert scale > 0
    assert float((whole - accumulated).abs().max()) < 1e-5 * scale
    assert float((whole - naive).abs().max()) > 1e-3 * scale


def test_openai_engine_through_a_server_samples_what_hf_samples(
    vlm_run: dict[str, Path], tiny_vlm: Path, tmp_path: Path
) -> None:
    """`--engine openai` against a local OpenAI-API server backed by the same weights draws the very
    responses `--engine hf` draws with one prompt per generate call (same per-prompt seeds)."""
    from openai_server import serve

    from stages.models.vlm import VLMPolicy

    common = (
        "--prompts",
        str(vlm_run["data"]),
        "-n",
        "3",
        "--max-new-tokens",
        "6",
        "--max-prompt-length",
        "96",
    )
    common += ("--batch-size", "3", "--seed", "5")
    run("sample", "--model", str(tiny_vlm), *common, "--out", str(tmp_path / "hf"))
    with serve(VLMPolicy.load(tiny_vlm), "tiny-vlm") as url:
        run(
            "sample",
            "--model",
            str(tiny_vlm),
            *common,
            "--engine",
            "openai",
            "--server-url",
            url,
            "--served-model",
            "tiny-vlm",
            "--out",
            str(tmp_path / "api"),
        )
    hf, api = ShardSet(tmp_path / "hf").read_all(), ShardSet(tmp_path / "api").read_all()
    for key in ("response_text", "images", "prompt_meta"):
        assert hf[key] == api[key]
    # the same rows, under each rollout's own id
    assert [i.split("-", 1)[1] for i in hf["sample_id"]] == [i.split("-", 1)[1] for i in api["sample_id"]]
    for key in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "seed"):
        assert torch.equal(hf[key], api[key])
    assert torch.allclose(hf["log_probs"], api["log_probs"], atol=1e-6)
    assert len(set(hf["response_text"])) > 3  # the draws differ from sample to sample


def test_unreachable_server_is_one_line_with_exit_2(
    vlm_run: dict[str, Path], tiny_vlm: Path, tmp_path: Path
) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = runner.invoke(
        app,
        [
            "sample",
            "--model",
            str(tiny_vlm),
            "--prompts",
            str(vlm_run["data"]),
            "--engine",
            "openai",
            "--server-url",
            f"http://127.0.0.1:{port}/v1",
            "--served-model",
            "m",
            "--out",
            str(tmp_path / "s"),
        ],
    )
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert f"127.0.0.1:{port}" in result.output
    assert not (tmp_path / "s" / "_manifest.json").exists()


@pytest.mark.distributed
def test_two_ranks_equal_one_process(vlm_run: dict[str, Path], tiny_vlm: Path, tmp_path: Path) -> None:
    """torchrun with 2 gloo ranks × 1 micro-batch = 1 process × 2 accumulated micro-batches: the
    token-mean counts both ranks' tokens, so loss, gradient and weights agree."""
    from safetensors.torch import load_file

    common = ["--model", str(tiny_vlm), *ins(vlm_run["samples"], vlm_run["logprobs"], vlm_run["advantages"])]
    common += ["--no-shuffle", "--micro-batch", "6", "--lora-rank", "4", "--lr", "1e-2", "--algo", "grpo"]
    common += ["--beta", "0.01"]
    run("update", *common, "--grad-accum", "2", "--out", str(tmp_path / "one"))
    torchrun("update", *common, "--grad-accum", "1", "--out", str(tmp_path / "two"))
    m1 = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [1]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        assert m2[0][key] == pytest.approx(m1[0][key], rel=1e-5, abs=1e-9)
    one = load_file(tmp_path / "one" / "adapter_model.safetensors")
    two = load_file(tmp_path / "two" / "adapter_model.safetensors")
    assert one.keys() == two.keys()
    assert max(float(one[k].abs().max()) for k in one if "lora_B" in k) > 1e-4
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("model", "flag"),
    [
        ("vlm", ["--steps", "5"]),
        ("vlm", ["--steps", "10"]),  # given, though at its default
        ("vlm", ["--no-roll-back"]),
        ("vlm", ["--defer-decode"]),
        ("vlm", ["--resolution", "64"]),
        ("vlm", ["--frames", "5"]),
        ("sd3", ["--temperature", "0.5"]),
        ("sd3", ["--max-new-tokens", "8"]),
    ],
)
def test_options_of_the_other_model_kind_are_refused(
    vlm_run: dict[str, Path], tiny_vlm: Path, tiny_sd3: Path, tmp_path: Path, model: str, flag: list[str]
) -> None:
    """A diffusion option given with a VLM (or the reverse) is one line naming it, not silently unused."""
    text = tmp_path / "prompts.txt"
    text.write_text("a red circle\n")
    weights, prompts = (tiny_vlm, vlm_run["data"]) if model == "vlm" else (tiny_sd3, text)
    out = tmp_path / "s"
    args = ["sample", "--model", str(weights), "--prompts", str(prompts), *flag, "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert result.output.startswith(f"error: {flag[0]}: a ") and "never reads it; drop it" in result.output
    assert not out.exists()


def test_a_preset_value_of_the_other_model_kind_names_its_key(
    vlm_run: dict[str, Path], tiny_vlm: Path, tmp_path: Path
) -> None:
    """A diffusion preset's sampler (or --set) given to a VLM: the key is named, not a flag never typed."""
    preset = tmp_path / "preset.yaml"
    preset.write_text("sample:\n  steps: 8\n  group_size: 2\n")
    out = tmp_path / "s"
    args = ["sample", "--model", str(tiny_vlm), "--prompts", str(vlm_run["data"]), "--out", str(out)]
    for extra, origin in ((["--config", str(preset)], f"--config {preset}"), (["--set", "steps=8"], "--set")):
        result = runner.invoke(app, [*args, *extra])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
        assert result.output.startswith(f"error: steps (from {origin}): a vision-language --model")
    assert not out.exists()
