"""BAGEL's understanding through the token stages (stages/models/bagel_vlm.py): `sample --understand`,
`logprob` and `update --algo grpo` on the tiny build, through `VLMPolicy` as for any VLM."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import fails, ins, run, torchrun
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save_file

from stages.models.factory import init_model
from stages.models.folders import PEFT_CONFIG, PEFT_PREFIX, PEFT_WEIGHTS
from stages.models.vlm import VLMPolicy
from stages.score.text_rewards import verl_compute_score
from stages.shards import ShardSet

N, MAX_NEW = 4, 6


@verl_compute_score
def vowel_share(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """A dense reward in verl's compute_score form, so every group has advantages."""
    return sum(ch in "aeiou" for ch in solution_str.lower()) / max(1, len(solution_str))


def picture(dots: int, size: int = 42) -> Image.Image:
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for k in range(dots):
        draw.ellipse((2 + 10 * k, 16, 10 + 10 * k, 24), fill=(200, 30, 30))
    return image


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tiny_bagel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "bagel-tiny"
    init_model("bagel", out, size="tiny", seed=0)
    return out


@pytest.fixture(scope="module")
def policy(tiny_bagel: Path) -> VLMPolicy:
    return VLMPolicy.load(tiny_bagel)


def test_the_vlm_forward_equals_the_models_own_understanding_logits(policy: VLMPolicy) -> None:
    """Two left-padded prompts (one with an image, one text-only) in one batch: each row's logits equal
    `Bagel.understanding_logits` of the same pieces, one sequence at a time (its image chunk: full
    attention within, one RoPE position)."""
    image = picture(2)
    inputs = policy.chat_inputs(["How many dots?", "Say hi."], [[image], []])
    logits = policy.model(**inputs).logits
    tok = policy.processor.tokenizer
    patches, grid = policy.processor.image_patches(image)
    pixels = patches.view(*grid, 14, 14, 3).permute(4, 0, 2, 1, 3).reshape(3, grid[0] * 14, grid[1] * 14)
    for row, pieces in enumerate(
        [
            [pixels, torch.tensor(tok.encode("<|im_start|>How many dots?<|im_end|><|im_start|>"))],
            [torch.tensor(tok.encode("<|im_start|>Say hi.<|im_end|><|im_start|>"))],
        ]
    ):
        own = policy.model.understanding_logits(pieces)
        valid = inputs["attention_mask"][row].bool()
        text = valid & (inputs["input_ids"][row] != policy.model.image_pad_id)
        ids = inputs["input_ids"][row]
        markers = torch.isin(ids, torch.tensor(policy.model.config.image_markers))
        ours = logits[row][text & ~markers]
        assert ours.shape == own.shape
        assert torch.allclose(ours.float(), own, atol=1e-5, rtol=0)
    # 42 px resized up towards the 224-px short side, capped at the tiny position table's 56 px: 4×4 patches
    assert grid == (4, 4)


def test_rollout_replays_exactly(policy: VLMPolicy) -> None:
    """A LoRA'd rollout (KV-cached sampling) and its one-forward replay agree to |Δ logp| ≤ 1e-5."""
    policy_lora = VLMPolicy(
        policy.model, policy.processor, device=policy.device, model_path=policy.model_path
    )
    policy_lora.add_lora(rank=4, alpha=8, seed=0)
    with torch.no_grad():
        for name, p in policy_lora.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    prompt = policy_lora.chat_inputs(["How many dots?", "Count."], [[picture(1)], [picture(3, 28)]])
    roll = policy_lora.generate(prompt, n=3, max_new_tokens=8, seed=1)
    expanded = {
        k: v.repeat_interleave(3, 0) if k in ("input_ids", "attention_mask") else v for k, v in prompt.items()
    }
    pixels, grids = prompt["pixel_values"], prompt["image_grid"]
    expanded["pixel_values"] = torch.cat([p for p in pixels.split(grids.prod(1).tolist()) for _ in range(3)])
    expanded["image_grid"] = grids.repeat_interleave(3, 0)
    with torch.no_grad():
        replay = policy_lora.response_log_probs(expanded, roll.response_ids, roll.response_mask)
    mask = roll.response_mask
    assert mask.sum() > 6 and (roll.log_probs[mask] < 0).all()
    assert (replay[mask] - roll.log_probs[mask]).abs().max() <= 1e-5
    names = [n for n, _ in policy_lora.model.named_modules() if n.endswith(".lora_A")]
    assert names and not any("vit_model" in n or "connector" in n or "lm_head" in n for n in names)
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {n.split(".")[-2].removesuffix("_moe_gen") for n in names} == projections
    assert len(names) == 2 * 2 * 7  # 2 layers × both experts × 7 projections (UniGRPO's one folder)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_bagel: Path) -> None:
    grads = []
    for checkpointing in (False, True):
        policy = VLMPolicy.load(tiny_bagel)
        policy.add_lora(rank=4, alpha=8, seed=0)
        if checkpointing:
            policy.gradient_checkpointing()
        assert policy.module.get_base_model().language_model.checkpointing is checkpointing
        params = policy.trainable_parameters()
        prompt = policy.chat_inputs(["How many dots?"], [[picture(2)]])
        answer = torch.tensor([[11, 12, 13]])
        policy.response_log_probs(prompt, answer, torch.ones_like(answer, dtype=torch.bool)).sum().backward()
        # the generation expert's LoRA layers get none: no answer token reaches them
        grads.append(
            torch.cat(
                [p.grad.flatten() if p.grad is not None else p.new_full((1,), torch.nan) for p in params]
            )
        )
    assert grads[0].abs().nan_to_num().max() > 0 and grads[0].isnan().sum() == 2 * 7 * 2
    assert torch.allclose(grads[0], grads[1], atol=1e-7, rtol=0, equal_nan=True)


@pytest.fixture(scope="module")
def staged(tiny_bagel: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bagel_und")
    rows = [
        {
            "data_source": "dots",
            "prompt": [{"role": "user", "content": f"<image>How many dots? {k}"}],
            "images": [{"bytes": png(picture(k + 1)), "path": None}],
            "reward_model": {"style": "rule", "ground_truth": str(k + 1)},
            "extra_info": {"index": k},
        }
        for k in range(2)
    ]
    data = root / "dots.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    paths = {name: root / name for name in ("samples", "rewards", "logprobs", "advantages", "policy")}
    model = ["--model", str(tiny_bagel)]
    run("sample", *model, "--understand", "--prompts", str(data), "-n", str(N),
        "--max-new-tokens", str(MAX_NEW), "--out", str(paths["samples"]))  # fmt: skip
    run(
        "score",
        *ins(paths["samples"]),
        "--reward",
        "test_family_bagel_understanding:vowel_share",
        "--out",
        str(paths["rewards"]),
    )
    paths["replay"] = run("logprob", *model, *ins(paths["samples"]), "--replay", "yes", "--out", str(paths["logprobs"]))  # fmt: skip
    run("advantage", *ins(paths["samples"], paths["rewards"]), "--estimator", "grpo", "--out", str(paths["advantages"]))  # fmt: skip
    run("update", *model, *ins(paths["samples"], paths["logprobs"], paths["advantages"]), "--algo", "grpo",
        "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2", "--out", str(paths["policy"]))  # fmt: skip
    paths["data"] = data
    return paths


def test_the_stages_sample_replay_and_train_the_understanding_lora(
    staged: dict[str, Path], tiny_bagel: Path
) -> None:
    data = ShardSet(staged["samples"]).read_all()
    logprobs = ShardSet(staged["logprobs"]).read_all()
    assert len(data["sample_id"]) == 2 * N and data["response_ids"].shape[1] == MAX_NEW
    mask = data["response_mask"]
    assert (data["log_probs"][mask] < 0).all()
    assert (logprobs["old_log_probs"][mask] - data["log_probs"][mask]).abs().max() <= 1e-5
    trained = load_file(staged["policy"] / PEFT_WEIGHTS)
    assert trained and all(k.startswith(PEFT_PREFIX + "language_model.model.layers.") for k in trained)
    # the understanding expert's LoRA moved; the generation expert's (no answer token reaches it) did not
    assert min(v.abs().max() for k, v in trained.items() if "lora_B" in k and "moe_gen" not in k) > 0
    assert max(v.abs().max() for k, v in trained.items() if "lora_B" in k and "moe_gen" in k) == 0
    # the trained adapter loads back on the base and changes only the understanding expert's outputs
    base, tuned = VLMPolicy.load(tiny_bagel), VLMPolicy.load(tiny_bagel, adapter=staged["policy"])
    base_state = base.model.state_dict()
    frozen = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in tuned.model.state_dict().items() if "lora_" not in k}  # fmt: skip
    assert frozen.keys() == base_state.keys()
    assert all(torch.equal(v, base_state[k]) for k, v in frozen.items())


def test_the_lora_round_trips_through_peft_and_export(
    staged: dict[str, Path], tiny_bagel: Path, tmp_path: Path
) -> None:
    """The trained folder loads with PEFT itself onto the model, and `omnirl export` merges it into a released
    BAGEL folder: all three answer with the same logits."""
    from peft import PeftModel

    from stages.models.bagel_vlm import load_model

    tuned = VLMPolicy.load(tiny_bagel, adapter=staged["policy"])
    inputs = tuned.chat_inputs(["How many dots?"], [[picture(2)]])
    merged = run("export", str(staged["policy"]), "--out", str(tmp_path / "merged"))
    assert merged["merged_layers"] == 2 * 2 * 7
    with torch.no_grad():
        ours = tuned.model(**inputs).logits
        peft = PeftModel.from_pretrained(load_model(tiny_bagel, torch.float32), str(staged["policy"]))(
            **inputs
        ).logits
        exported = VLMPolicy.load(tmp_path / "merged").model(**inputs).logits
        base = VLMPolicy.load(tiny_bagel).model(**inputs).logits
    assert torch.equal(ours, peft)
    assert torch.allclose(exported, ours, atol=1e-5, rtol=0) and not torch.allclose(
        base, ours, atol=1e-4, rtol=0
    )


@pytest.mark.distributed
def test_two_ranks_equal_one_process(staged: dict[str, Path], tiny_bagel: Path, tmp_path: Path) -> None:
    """GRPO on 2 gloo ranks × 1 micro-batch = 1 process × 2 accumulated ones (DDP reaches the
    understanding forward; the generation expert's LoRA, unused, stays zero on both)."""
    common = ["--model", str(tiny_bagel), *ins(staged["samples"], staged["logprobs"], staged["advantages"])]
    common += ["--no-shuffle", "--micro-batch", "4", "--lora-rank", "4", "--lr", "1e-2", "--algo", "grpo"]
    run("update", *common, "--grad-accum", "2", "--out", str(tmp_path / "one"))
    torchrun("update", *common, "--grad-accum", "1", "--out", str(tmp_path / "two"))
    one, two = (load_file(tmp_path / d / PEFT_WEIGHTS) for d in ("one", "two"))
    assert one.keys() == two.keys() and len(one) == 2 * 2 * 7 * 2
    assert max(float(one[k].abs().max()) for k in one if "lora_B" in k) > 1e-4
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6)


def test_bad_inputs_are_one_line(staged: dict[str, Path], tiny_bagel: Path, tiny_sd3: Path) -> None:
    fails(["sample", "--model", str(tiny_sd3), "--understand", "--prompts", str(staged["data"]),
           "--out", str(staged["data"].parent / "x")], "--understand")  # fmt: skip
    fails(["update", "--model", str(tiny_bagel), *ins(staged["samples"], staged["logprobs"], staged["advantages"]),
           "--algo", "grpo", "--full", "--out", str(staged["data"].parent / "y")], "--full", "LoRA")  # fmt: skip


def test_a_generation_only_adapter_is_refused_by_an_understanding_update(
    staged: dict[str, Path], tiny_bagel: Path
) -> None:
    gen_only = staged["data"].parent / "gen-only"
    gen_only.mkdir()
    weights = load_file(staged["policy"] / PEFT_WEIGHTS)
    save_file({k: v for k, v in weights.items() if "moe_gen" in k}, gen_only / PEFT_WEIGHTS)
    config = json.loads((staged["policy"] / PEFT_CONFIG).read_text())
    config["target_modules"] = [t for t in config["target_modules"] if t.endswith("_moe_gen")] + [
        "mlp_moe_gen.gate_proj"
    ]
    (gen_only / PEFT_CONFIG).write_text(json.dumps(config))
    fails(["update", "--model", str(tiny_bagel), "--adapter", str(gen_only),
           *ins(staged["samples"], staged["logprobs"], staged["advantages"]), "--algo", "grpo",
           "--out", str(staged["data"].parent / "z")], "--adapter", "generation-only")  # fmt: skip


RECIPES = Path(__file__).parents[1] / "recipes"


def test_unigrpo_trains_one_adapter_in_both_phases(
    staged: dict[str, Path], tiny_bagel: Path, tmp_path: Path
) -> None:
    """recipes/unigrpo.mk's alternation with its two presets (sized down for the tiny build): the folder the
    understanding update wrote (`staged`) goes through a generation phase and another understanding
    phase. The generation phase trains the generation expert's layers of that folder (and, through the
    image chunk's two marker tokens, the understanding expert's), its replay exact under the shared
    adapter; the understanding phase moves the understanding layers and leaves the generation ones."""
    model = ["--model", str(tiny_bagel)]
    prompts = tmp_path / "prompts.csv"
    prompts.write_text("prompt\na red cube\na blue sky\n")

    def phase(kind: str, adapter: Path, out: Path, sample: list[str], reward: str) -> Path:
        config = ["--config", str(RECIPES / "configs" / f"unigrpo_bagel_{kind}.yaml")]
        with_adapter = [*model, "--adapter", str(adapter)]
        run("sample", *config, *with_adapter, *sample, "--num-prompts", "2", "--out", str(out / "samples"))
        run("score", *config, *ins(out / "samples"), "--reward", reward, "--out", str(out / "rewards"))
        run("logprob", *config, *with_adapter, *ins(out / "samples"), "--replay", "yes", "--out", str(out / "logprobs"))  # fmt: skip
        run("advantage", *config, *ins(out / "samples", out / "rewards"), "--out", str(out / "advantages"))
        run("update", *config, *with_adapter, *ins(out / "samples", out / "logprobs", out / "advantages"),
            "--lr", "1e-3", "--out", str(out / "policy"))  # fmt: skip
        return out / "policy"

    first = staged["policy"]
    gen = ["--prompts", str(prompts), "-n", "2", "--steps", "4", "--resolution", "16", "--sde-window-range", "0", "2"]  # fmt: skip
    second = phase("generation", first, tmp_path / "gen", gen, "jpeg_compressibility")
    und = ["--prompts", str(staged["data"]), "-n", "4", "--max-new-tokens", str(MAX_NEW)]
    third = phase(
        "understanding", second, tmp_path / "und", und, "test_family_bagel_understanding:vowel_share"
    )

    rollout, replay = (
        ShardSet(tmp_path / "gen" / "samples").read_all(),
        ShardSet(tmp_path / "gen" / "logprobs").read_all(),
    )
    assert torch.equal(rollout["log_probs"], replay["old_log_probs"])
    folders = [load_file(f / PEFT_WEIGHTS) for f in (first, second, third)]
    assert folders[0].keys() == folders[1].keys() == folders[2].keys()
    configs = [json.loads((f / PEFT_CONFIG).read_text()) for f in (first, second, third)]
    assert all(sorted(c["target_modules"]) == sorted(configs[0]["target_modules"]) for c in configs)

    def moved(a: dict, b: dict, generation: bool) -> bool:
        return any(not torch.equal(a[k], b[k]) for k in a if ("moe_gen" in k) == generation)

    assert moved(folders[0], folders[1], generation=True)  # the generation phase trained the shared folder
    assert moved(folders[1], folders[2], generation=False)  # and the understanding phase after it
    assert not moved(folders[1], folders[2], generation=True)
