"""BAGEL's generation through the stages: `sample` with BAGEL's CFG, exact `logprob` replay, `update
--algo flow_grpo` with LoRA on the generation expert, and that LoRA saved as a PEFT folder and loaded back
(by omnirl and by PEFT itself) to the same numbers. The model itself is compared with the reference in
tests/test_models_bagel.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import fails, ins, run, torchrun
from safetensors.torch import load_file

from stages.models import bagel_folder, bagel_layers
from stages.models.diffusion import FlowPolicy
from stages.models.folders import PEFT_CONFIG, PEFT_PREFIX, PEFT_WEIGHTS
from stages.sample.rollout import SampleConfig, rollout_batch
from stages.shards import ShardSet

PROMPTS = ["a red cube", "a blue sky over a green field"]
SIDE = 16  # px: the tiny autoencoder halves it, 2×2 patches make a 4×4 token grid


def sample(model: Path, prompts: Path, out: Path, *extra: str) -> dict:
    return run(
        "sample", "--model", str(model), "--prompts", str(prompts), "-n", "2", "--steps", "4",
        "--resolution", str(SIDE), "--guidance", "4", "--batch-size", "4", "--out", str(out), *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny BAGEL folder, a rollout with CFG 4 (SDE, every step stored), its replay, rewards and advantages."""
    from stages.models.factory import init_model

    root = tmp_path_factory.mktemp("bagel-run")
    model = root / "bagel-tiny"
    init_model("bagel", model, size="tiny", seed=0)
    prompts = root / "prompts.csv"
    prompts.write_text("prompt\n" + "\n".join(PROMPTS) + "\n")
    sample(model, prompts, root / "samples")
    replay = run(
        "logprob", "--model", str(model), "--in", str(root / "samples"), "--out", str(root / "logprobs")
    )
    run(
        "score",
        "--in",
        str(root / "samples"),
        "--reward",
        "jpeg_compressibility",
        "--out",
        str(root / "rewards"),
    )
    run("advantage", *ins(root / "samples", root / "rewards"), "--out", str(root / "advantages"))
    paths = {k: root / k for k in ("samples", "logprobs", "rewards", "advantages")}
    return {"model": model, "prompts": prompts, "replay": replay, **paths}


def test_rollout_replays_exactly_from_the_stored_context(staged: dict) -> None:
    replay = staged["replay"]
    assert replay["rows"] == 4 and replay["abs_delta_count"] == 16  # 4 samples × 4 stored steps
    assert replay["abs_delta_max"] == 0.0
    samples = ShardSet(staged["samples"])
    assert samples.columns["latents"].shape == (5, 16, 8, 8)  # [K+1, C, H/2, W/2]
    # the prompts' keys/values were stored once and replay read them (no VAE, no re-encoding)
    assert samples.manifest.extra["conditioning"]["identity"]["pipeline"] == "Bagel"
    assert replay["conditioning"] == "stored" and "vae" not in replay["loaded_components"]


def test_the_policy_velocity_is_bagels_guided_velocity(staged: dict) -> None:
    """Through the stages (padded batch, stored layout) each sample's velocity is `guided_velocity` of that
    prompt alone against the empty context: CFG inside σ ∈ (0.4, 1], the conditional velocity outside."""
    policy = FlowPolicy.load(staged["model"])
    model, tokenizer = policy.pipe.transformer, policy.pipe.tokenizer
    cond = policy.encode(PROMPTS, None, cfg=True)
    x = policy.initial_noise([1, 2], SIDE)
    empty = model.encode_context([[]])
    for sigma, guided in ((0.9, True), (0.3, False)):
        ours = policy.velocity(x, torch.tensor(sigma), cond, 4.0)
        for row, prompt in enumerate(PROMPTS):
            tokens = bagel_layers.pack_latents(x[row : row + 1])
            context = model.encode_context([bagel_folder.prompt_ids(tokenizer, model.config, prompt)])
            s = torch.tensor([sigma])
            theirs = bagel_layers.unpack_latents(
                model.guided_velocity(tokens, s, context, empty, (4, 4), 4.0), 4, 4
            )
            plain = bagel_layers.unpack_latents(model.velocity(tokens, s, context, (4, 4)), 4, 4)
            torch.testing.assert_close(ours[row : row + 1], theirs, rtol=0, atol=1e-6)
            assert ((theirs - plain).abs().max().item() > 1e-3) is guided


def test_the_decoder_alone_decodes_as_the_policy(staged: dict) -> None:
    """`score` of a --defer-decode rollout loads the autoencoder alone (`load_decoder`): the same pixels."""
    import numpy as np

    from stages.models.diffusion import load_decoder

    latents = ShardSet(staged["samples"]).read_all(columns=["final_latent"])["final_latent"][:2]
    decoder = load_decoder(staged["model"])
    assert decoder.pipe.transformer is None and decoder.pipe.vae is not None
    theirs = FlowPolicy.load(staged["model"]).decode(latents)
    for a, b in zip(decoder.decode(latents), theirs, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b)) and a.size == (SIDE, SIDE)


@pytest.fixture(scope="module")
def trained(staged: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("bagel-policy") / "policy"
    result = run(
        "update", "--model", str(staged["model"]), *ins(*(staged[k] for k in ("samples", "logprobs", "advantages"))),
        "--algo", "flow_grpo", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-3", "--out", str(out),
    )  # fmt: skip
    return out, result


def test_flow_grpo_trains_a_lora_on_the_generation_expert_only(trained: tuple[Path, dict]) -> None:
    out, result = trained
    assert result["optimizer_steps"] >= 1 and result["step_means"]["ratio_mean"] == 1.0
    assert "vae" not in result["loaded_components"]
    weights = load_file(out / PEFT_WEIGHTS)
    # 2 layers × (q, k, v, o of the generation expert + its gate, up, down) × (A, B)
    assert len(weights) == 2 * 7 * 2
    assert all(k.startswith(PEFT_PREFIX) and "_moe_gen" in k for k in weights)
    assert min(v.abs().max().item() for k, v in weights.items() if "lora_B" in k) > 0  # every layer moved
    assert (out / PEFT_CONFIG).is_file()


@pytest.mark.parametrize("algo", ["dance_grpo", "mix_grpo", "nft", "awm", "dpo"])
def test_the_other_algorithms_train_it(staged: dict, tmp_path: Path, algo: str) -> None:
    inputs = ("samples", "rewards") if algo == "dpo" else ("samples", "logprobs", "advantages")
    result = run(
        "update", "--model", str(staged["model"]), *ins(*(staged[k] for k in inputs)), "--algo", algo,
        "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-3", "--out", str(tmp_path / "policy"),
    )  # fmt: skip
    assert result["optimizer_steps"] >= 1
    weights = load_file(tmp_path / "policy" / PEFT_WEIGHTS)
    assert max(v.abs().max().item() for k, v in weights.items() if "lora_B" in k) > 0


def test_the_lora_round_trips_through_omnirl_and_peft(
    staged: dict, trained: tuple[Path, dict], tmp_path: Path
) -> None:
    """The saved LoRA loads back with the same tensors, gives PEFT's own `PeftModel.from_pretrained` samples
    bit for bit, a rollout under it replays exactly and differs from the base model's, and it exports."""
    from peft import PeftModel

    out, _ = trained
    ours = FlowPolicy.load(staged["model"], adapter=out)
    saved = load_file(out / PEFT_WEIGHTS)
    loaded = {
        PEFT_PREFIX + n.replace(".default", ""): p for n, p in ours.module.named_parameters() if "lora_" in n
    }
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())

    stock = PeftModel.from_pretrained(bagel_folder.load_bagel(staged["model"])[0], str(out)).base_model.model
    cfg = SampleConfig(steps=4, guidance=4.0, resolution=SIDE, sampler="ode", batch_size=2)

    def final(policy: FlowPolicy) -> torch.Tensor:
        args = (PROMPTS, ["", ""], [1, 2], [1, 2])
        return rollout_batch(policy, cfg, *args, groups=[0, 1], sample_ids=["a", "b"])["final_latent"]

    mine = final(ours)
    ours.pipe.transformer = ours.transformer = stock
    assert torch.equal(final(ours), mine)
    assert (final(FlowPolicy.load(staged["model"])) - mine).abs().max().item() > 0

    sample(staged["model"], staged["prompts"], tmp_path / "samples", "--adapter", str(out))
    replay = run(
        "logprob", "--model", str(staged["model"]), "--adapter", str(out),
        "--in", str(tmp_path / "samples"), "--out", str(tmp_path / "logprobs"),
    )  # fmt: skip
    assert replay["abs_delta_max"] == 0.0 and replay["rows"] == 4

    # `export` merges it into a released-layout BAGEL folder that samples as the adapter does
    merged = tmp_path / "merged"
    assert run("export", str(out), "--out", str(merged))["merged_layers"] == 14
    torch.testing.assert_close(final(FlowPolicy.load(merged)), mine, rtol=0, atol=1e-5)


def test_online_trains_a_generation_expert_lora(staged: dict, tmp_path: Path) -> None:
    """`online` runs the same stages fused: one iteration writes a moved generation-expert LoRA that loads."""
    config = tmp_path / "bagel.yaml"
    config.write_text(
        "sample: {steps: 4, guidance: 4.0, resolution: 16, group_size: 2, num_prompts: 2, batch_size: 4}\n"
        "score: {reward: [jpeg_compressibility]}\n"
        "update: {algo: flow_grpo, lora_rank: 4, lora_alpha: 8, lr: 1.0e-3}\n"
    )
    out = tmp_path / "run"
    run("online", "--config", str(config), "--model", str(staged["model"]), "--prompts", str(staged["prompts"]),
        "--iterations", "1", "--out", str(out))  # fmt: skip
    weights = load_file(out / "it1" / "policy" / PEFT_WEIGHTS)
    assert len(weights) == 28 and all("_moe_gen" in k for k in weights)
    assert max(v.abs().max().item() for k, v in weights.items() if "lora_B" in k) > 0
    assert FlowPolicy.load(staged["model"], adapter=out / "it1" / "policy").lora


@pytest.mark.distributed
def test_two_ranks_equal_one_process(staged: dict, tmp_path: Path) -> None:
    """flow_grpo on 2 gloo ranks (DDP reaches `Bagel.forward`) trains the LoRA one process trains with
    twice the accumulation (tolerances as tests/test_families.py's, for the same reason)."""
    inputs = ins(*(staged[k] for k in ("samples", "logprobs", "advantages")))
    common = [
        "--model",
        str(staged["model"]),
        *inputs,
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--lr",
        "1e-3",
    ]
    common += ["--no-shuffle", "--micro-batch", "1"]
    run("update", *common, "--grad-accum", "2", "--out", str(tmp_path / "one"))
    torchrun("update", *common, "--grad-accum", "1", "--out", str(tmp_path / "two"))
    one, two = (load_file(tmp_path / d / PEFT_WEIGHTS) for d in ("one", "two"))
    assert one.keys() == two.keys() and len(one) == 28
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5)
    m1, m2 = (
        [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        for d in ("one", "two")
    )
    assert len(m1) == len(m2) >= 1
    for a, b in zip(m1, m2, strict=True):
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-6)


def test_bad_inputs_are_one_line(staged: dict, tmp_path: Path) -> None:
    model, prompts = staged["model"], staged["prompts"]
    base = ["sample", "--model", str(model), "--prompts", str(prompts), "--steps", "2", "--out"]
    fails([*base, str(tmp_path / "a"), "--resolution", "18"], "--resolution 18", "multiple of 4")
    fails([*base, str(tmp_path / "b"), "--resolution", "64"], "--resolution 64", "at most 32")
    fails(
        ["update", "--model", str(model), *ins(*(staged[k] for k in ("samples", "logprobs", "advantages"))),
         "--full", "--out", str(tmp_path / "c")],
        "--full", "bagel", "_moe_gen",
    )  # fmt: skip
    broken = tmp_path / "no-weights"
    shutil.copytree(model, broken, ignore=shutil.ignore_patterns(bagel_folder.WEIGHTS))
    fails([*base, str(tmp_path / "d"), "--model", str(broken)], "ema.safetensors", "missing")
