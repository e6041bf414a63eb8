"""`omnirl plan` for BAGEL: the released size counted by hand from its published configs, a folder planned as
its family's size, the stages' terms and the one-line refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.models.factory import init_model
from stages.models.plan import ACTIVATION_ELEMENTS_PER_HIDDEN, DECODE_WIDTHS, PlanConfig, plan
from stages.models.plan_arch import from_family, from_folder
from tests.helpers import fails, run

# BAGEL-7B-MoT's released llm_config.json and vit_config.json (the model uses one ViT layer fewer), the
# FLUX.1 VAE's 16 latent channels in 2×2 patches, and its position tables (64² latent patches, 70² ViT)
HIDDEN, LAYERS, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 3584, 28, 18944, 28, 4, 152064
VIT_HIDDEN, VIT_INTERMEDIATE, VIT_LAYERS, VIT_PATCH, VIT_IMAGE = 1152, 4304, 27, 14, 980
PATCH_VALUES, LATENT_SIDE, TIMESTEP_FREQUENCIES = 4 * 16, 64, 256


def linear(inputs: int, outputs: int, bias: bool = True) -> int:
    return inputs * outputs + (outputs if bias else 0)


def expert_layer() -> int:
    """One expert of one layer: q/k/v (biased) and o projections, q/k norms, the gated MLP, two RMS norms."""
    head, kv = HIDDEN // HEADS, KV_HEADS * HIDDEN // HEADS
    attention = linear(HIDDEN, HIDDEN) + 2 * linear(HIDDEN, kv) + linear(HIDDEN, HIDDEN, bias=False)
    return attention + 2 * head + 3 * linear(HIDDEN, INTERMEDIATE, bias=False) + 2 * HIDDEN


def expert() -> int:
    """One expert: its half of every layer and its final norm."""
    return LAYERS * expert_layer() + HIDDEN


def embeddings_and_head() -> int:
    return 2 * VOCAB * HIDDEN  # untied


def hand_count() -> int:
    """The whole model: both experts of every layer, the embeddings and head, the ViT, connector, timestep
    embedder, latent projections and the two sin-cos tables (stored in ema.safetensors)."""
    language = 2 * expert() + embeddings_and_head()
    v = VIT_HIDDEN
    vit_layer = 4 * linear(v, v) + linear(v, VIT_INTERMEDIATE) + linear(VIT_INTERMEDIATE, v) + 2 * 2 * v
    grid = VIT_IMAGE // VIT_PATCH
    vit = linear(3 * VIT_PATCH**2, v) + grid**2 * v + (VIT_LAYERS - 1) * vit_layer + 2 * v
    connector = linear(v, HIDDEN) + linear(HIDDEN, HIDDEN)
    timestep = linear(TIMESTEP_FREQUENCIES, HIDDEN) + linear(HIDDEN, HIDDEN)
    latent = linear(PATCH_VALUES, HIDDEN) + linear(HIDDEN, PATCH_VALUES)
    tables = (LATENT_SIDE**2 + grid**2) * HIDDEN
    return language + vit + connector + timestep + latent + tables


@pytest.fixture(scope="module")
def full_plan() -> dict:
    return plan(from_family("bagel", "full"), PlanConfig(dtype="bf16", guidance=4.0, batch_size=2))


def test_the_released_size_is_the_hand_count_of_its_configs(full_plan: dict) -> None:
    """14.6 B in all, 14.1 B of them the language model (the "14B total"); one expert with the embeddings
    and head is Qwen2.5-7B (7.61 B published, the "7B active")."""
    assert full_plan["parameters"]["transformer"] == hand_count() == 14_607_260_128
    experts = full_plan["experts"]
    assert experts["understanding"] == experts["generation"] == expert()
    assert experts["active"] == hand_count() - expert()
    assert 2 * expert() + embeddings_and_head() == pytest.approx(14.14e9, rel=1e-3)
    assert expert() + embeddings_and_head() == pytest.approx(7.61e9, rel=0.01)


def test_the_stages_terms_add_up_at_1024_px(full_plan: dict) -> None:
    """LoRA rank 32 on the generation expert's seven projections per layer; (1024/16)² = 4096 latent tokens
    + 128 prompt tokens through 28 layers of width 3584 in bf16, two CFG branches; the FLUX VAE decodes
    the batch at full resolution (its output conv is 128 wide)."""
    kv = KV_HEADS * HIDDEN // HEADS
    # r·(in + out) of q and o (h→h), k and v (h→kv), gate, up and down (h↔intermediate)
    lora = 32 * LAYERS * (2 * 2 * HIDDEN + 2 * (HIDDEN + kv) + 3 * (HIDDEN + INTERMEDIATE))
    act = full_plan["activations"]
    assert (act["latent_tokens"], act["text_tokens"], act["blocks"], act["hidden"]) == (4096, 128, 28, 3584)
    per_block = ACTIVATION_ELEMENTS_PER_HIDDEN * (4096 + 128) * HIDDEN * 2
    assert act["per_block_per_sample"] == per_block
    assert act["vae_decode"] == DECODE_WIDTHS * 128 * 1024 * 1024 * 2 * 2
    stages = full_plan["stages"]
    weights = 2 * hand_count()
    assert stages["sample"]["weights"] == {"transformer": weights, "vae": 2 * full_plan["parameters"]["vae"]}
    assert stages["sample"]["activations"] == max(per_block * 2 * 2, act["vae_decode"])
    assert stages["logprob"]["weights"] == {"transformer": weights}
    assert stages["logprob"]["activations"] == per_block * 2 * 2
    update = stages["update"]
    assert update["trainable_parameters"] == lora == 80_740_352
    assert update["weights"] == {"transformer": weights, "lora": 4 * lora}
    assert (update["gradients"], update["optimizer"]) == (4 * lora, 8 * lora)
    assert update["activations"] == LAYERS * per_block * 2 * 2
    for stage in stages.values():
        terms = ("gradients", "optimizer", "ddp_buckets", "gathered", "activations", "runtime")
        assert stage["total"] == sum(stage["weights"].values()) + sum(stage[t] for t in terms)
    assert stages["online"]["total"] == stages["sample"]["total"] + update["total"]


@pytest.fixture(scope="module")
def tiny_bagel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "bagel-tiny"
    init_model("bagel", out, size="tiny", seed=0)
    return out


def test_a_folder_plans_as_its_familys_size_and_lora_as_the_trainer_wraps(tiny_bagel: Path) -> None:
    from stages.models.diffusion import FlowPolicy

    settings = PlanConfig(lora_rank=4, batch_size=2)
    folder = plan(from_folder(tiny_bagel), settings)
    family = plan(from_family("bagel", "tiny"), settings)
    assert {**folder, "model": None} == {**family, "model": None}
    assert folder["settings"]["resolution"] == [32, 32]  # the card's side: the whole position table
    policy = FlowPolicy.load(tiny_bagel)
    assert folder["parameters"]["transformer"] == sum(p.numel() for p in policy.transformer.parameters())
    assert folder["parameters"]["vae"] == sum(p.numel() for p in policy.pipe.vae.parameters())
    policy.add_lora(rank=4, alpha=8)
    assert folder["stages"]["update"]["trainable_parameters"] == sum(
        p.numel() for p in policy.trainable_parameters()
    )
    shown = run("plan", "--model", str(tiny_bagel), "--resolution", "16")
    assert shown["activations"]["latent_tokens"] == 16  # 16 px, VAE factor 2: an 8×8 latent in 2×2 patches


def test_the_refusals_are_one_line(tiny_bagel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fails(["plan", "--family", "bagel", "--size", "tiny", "--full"], "--full", "bagel", "--lora-rank")
    fails(["plan", "--model", str(tiny_bagel), "--resolution", "64"], "--resolution 64", "32")
    broken = tmp_path / "bagel"
    broken.mkdir()
    for path in tiny_bagel.iterdir():
        if path.name != "ae.safetensors":
            (broken / path.name).write_bytes(path.read_bytes())
    fails(["plan", "--model", str(broken)], str(broken / "ae.safetensors"))
    from stages.models import plan_arch

    monkeypatch.setattr(plan_arch, "NATIVE_PIPELINES", {})
    fails(["plan", "--family", "bagel", "--size", "tiny"], "--family bagel", "does not count")


def test_understanding_plans_the_vlm_policy(tiny_bagel: Path) -> None:
    """--understand: the whole model as `VLMPolicy` loads it (no VAE), LoRA on both experts' projections as
    it wraps them, --text-tokens through the language model's layers, no CFG branch; a folder as its size."""
    from stages.models.vlm import VLMPolicy

    settings = PlanConfig(understand=True, lora_rank=4, text_tokens=100, batch_size=3)
    folder = plan(from_folder(tiny_bagel, understand=True), settings)
    family = plan(from_family("bagel", "tiny", understand=True), settings)
    assert {**folder, "model": None} == {**family, "model": None}
    policy = VLMPolicy.load(tiny_bagel)
    network = sum(p.numel() for p in policy.model.parameters())
    assert sum(folder["parameters"].values()) == network
    assert folder["stages"]["sample"]["weights"] == {"model": 4 * network}
    policy.add_lora(rank=4, alpha=8)
    lora = sum(p.numel() for p in policy.trainable_parameters())
    update = folder["stages"]["update"]
    assert update["trainable_parameters"] == lora
    assert update["weights"] == {"model": 4 * network, "lora": 4 * lora}
    act = folder["activations"]
    assert (act["latent_tokens"], act["sequence"], act["blocks"], act["hidden"], act["cfg_branches"]) == (
        0,
        100,
        2,
        64,
        1,
    )
    assert update["activations"] == 2 * ACTIVATION_ELEMENTS_PER_HIDDEN * 100 * 64 * 4 * 3
    assert folder["experts"] == plan(from_family("bagel", "tiny"), PlanConfig())["experts"]
    fails(["plan", "--model", str(tiny_bagel), "--understand", "--full"], "--full", "--lora-rank")
    fails(["plan", "--family", "sd3", "--size", "tiny", "--understand"], "--understand", "sd3/tiny")
