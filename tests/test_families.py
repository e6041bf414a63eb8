"""What every diffusion family must do through the stage commands, on its tiny offline build: the same
invariants for each (rollout log-prob == replay, LoRA and full weights round-trip, every --algo trains,
2 gloo ranks == 1 process). What is particular to a family (its velocity equals the stock diffusers
pipeline's own loop) lives in tests/test_family_<name>.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, fails, ins, run, torchrun
from safetensors.torch import load_file

from stages.models.diffusion import FlowPolicy
from stages.models.families import adapter_class
from stages.models.folders import LORA_WEIGHTS, pipeline_index
from stages.shards.reader import ShardSet, open_inputs

# init-model --family name → the sampling flags that fit its tiny build
FAMILIES = {
    "flux": ["--resolution", "32", "--guidance", "3.5"],
    "flux2": ["--resolution", "32", "--guidance", "4"],
    "flux2_klein": ["--resolution", "32", "--guidance", "4"],
    "flux_kontext": ["--resolution", "32", "--guidance", "3.5"],
    "qwen_image": ["--resolution", "32", "--guidance", "4"],
    "qwen_image_edit": ["--resolution", "32", "--guidance", "4"],
    "qwen_image_edit_plus": ["--resolution", "32", "--guidance", "4"],
    "sd3": ["--resolution", "32", "--guidance", "3"],
    "z_image": ["--resolution", "32", "--guidance", "3"],
}
# editing families: their prompts carry a source image each (column `image`)
EDITING = {"flux_kontext", "qwen_image_edit", "qwen_image_edit_plus"}


def prompt_table(name: str, root: Path) -> Path:
    """The family's prompt file: PROMPTS one a line, or for an editing family a JSONL table whose rows
    name a source PNG beside it."""
    if name not in EDITING:
        prompts = root / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS) + "\n")
        return prompts
    from PIL import Image

    rows = []
    for i, prompt in enumerate(PROMPTS):
        Image.new("RGB", (32, 32), (80 * i, 255 - 80 * i, 40)).save(root / f"source{i}.png")
        rows.append(json.dumps({"prompt": prompt, "image": f"source{i}.png"}) + "\n")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(rows))
    return prompts


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    """One staged iteration of a family: sample (sde, windowless) → score → logprob → advantage."""
    from stages.models.factory import init_model

    name = request.param
    root = tmp_path_factory.mktemp(f"family-{name}")
    init_model(name, root / "model", size="tiny", seed=0)
    prompts = prompt_table(name, root)
    p: dict[str, Path | str] = {"name": name, "model": root / "model", "root": root, "prompts": prompts}
    run(
        "sample", "--model", str(p["model"]), "--prompts", str(prompts), "-n", "2", "--steps", "3",
        "--batch-size", "3", *FAMILIES[name], "--out", str(root / "samples"),
    )  # fmt: skip
    run(
        "score",
        "--in",
        str(root / "samples"),
        "--reward",
        "jpeg_compressibility",
        "--out",
        str(root / "rewards"),
    )
    p["replay"] = run(
        "logprob", "--model", str(p["model"]), "--in", str(root / "samples"), "--out", str(root / "logprobs")
    )
    run("advantage", *ins(root / "samples", root / "rewards"), "--out", str(root / "advantages"))
    for key in ("samples", "rewards", "logprobs", "advantages"):
        p[key] = root / key
    return p


def update(
    family: dict, out: Path, *extra: str, inputs: tuple[str, ...] = ("samples", "logprobs", "advantages")
) -> dict:
    return run(
        "update", "--model", str(family["model"]), *ins(*(family[k] for k in inputs)),
        "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-3", "--out", str(out), *extra,
    )  # fmt: skip


def test_the_family_is_recorded_and_replay_is_exact(family: dict) -> None:
    assert FlowPolicy.load(family["model"]).family.name == family["name"]
    for stage in ("samples", "rewards", "logprobs", "advantages"):  # derived sets inherit the rollout's kind
        extra = ShardSet(family[stage]).manifest.extra
        assert (extra["family"], extra["modality"]) == (family["name"], "image")
    assert family["replay"]["abs_delta_max"] == 0.0


def test_lora_update_round_trips_through_the_stock_loader(family: dict, tmp_path: Path) -> None:
    from diffusers import DiffusionPipeline

    out = tmp_path / "policy"
    update(family, out)
    trained = load_file(out / LORA_WEIGHTS)
    assert max(v.abs().max().item() for k, v in trained.items() if "lora_B" in k) > 0  # it moved
    # the stock loader, given what the family loads itself (the edit families' processor, without torchvision)
    index = pipeline_index(family["model"])
    own = adapter_class(index["_class_name"], "").load_components(Path(family["model"]), set(index))
    pipe = DiffusionPipeline.from_pretrained(family["model"], **own)
    pipe.load_lora_weights(str(out), adapter_name="default")
    ours = FlowPolicy.load(family["model"], adapter=out)
    loaded = {n: p for n, p in ours.module.named_parameters() if "lora_" in n}
    stock = {n: p for n, p in getattr(pipe, ours.family.trained_module).named_parameters() if "lora_" in n}
    assert loaded.keys() == stock.keys() and len(loaded) > 0
    for name, value in loaded.items():
        assert torch.equal(value, stock[name])
    # the trained policy samples the adapter's images: a re-sample under it replays exactly
    resampled = tmp_path / "samples"
    prompts = Path(family["prompts"])
    run(
        "sample", "--model", str(family["model"]), "--adapter", str(out), "--prompts", str(prompts), "-n", "2",
        "--steps", "3", *FAMILIES[family["name"]], "--out", str(resampled),
    )  # fmt: skip
    replay = run(
        "logprob", "--model", str(family["model"]), "--adapter", str(out), "--in", str(resampled),
        "--out", str(tmp_path / "lp"),
    )  # fmt: skip
    assert replay["abs_delta_max"] == 0.0


def test_full_weights_reload(family: dict, tmp_path: Path) -> None:
    out = tmp_path / "full"
    update(family, out, "--full")
    trained = FlowPolicy.load(family["model"], adapter=out)
    base = FlowPolicy.load(family["model"])
    moved = [
        not torch.equal(p, dict(base.module.named_parameters())[n])
        for n, p in trained.module.named_parameters()
    ]
    assert any(moved)


@pytest.mark.parametrize("algo", ["flow_grpo", "dance_grpo", "mix_grpo", "grpo_guard", "nft", "awm", "dpo"])
def test_every_algorithm_trains(family: dict, tmp_path: Path, algo: str) -> None:
    inputs: tuple[str, ...] = ("samples", "logprobs", "advantages")
    if algo == "grpo_guard":
        run("logprob", "--model", str(family["model"]), "--in", str(family["samples"]), "--means",
            "--out", str(tmp_path / "means"))  # fmt: skip
        family = {**family, "means": tmp_path / "means"}
        inputs = ("samples", "advantages", "means")
    if algo == "dpo":
        inputs = ("samples", "rewards")
    result = update(family, tmp_path / "policy", "--algo", algo, inputs=inputs)
    assert result["optimizer_steps"] >= 1
    assert all(torch.isfinite(torch.tensor(v)) for v in result["last"].values() if isinstance(v, float))


def test_flow_grpo_moves_toward_high_advantage_steps(family: dict, tmp_path: Path) -> None:
    out = tmp_path / "policy"
    update(family, out, "--lr", "3e-3")
    run("logprob", "--model", str(family["model"]), "--adapter", str(out), "--in", str(family["samples"]),
        "--out", str(tmp_path / "after"))  # fmt: skip
    data = open_inputs([family["samples"], family["advantages"]]).read_all(
        columns=["log_probs", "advantages"]
    )
    new = ShardSet(tmp_path / "after").read_all()["old_log_probs"]
    assert float((data["advantages"] * (new - data["log_probs"])).mean()) > 0


@pytest.mark.distributed
def test_two_ranks_equal_one_process(family: dict, tmp_path: Path) -> None:
    common = ["--no-shuffle", "--micro-batch", "1"]
    update(family, tmp_path / "one", *common, "--grad-accum", "2")
    torchrun(
        "update", "--model", str(family["model"]),
        *ins(family["samples"], family["logprobs"], family["advantages"]), "--lora-rank", "4", "--lora-alpha",
        "8", "--lr", "1e-3", "--out", str(tmp_path / "two"), *common, "--grad-accum", "1",
    )  # fmt: skip
    one, two = load_file(tmp_path / "one" / LORA_WEIGHTS), load_file(tmp_path / "two" / LORA_WEIGHTS)
    assert one.keys() == two.keys()
    # DDP adds each rank's accumulated gradient: the same float sums in another order. Gradients and
    # losses agree to 1e-6; Adam divides by sqrt(v), so a weight whose gradient is ~0 may move by a
    # rounding's worth more: weights are compared to 1e-5.
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5)
    m1, m2 = (
        [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        for d in ("one", "two")
    )
    assert [m["step"] for m in m2] == [1, 2, 3]
    for a, b in zip(m1, m2, strict=True):
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-6)
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=1e-6, abs=1e-8)


def test_cfg_training_stops_the_gradient_at_the_unconditional_branch(family: dict) -> None:
    policy = FlowPolicy.load(family["model"])
    flags = FAMILIES[family["name"]]
    guidance = float(flags[flags.index("--guidance") + 1])
    resolution = int(flags[flags.index("--resolution") + 1])
    if not policy.needs_negative(guidance):
        pytest.skip(f"{family['name']} runs no unconditional branch at guidance {guidance}")
    policy.add_lora(rank=4, alpha=8, seed=0)
    params = policy.trainable_parameters()
    with torch.no_grad():  # LoRA B starts at 0: give the adapter a non-zero effect
        for p in params:
            p.normal_(0, 0.1)
    x = policy.initial_noise([1, 2], resolution)
    sigma = policy.sigmas(3, resolution)[1]
    sources = None
    if family["name"] in EDITING:  # each prompt's source, as prompt_table wrote it
        sources = [[(Path(family["root"]) / f"source{i}.png").read_bytes()] for i in range(2)]
    cond = policy.encode(PROMPTS[:2], None, True, images=sources)

    def grads(detach: bool, g: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        policy.family.detach_uncond = detach
        v = policy.velocity(x, sigma, cond, g)
        # a loss on v's direction too (Qwen-Image rescales v to ‖c‖ per token, so mean v² only sees c);
        # allow_unused: a LoRA target may not reach the output (Qwen-Image's last text-stream block)
        grad = torch.autograd.grad((v - x).square().mean(), params, allow_unused=True)
        return v.detach(), [torch.zeros_like(p) if d is None else d for p, d in zip(params, grad)]

    v_detached, g_detached = grads(True, guidance)
    v_both, g_both = grads(False, guidance)
    assert torch.equal(v_detached, v_both)  # the forward is the same
    assert any(not torch.allclose(a, b) for a, b in zip(g_detached, g_both))
    if family["name"] != "sd3":
        return
    # plain CFG v = u + w(c − u) with u detached: d v = w · d c, so the gradient is that of the same
    # loss through a conditional-only forward, scaled by w, with v held at the guided value
    policy.family.detach_uncond = False
    v_cond = policy.velocity(x, sigma, cond, 1.0)
    expect = torch.autograd.grad((2 * guidance * (v_detached - x) * v_cond).mean(), params)
    for a, b in zip(g_detached, expect):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_offline_pairs_train_at_the_familys_own_unguided_setting(family: dict, tmp_path: Path) -> None:
    if family["name"] in EDITING:
        pytest.skip("preference pair tables carry no source images for an editing model")
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = ShardSet(family["samples"]).read_all(["image"])["image"]
    rows = [
        {"caption": p, "jpg_0": images[2 * i], "jpg_1": images[2 * i + 1], "label_0": 1.0}
        for i, p in enumerate(PROMPTS)
    ]
    table = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), table)
    run("pairs", "--pairs", str(table), "--out", str(tmp_path / "pairs"))
    run("encode", "--model", str(family["model"]), "--in", str(tmp_path / "pairs"), "--resolution", "32",
        "--out", str(tmp_path / "latents"))  # fmt: skip
    result = run(
        "update", "--model", str(family["model"]), *ins(tmp_path / "pairs", tmp_path / "latents"), "--algo", "dpo",
        "--lora-rank", "4", "--lora-alpha", "8", "--out", str(tmp_path / "policy"),
    )  # fmt: skip
    assert result["optimizer_steps"] >= 1
    assert all(math.isfinite(v) for v in result["last"].values() if isinstance(v, float))
    # `encode` stored the pairs' prompt conditioning: the update loads no text encoder, tokenizer or VAE
    assert result["conditioning"] == "stored" and result["loaded_components"] == ["scheduler", "transformer"]
    policy = FlowPolicy.load(family["model"])
    # the unguided setting runs no negative branch in any family (offline pairs carry no negatives)
    assert not policy.needs_negative(policy.family.default_guidance)


def test_a_pipeline_without_an_adapter_names_the_supported_families(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    (tmp_path / "p.txt").write_text("a red apple\n")
    line = fails(
        [
            "sample",
            "--model",
            str(tmp_path),
            "--prompts",
            str(tmp_path / "p.txt"),
            "--out",
            str(tmp_path / "o"),
        ],
        "StableDiffusionXLPipeline has no family adapter",
        "omnirl.families",
    )
    for pipeline in ("FluxPipeline", "QwenImagePipeline", "StableDiffusion3Pipeline", "ZImagePipeline"):
        assert pipeline in line
