"""BAGEL's released checkpoint folder, loaded as it is and built at random for tests: `llm_config.json`
(Qwen2), `vit_config.json` (SigLIP), `ema.safetensors` (the model under its released names),
`ae.safetensors` (the FLUX.1 autoencoder in Black Forest Labs' layout) and the Qwen2.5 tokenizer.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stages.errors import UserInputError
from stages.models.bagel_layers import LATENT_PATCH, BagelConfig, RMSNorm, Rotary
from stages.models.bagel_model import Bagel
from stages.models.factory import (
    autoencoder_kl,
    choose_size,
    finish_model_dir,
    parameter_count,
    seeded,
)

FAMILY = "bagel"
PIPELINE_CLASS = "Bagel"
LLM_CONFIG = "llm_config.json"
VIT_CONFIG = "vit_config.json"
WEIGHTS = "ema.safetensors"
AUTOENCODER = "ae.safetensors"
# The FLUX.1 autoencoder's latent normalisation, as BAGEL's reference encodes and decodes with it.
AE_SCALE, AE_SHIFT = 0.3611, 0.1159
# What a Qwen2.5 tokenizer folder's files start with (the released folder has the slow and fast forms).
TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens")
# The special tokens BAGEL frames a prompt (ChatML's turn markers) and an image chunk with.
BOS, EOS, IMAGE_START, IMAGE_END = "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"


@dataclass(frozen=True)
class BagelSize:
    """The widths of one build: the language model, the ViT, the VAE and the two position tables."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vit_hidden: int
    vit_intermediate: int
    vit_layers: int  # as vit_config.json counts them: the model uses one fewer
    vit_heads: int
    vit_image_size: int
    vit_patch: int
    max_latent_size: int  # latent patches per side the position table covers
    vae_channels: tuple[int, ...]
    vae_layers_per_block: int
    vae_groups: int
    latent_channels: int = 16
    rope_theta: float = 1_000_000.0
    vocab: int | None = None  # None: one row per token of the tokenizer


SIZES: dict[str, BagelSize] = {
    "tiny": BagelSize(
        hidden=64,
        intermediate=128,
        layers=2,
        heads=4,
        kv_heads=2,
        vit_hidden=32,
        vit_intermediate=64,
        vit_layers=3,
        vit_heads=2,
        vit_image_size=56,
        vit_patch=14,
        max_latent_size=8,
        vae_channels=(16, 16),
        vae_layers_per_block=1,
        vae_groups=16,
    ),
    # BAGEL-7B-MoT as released (Qwen2.5-7B twice, SigLIP2-so400m/14 at 980 px, the FLUX.1 VAE)
    "full": BagelSize(
        hidden=3584,
        intermediate=18944,
        layers=28,
        heads=28,
        kv_heads=4,
        vit_hidden=1152,
        vit_intermediate=4304,
        vit_layers=27,
        vit_heads=16,
        vit_image_size=980,
        vit_patch=14,
        max_latent_size=64,
        vae_channels=(128, 256, 512, 512),
        vae_layers_per_block=2,
        vae_groups=32,
        vocab=152064,
    ),
}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserInputError(
            f"{path}: missing; a BAGEL folder holds {LLM_CONFIG}, {VIT_CONFIG}, {WEIGHTS}"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserInputError(f"{path}: not a readable JSON config ({error})") from None


LLM_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "vocab_size",
)
VIT_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "image_size",
    "patch_size",
)
SIZED_BY = ("vae2llm.weight", "latent_pos_embed.pos_embed", "vit_pos_embed.pos_embed")


def _token_ids(tokenizer: Any) -> dict[str, tuple[int, int]]:
    """`BagelConfig`'s marker token ids, from the tokenizer."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS, IMAGE_START, IMAGE_END)]
    return {"prompt_ends": (ids[0], ids[1]), "image_markers": (ids[2], ids[3])}


def read_config(folder: str | Path, shapes: dict[str, tuple[int, ...]], tokenizer: Any) -> BagelConfig:
    """The config of a BAGEL folder: its two config files, the table sizes and latent width its weights
    have (`shapes`: each weight's shape, read off the file's header) and the tokenizer's prompt and
    image-chunk markers. A key or weight these need that is missing
    is a one-line UserInputError naming the file."""
    folder = Path(folder)
    llm, vit = _read_json(folder / LLM_CONFIG), _read_json(folder / VIT_CONFIG)
    for name, config, keys in ((LLM_CONFIG, llm, LLM_KEYS), (VIT_CONFIG, vit, VIT_KEYS)):
        absent = [key for key in keys if key not in config]
        if absent:
            raise UserInputError(
                f"{folder / name}: lacks {', '.join(absent)}; pass a BAGEL checkpoint folder"
            )
    absent = [name for name in SIZED_BY if name not in shapes]
    if absent:
        raise UserInputError(f"{folder / WEIGHTS}: lacks {', '.join(absent)}; pass a BAGEL checkpoint folder")
    return BagelConfig(
        llm=llm,
        vit=vit,
        max_latent_size=math.isqrt(shapes["latent_pos_embed.pos_embed"][0]),
        vit_max_patches_per_side=math.isqrt(shapes["vit_pos_embed.pos_embed"][0]),
        latent_channels=shapes["vae2llm.weight"][1] // LATENT_PATCH**2,
        **_token_ids(tokenizer),
    )


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of a safetensors file, read off its header (no weight is read); a file
    that is not one is a one-line UserInputError."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except (OSError, SafetensorError) as error:
        raise UserInputError(f"{path}: not a readable safetensors file ({error})") from None


def load_bagel(
    folder: str | Path, dtype: torch.dtype = torch.float32, cls: type[Bagel] = Bagel
) -> tuple[Bagel, Any]:
    """The model of a BAGEL folder (released layout) as a `cls` (a `Bagel`, or the understanding policy's
    subclass) in `dtype`, eval mode, and its tokenizer. Every
    weight of `ema.safetensors` must fill one parameter and every parameter must be filled: else a
    one-line UserInputError naming the first mismatch. The shapes are checked from the file's header
    before any weight is read, and the weights are read one at a time into `dtype`: the peak is one
    model in `dtype` plus one stored tensor (the 7B MoT's 29 GB file is never held twice)."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    folder = Path(folder)
    path = folder / WEIGHTS
    if not path.is_file():
        raise UserInputError(f"{path}: missing; a BAGEL folder holds {LLM_CONFIG}, {VIT_CONFIG}, {WEIGHTS}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    shapes = weight_shapes(path)
    config = read_config(folder, shapes, tokenizer)
    with torch.device("meta"):
        model = cls(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which BAGEL does not"
        raise UserInputError(f"{path}: {what} ({len(missing)} missing, {len(unexpected)} unexpected weights)")
    for name, tensor in expected.items():
        if shapes[name] != tuple(tensor.shape):
            raise UserInputError(
                f"{path}: {name} is {shapes[name]}, the configs make it {tuple(tensor.shape)}"
            )
    with safe_open(path, framework="pt") as stored:
        model.load_state_dict({name: stored.get_tensor(name).to(dtype) for name in expected}, assign=True)
    model.language_model.model.rotary = Rotary(config.head_dim, config.llm.get("rope_theta", 10000.0))
    return model.eval().requires_grad_(False), tokenizer


def prompt_ids(tokenizer: Any, config: BagelConfig, prompt: str) -> list[int]:
    """A prompt as BAGEL's context holds it: `<|im_start|>`, its tokens, `<|im_end|>`."""
    bos, eos = config.prompt_ends
    return [bos, *tokenizer.encode(prompt, add_special_tokens=False), eos]


def _ldm_vae_names(state: dict[str, torch.Tensor], levels: int) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL state dict under the names Black Forest Labs' `ae.safetensors` uses
    (the LDM layout; attention projections as 1×1 convolutions), as diffusers' single-file loader reads them back."""
    renamed = {}
    for name, tensor in state.items():
        new = name.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        new = new.replace(".mid_block.resnets.0.", ".mid.block_1.").replace(
            ".mid_block.resnets.1.", ".mid.block_2."
        )
        if ".mid_block.attentions.0." in new:
            new = new.replace(".mid_block.attentions.0.", ".mid.attn_1.")
            new = (
                new.replace("group_norm", "norm")
                .replace("to_q", "q")
                .replace("to_k", "k")
                .replace("to_v", "v")
            )
            new = new.replace("to_out.0", "proj_out")
            if tensor.ndim == 2:
                tensor = tensor[:, :, None, None]
        parts = new.split(".")
        if parts[1] in ("down_blocks", "up_blocks"):
            index = int(parts[2]) if parts[1] == "down_blocks" else levels - 1 - int(parts[2])
            kind = {"resnets": "block", "downsamplers": "downsample", "upsamplers": "upsample"}[parts[3]]
            rest = parts[5:] if kind != "block" else parts[4:]
            new = ".".join([parts[0], "down" if parts[1] == "down_blocks" else "up", str(index), kind, *rest])
        renamed[new] = tensor.contiguous()
    return renamed


def load_autoencoder(folder: str | Path) -> Any:
    """The FLUX.1 autoencoder of a BAGEL folder's `ae.safetensors` (Black Forest Labs' layout) as a
    diffusers `AutoencoderKL` (`autoencoder_config` of its weights' shapes)."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from safetensors.torch import load_file

    weights = load_file(Path(folder) / AUTOENCODER)
    vae = AutoencoderKL(**autoencoder_config({k: tuple(v.shape) for k, v in weights.items()}))
    vae.load_state_dict(convert_ldm_vae_checkpoint(weights, vae.config))
    return vae.eval().requires_grad_(False)


def autoencoder_config(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The `AutoencoderKL` config of an `ae.safetensors` from its weights' shapes (names in Black Forest
    Labs' layout): scaling 0.3611, shift 0.1159, no quant convs; its widths read off the shapes, its
    GroupNorms with 32 groups (FLUX's), or one a channel when the first level is narrower."""
    base = shapes["encoder.conv_in.weight"][0]
    levels = 1 + max(int(k.split(".")[2]) for k in shapes if k.startswith("encoder.down."))
    channels = [shapes[f"encoder.down.{i}.block.0.conv1.weight"][0] for i in range(levels)]
    blocks = 1 + max(int(k.split(".")[4]) for k in shapes if k.startswith("encoder.down.0.block."))
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=tuple(channels),
        layers_per_block=blocks,
        latent_channels=shapes["decoder.conv_in.weight"][1],
        norm_num_groups=math.gcd(32, base),
        scaling_factor=AE_SCALE,
        shift_factor=AE_SHIFT,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _configs(spec: BagelSize, tokenizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """llm_config.json and vit_config.json of a size, with the released files' keys."""
    llm = {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.eos_token_id,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": 32768,
        "max_window_layers": spec.layers,
        "model_type": "qwen2",
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": spec.rope_theta,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": spec.vocab or len(tokenizer),
    }
    vit = {
        "architectures": ["SiglipVisionModel"],
        "attention_dropout": 0.0,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": spec.vit_hidden,
        "image_size": spec.vit_image_size,
        "intermediate_size": spec.vit_intermediate,
        "layer_norm_eps": 1e-06,
        "model_type": "siglip_vision_model",
        "num_attention_heads": spec.vit_heads,
        "num_channels": 3,
        "num_hidden_layers": spec.vit_layers,
        "patch_size": spec.vit_patch,
        "torch_dtype": "bfloat16",
    }
    return llm, vit


def make_bagel(size: str, seed: int, tokenizer: Any = None) -> Bagel:
    """The BAGEL model of `size` with seeded random weights (the generation expert's own, not a copy of
    the understanding one's, so tests tell them apart), unsaved."""
    from stages.models.tokenizers import build_qwen2_tokenizer

    spec: BagelSize = choose_size(FAMILY, size, SIZES)
    tokenizer = tokenizer or build_qwen2_tokenizer()
    llm, vit = _configs(spec, tokenizer)
    config = BagelConfig(
        llm=llm,
        vit=vit,
        max_latent_size=spec.max_latent_size,
        vit_max_patches_per_side=spec.vit_image_size // spec.vit_patch,
        latent_channels=spec.latent_channels,
        **_token_ids(tokenizer),
    )
    with seeded(seed, "bagel"):
        model = Bagel(config)
        norms = {id(m.weight) for m in model.modules() if isinstance(m, (RMSNorm, nn.LayerNorm))}
        for parameter in model.parameters():
            if parameter.requires_grad:  # not the fixed sin-cos tables
                norm = id(parameter) in norms
                nn.init.normal_(parameter, mean=1.0 if norm else 0.0, std=0.05 if norm else 0.02)
    return model


def make_autoencoder(spec: BagelSize, seed: int) -> Any:
    """The FLUX.1-form autoencoder of a size with seeded random weights (`factory.autoencoder_kl`)."""
    return autoencoder_kl(
        seed,
        channels=spec.vae_channels,
        groups=spec.vae_groups,
        layers_per_block=spec.vae_layers_per_block,
        latent_channels=spec.latent_channels,
        scaling_factor=AE_SCALE,
        shift_factor=AE_SHIFT,
    )


def save_folder(out: Path, model: Bagel, vae: Any, tokenizer: Any) -> None:
    """Write `model`, its autoencoder and tokenizer into folder `out` in the released layout (what
    `load_bagel` and `load_autoencoder` read)."""
    from safetensors.torch import save_file

    (out / LLM_CONFIG).write_text(json.dumps(model.config.llm, indent=2) + "\n")
    (out / VIT_CONFIG).write_text(json.dumps(model.config.vit, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / WEIGHTS)
    levels = len(vae.config.block_out_channels)
    save_file(_ldm_vae_names(vae.state_dict(), levels), out / AUTOENCODER)
    tokenizer.save_pretrained(out)


def build_bagel(out_dir: str | Path, *, size: str, seed: int) -> dict[str, Any]:
    """Write a random-weight BAGEL folder of `size` in the released layout: llm_config.json,
    vit_config.json, ema.safetensors, ae.safetensors (BFL names), the Qwen2 tokenizer and the model card."""
    from stages.models.tokenizers import build_qwen2_tokenizer

    spec: BagelSize = choose_size(FAMILY, size, SIZES)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen2_tokenizer()
    model = make_bagel(size, seed, tokenizer)
    vae = make_autoencoder(spec, seed)
    save_folder(out, model, vae, tokenizer)
    return finish_model_dir(
        out,
        family=FAMILY,
        size=size,
        seed=seed,
        pipeline_class=PIPELINE_CLASS,
        parameters={
            "language_model": parameter_count(model.language_model),
            "vit_model": parameter_count(model.vit_model),
            "vae": parameter_count(vae),
        },
        details={
            "architecture": asdict(spec),
            "vocab_size": len(tokenizer),
            # `sample`'s default side: the whole latent position table
            "image_size": spec.max_latent_size * LATENT_PATCH * 2 ** (len(spec.vae_channels) - 1),
        },
    )


def autoencoder_scale(folder: str | Path) -> int:
    """The spatial factor of a BAGEL folder's autoencoder (2 per level after the first), read off the
    names in `ae.safetensors`' header alone (no weights read)."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / AUTOENCODER), framework="pt") as f:
        levels = 1 + max(int(k.split(".")[2]) for k in f.keys() if k.startswith("encoder.down."))  # noqa: SIM118
    return 2 ** (levels - 1)
