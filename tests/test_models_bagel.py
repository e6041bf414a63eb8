"""BAGEL (stages/models/bagel_model.py and bagel_folder.py): the tiny build's released layout, and its generation velocity,
guidance and understanding logits against ByteDance-Seed's reference implementation on the same
weights, in fp32 (tests/bagel_reference.py says how the reference runs here)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from bagel_reference import reference_model
from safetensors.torch import load_file

from stages.errors import UserInputError
from stages.models import bagel_folder, bagel_model
from stages.models.factory import init_model

# fp32 on both sides; what differs is the order of the sums (SDPA on padded batches vs per-sequence
# attention, fused vs unfused projections), a few ulps through the layers.
ATOL = 2e-5


@pytest.fixture(scope="module")
def tiny_bagel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "bagel-tiny"
    init_model("bagel", out, size="tiny", seed=0)
    return out


@pytest.fixture(scope="module")
def ours(tiny_bagel: Path) -> tuple[bagel_model.Bagel, object]:
    return bagel_folder.load_bagel(tiny_bagel)


@pytest.fixture(scope="module")
def reference(tiny_bagel: Path, ours: tuple[bagel_model.Bagel, object]) -> dict:
    model, weights = reference_model(tiny_bagel)
    fresh_tables = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("pos_embed.pos_embed")}
    model.load_state_dict(weights, strict=True)
    model.language_model.model.enable_taylorseer = False  # as its generate_image sets it before _forward_flow
    tokenizer = ours[1]
    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("bos_token_id", bagel_folder.BOS),
            ("eos_token_id", bagel_folder.EOS),
            ("start_of_image", bagel_folder.IMAGE_START),
            ("end_of_image", bagel_folder.IMAGE_END),
        )
    }
    return {"model": model.eval(), "tables": fresh_tables, "token_ids": ids, "tokenizer": tokenizer}


def test_the_tiny_build_has_the_released_layout(
    tiny_bagel: Path, ours: tuple[bagel_model.Bagel, object]
) -> None:
    """The folder holds the released files, ema.safetensors names every parameter under the released
    names (both experts), and ae.safetensors is in Black Forest Labs' layout, read back by the loader."""
    names = {p.name for p in tiny_bagel.iterdir()}
    assert {
        "llm_config.json",
        "vit_config.json",
        "ema.safetensors",
        "ae.safetensors",
        "tokenizer.json",
    } <= names
    weights = load_file(tiny_bagel / "ema.safetensors")
    for name in (
        "language_model.model.layers.1.self_attn.q_proj_moe_gen.bias",
        "language_model.model.layers.1.self_attn.k_norm_moe_gen.weight",
        "language_model.model.layers.0.mlp_moe_gen.down_proj.weight",
        "language_model.model.layers.0.post_attention_layernorm_moe_gen.weight",
        "language_model.model.norm_moe_gen.weight",
        "language_model.lm_head.weight",
        "time_embedder.mlp.2.weight",
        "vae2llm.weight",
        "llm2vae.bias",
        "latent_pos_embed.pos_embed",
        "vit_model.vision_model.embeddings.patch_embedding.weight",
        "vit_model.vision_model.encoder.layers.1.self_attn.out_proj.weight",
        "connector.fc2.weight",
        "vit_pos_embed.pos_embed",
    ):
        assert name in weights, name
    vit = json.loads((tiny_bagel / "vit_config.json").read_text())
    # the config counts the ViT layer the model drops; the linear patch embedding is 3·14·14 wide
    assert (
        "vit_model.vision_model.encoder.layers.2.mlp.fc1.weight" not in weights
        and vit["num_hidden_layers"] == 3
    )
    assert weights["vit_model.vision_model.embeddings.patch_embedding.weight"].shape == (32, 3 * 14 * 14)
    assert weights["vae2llm.weight"].shape == (64, 2 * 2 * 16)
    ae = load_file(tiny_bagel / "ae.safetensors")
    assert "encoder.down.0.block.0.conv1.weight" in ae and "decoder.mid.attn_1.q.weight" in ae
    vae = bagel_folder.load_autoencoder(tiny_bagel)
    assert vae.config.latent_channels == 16 and vae.config.scaling_factor == bagel_folder.AE_SCALE
    model, _ = ours
    assert model.config.max_latent_size == 8 and model.config.vit_max_patches_per_side == 4


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        ("llm2vae.bias", r"ema.safetensors: lacks llm2vae.bias \(1 missing, 0 unexpected"),
        ("latent_pos_embed.pos_embed", r"ema.safetensors: lacks latent_pos_embed.pos_embed; pass a BAGEL"),
    ],
)
def test_a_folder_missing_a_weight_is_one_line(
    tiny_bagel: Path, tmp_path: Path, weight: str, message: str
) -> None:
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for path in tiny_bagel.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    weights = load_file(broken / "ema.safetensors")
    del weights["llm2vae.bias"]
    save_file(weights, broken / "ema.safetensors")
    with pytest.raises(
        UserInputError, match=r"ema.safetensors: lacks llm2vae.bias \(1 missing, 0 unexpected"
    ):
        bagel_folder.load_bagel(broken)


def test_position_tables_equal_the_reference(reference: dict, ours: tuple[bagel_model.Bagel, object]) -> None:
    """The sin-cos tables the reference computes at construction are the ones we compute (and save)."""
    model, _ = ours
    assert torch.equal(reference["tables"]["latent_pos_embed.pos_embed"], model.latent_pos_embed.pos_embed)
    assert torch.equal(reference["tables"]["vit_pos_embed.pos_embed"], model.vit_pos_embed.pos_embed)


def _reference_context(ref: dict, prompt: str | None) -> dict:
    """The reference's context of one prompt (None: the empty one the text-CFG branch uses)."""
    from modeling.bagel.qwen2_navit import NaiveCache

    model = ref["model"]
    context = {"kv_lens": [0], "ropes": [0], "cache": NaiveCache(model.config.llm_config.num_hidden_layers)}
    if prompt is not None:
        inputs, context["kv_lens"], context["ropes"] = model.prepare_prompts(
            [0], [0], [prompt], ref["tokenizer"], ref["token_ids"]
        )
        context["cache"] = model.forward_cache_update_text(context["cache"], **inputs)
    return context


def _reference_generation(ref: dict, prompt: str) -> dict:
    """The reference's inputs of generating a 64×64 px image (a 4×4 patch grid) for `prompt`, as its
    text-to-image inference sets them up: text CFG against the empty context, image CFG against the
    prompt's own context (no input image)."""
    model = ref["model"]
    main, empty = _reference_context(ref, prompt), _reference_context(ref, None)
    inputs = model.prepare_vae_latent(main["kv_lens"], main["ropes"], [(64, 64)], ref["token_ids"])
    inputs["past_key_values"] = main["cache"]
    for name, context in (("text", empty), ("img", main)):
        cfg = model.prepare_vae_latent_cfg(context["kv_lens"], context["ropes"], [(64, 64)])
        inputs.update({f"cfg_{name}_{key.removeprefix('cfg_')}": value for key, value in cfg.items()})
        inputs[f"cfg_{name}_past_key_values"] = context["cache"]
    return inputs


def _reference_velocity(
    ref: dict, x: torch.Tensor, sigma: float, prompt: str, text_scale: float = 1.0, image_scale: float = 1.0
) -> torch.Tensor:
    """The reference's `_forward_flow` for latent tokens x [16, 64] at σ."""
    inputs = _reference_generation(ref, prompt)
    inputs.pop("packed_init_noises")
    return ref["model"]._forward_flow(
        x_t=x,
        timestep=torch.full((x.shape[0],), sigma),
        cfg_text_scale=text_scale,
        cfg_img_scale=image_scale,
        cfg_renorm_min=0.0,
        cfg_renorm_type="global",
        **inputs,
    )


PROMPTS = ("a red cat on a blue mat", "two dogs")


@torch.no_grad()
def test_generation_velocity_equals_the_reference(
    reference: dict, ours: tuple[bagel_model.Bagel, object]
) -> None:
    """A batch of two prompts of different lengths (padded contexts) gives each the reference's velocity."""
    model, tokenizer = ours
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    context = model.encode_context([bagel_folder.prompt_ids(tokenizer, model.config, p) for p in PROMPTS])
    ours_v = model.velocity(x, torch.tensor([0.8, 0.8]), context, (4, 4))
    for row, prompt in enumerate(PROMPTS):
        expected = _reference_velocity(reference, x[row], 0.8, prompt)
        assert expected.abs().mean() > 0.05  # a real signal, not a zero head
        torch.testing.assert_close(ours_v[row], expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_guided_velocity_equals_the_reference(
    reference: dict, ours: tuple[bagel_model.Bagel, object]
) -> None:
    """BAGEL's text + image CFG with global renorm (scales 4 and 1.5, its text-to-image defaults)."""
    model, tokenizer = ours
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(2))
    prompt = PROMPTS[0]
    sigma = torch.tensor([0.6])
    cond = model.velocity(
        x, sigma, model.encode_context([bagel_folder.prompt_ids(tokenizer, model.config, prompt)]), (4, 4)
    )
    uncond = model.velocity(x, sigma, model.encode_context([[]]), (4, 4))
    guided = bagel_model.cfg_velocity(
        cond[0], uncond[0], cond[0], bagel_model.CFG_TEXT, bagel_model.CFG_IMAGE
    )
    expected = _reference_velocity(reference, x[0], 0.6, prompt, bagel_model.CFG_TEXT, bagel_model.CFG_IMAGE)
    assert not torch.allclose(expected, _reference_velocity(reference, x[0], 0.6, prompt), atol=1e-3)
    torch.testing.assert_close(guided, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_understanding_logits_equal_the_reference(
    reference: dict, ours: tuple[bagel_model.Bagel, object]
) -> None:
    """An image (28×42 px: 2×3 ViT patches) then a question: every text token's next-token logits."""
    from modeling.bagel.qwen2_navit import NaiveCache

    model, tokenizer = ours
    image = torch.rand(3, 28, 42, generator=torch.Generator().manual_seed(3)) * 2 - 1
    question = "what color is the cat"
    ref = reference["model"]
    cache = NaiveCache(ref.config.llm_config.num_hidden_layers)
    inputs, kv_lens, ropes = ref.prepare_vit_images(
        [0], [0], [image], lambda picture: picture, reference["token_ids"]
    )
    cache = ref.forward_cache_update_vit(cache, **inputs)
    text, _, _ = ref.prepare_prompts(kv_lens, ropes, [question], tokenizer, reference["token_ids"])
    output = ref.language_model.forward_inference(
        packed_query_sequence=ref.language_model.model.embed_tokens(text["packed_text_ids"]),
        query_lens=text["text_token_lens"],
        packed_query_position_ids=text["packed_text_position_ids"],
        packed_query_indexes=text["packed_text_indexes"],
        past_key_values=cache,
        key_values_lens=text["key_values_lens"],
        packed_key_value_indexes=text["packed_key_value_indexes"],
        update_past_key_values=True,
        is_causal=True,
        mode="und",
    )
    expected = ref.language_model.lm_head(output.packed_query_sequence)
    ids = torch.tensor(bagel_folder.prompt_ids(tokenizer, model.config, question))
    logits = model.understanding_logits([image, ids])
    assert logits.shape == expected.shape == (len(ids), len(tokenizer))
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_text_to_image_sampling_equals_the_reference(
    reference: dict, ours: tuple[bagel_model.Bagel, object]
) -> None:
    """Sampling from the same noise: our σ schedule, guided velocity and the shared Euler step
    (`samplers.step`, the one `sample`, `logprob` and `update` use) end where the reference's
    `generate_image` ends (9 σ points shifted by 3, CFG 4 / 1.5 only for σ in (0.4, 1]: the last step,
    from σ = 0.3, runs unguided)."""
    from stages.sample.samplers import step

    model, tokenizer = ours
    prompt, steps = PROMPTS[1], 8
    noise = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(4))
    context = model.encode_context([bagel_folder.prompt_ids(tokenizer, model.config, prompt)])
    empty = model.encode_context([[]])
    sigmas = bagel_model.sigmas(steps)
    x = noise
    for sigma, sigma_next in itertools.pairwise(sigmas):
        v = model.guided_velocity(x, sigma.expand(1), context, empty, (4, 4))
        x = step("ode", v, x, sigma, sigma_next, noise_level=0.0).prev_sample

    inputs = _reference_generation(reference, prompt)
    inputs["packed_init_noises"] = noise[0]
    (expected,) = reference["model"].generate_image(
        num_timesteps=steps + 1,
        timestep_shift=bagel_model.TIMESTEP_SHIFT,
        cfg_text_scale=bagel_model.CFG_TEXT,
        cfg_img_scale=bagel_model.CFG_IMAGE,
        cfg_interval=bagel_model.CFG_INTERVAL,
        cfg_renorm_min=0.0,
        cfg_renorm_type="global",
        **inputs,
    )
    assert (expected - noise[0]).abs().mean() > 0.05  # it moved
    torch.testing.assert_close(x[0], expected, atol=ATOL, rtol=0)


def test_the_full_size_is_bagel_7b_mot() -> None:
    """The full size (on the meta device) has Qwen2.5-7B's 7.62B parameters as its understanding expert
    with the embeddings, a generation expert as large as its layers and final norm (6.53B, so 14.1B in
    the language model: BAGEL's "7B active, 14B total")."""
    with torch.device("meta"):
        model = bagel_folder.make_bagel("full", 0)
    named = dict(model.language_model.named_parameters())
    total = sum(p.numel() for p in named.values())
    gen = sum(p.numel() for n, p in named.items() if "_moe_gen" in n)
    shared = sum(named[n].numel() for n in ("model.embed_tokens.weight", "lm_head.weight"))
    assert total - gen == pytest.approx(7.616e9, rel=1e-3)  # Qwen2.5-7B
    assert gen == total - gen - shared
