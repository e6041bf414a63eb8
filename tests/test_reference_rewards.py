"""hpsv2 and imagereward against their reference implementations on tiny random weights.

The oracle is the reference code itself (tests/reference_oracles.py says how it is imported): a tiny
model built with the reference's own classes (hpsv2's open_clip `CLIP`, ImageReward's BLIP ViT, ``med``
BERT and `ImageReward` module), its state dict saved in the published checkpoint layout, and the
reference's own preprocessing, tokenizer and forward give the numbers our scorers must reproduce.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import string
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import fails, run
from PIL import Image
from reference_oracles import oracle_modules

from stages.errors import UserInputError
from stages.models.tokenizers import build_clip_tokenizer
from stages.score.registry import get_reward

PROMPTS = [
    "a photo of a cat",
    "A Red apple on a table &amp; two   cups",
    'a sign that says "hello"',
    "a blue sky " + "over a green train " * 20,  # longer than 77 (HPS) and 35 (ImageReward) tokens
]


def _noise(seed: int, width: int, height: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


# Wide, tall, already at the model's size, up-scaled, down-scaled with odd margins, grey, and one whose
# odd margins tell round-half-to-even crop offsets and left/right padding apart.
IMAGES = [
    _noise(0, 48, 40),
    _noise(1, 21, 64),
    _noise(2, 32, 32),
    _noise(3, 19, 13),
    _noise(4, 71, 50),
    _noise(5, 45, 33, "L"),
    _noise(6, 32, 35),
]


def _perturb(module: torch.nn.Module, seed: int) -> None:
    """Noise on every parameter, so that no bias or LayerNorm is at its trivial init (a swapped or
    dropped key then changes the numbers)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))


def _pairs() -> tuple[list[Image.Image], list[str]]:
    """Every image with every prompt, so one batch covers each combination."""
    return [image for image in IMAGES for _ in PROMPTS], [prompt for _ in IMAGES for prompt in PROMPTS]


# --- HPS v2.1 -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hps(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny open_clip CLIP of hpsv2's own classes, saved as HPS_v2.1_compressed.pt is, the CLIP
    tokenizer folder our scorer reads, and the reference's preprocessing and tokenizer of the same vocabulary."""
    model_module, transform_module, tokenizer_module = oracle_modules(
        "hpsv2.src.open_clip.model", "hpsv2.src.open_clip.transform", "open_clip.tokenizer"
    )
    root = tmp_path_factory.mktemp("hps")
    tokenizer = build_clip_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    merges = json.loads((root / "tokenizer" / "tokenizer.json").read_text())["model"]["merges"]
    bpe = root / "bpe.txt.gz"  # open_clip's vocabulary file: a header line, then one merge per line
    with gzip.open(bpe, "wt", encoding="utf-8") as handle:
        handle.write("#version: 0.2\n" + "\n".join(" ".join(pair) for pair in merges))  # no final newline
    torch.manual_seed(0)
    model = model_module.CLIP(
        embed_dim=16,
        vision_cfg=model_module.CLIPVisionCfg(image_size=32, layers=2, width=32, head_width=16, patch_size=8),
        text_cfg=model_module.CLIPTextCfg(
            context_length=77, vocab_size=len(tokenizer), width=32, heads=2, layers=3
        ),
        output_dict=True,
    ).eval()
    _perturb(model, 1)
    checkpoint = root / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": model.state_dict(), "epoch": 1}, checkpoint)
    preprocess = transform_module.image_transform(32, is_train=False, resize_longest_max=True)
    reference_tokenizer = tokenizer_module.SimpleTokenizer(bpe_path=str(bpe), context_length=77)

    def forward(images: list[Image.Image], prompts: list[str]) -> np.ndarray:
        """hpsv2's img_score.score: model(image, text) features, diagonal of image @ text.T."""
        with torch.no_grad():
            outputs = model(
                torch.stack([preprocess(image) for image in images]), reference_tokenizer(prompts)
            )
        return torch.diagonal(outputs["image_features"] @ outputs["text_features"].T).numpy()

    args = {
        "model": str(checkpoint),
        "tokenizer": str(root / "tokenizer"),
        "vision_heads": 2,
        "text_heads": 2,
    }
    return SimpleNamespace(args=args, forward=forward, tokenize=reference_tokenizer, tokenizer=tokenizer)


def test_hps_tokenizer_matches_open_clips(hps):
    """The vocabulary both read is the same, so the score comparison below tests the model, not the ids."""
    from stages.score.hps import clean_prompt

    for prompt in PROMPTS:
        ours = hps.tokenizer(clean_prompt(prompt), truncation=True, max_length=77)["input_ids"]
        reference = hps.tokenize([prompt])[0]
        assert reference[: len(ours)].tolist() == ours and not reference[len(ours) :].any()


def test_hpsv2_equals_the_reference(hps):
    images, prompts = _pairs()
    expected = hps.forward(images, prompts)
    scorer = get_reward("hpsv2", {**hps.args, "batch_size": 5})
    got = np.array(scorer(images, prompts, [{}] * len(images)))
    assert np.abs(got - expected).max() < 1e-6  # float32 rounding: 5e-8 measured
    assert np.ptp(expected) > 0.1  # the weights tell the pairs apart: the check is not vacuous


def test_hpsv2_bf16_stays_near_fp32(hps):
    images, prompts = _pairs()
    full = get_reward("hpsv2", hps.args)(images[:8], prompts[:8], [{}] * 8)
    half = get_reward("hpsv2", {**hps.args, "dtype": "bf16"})(images[:8], prompts[:8], [{}] * 8)
    assert half == pytest.approx(full, abs=0.03) and half != full


def test_hpsv2_refuses_unsafe_or_foreign_checkpoints(hps, tmp_path):
    pickled = tmp_path / "code.pt"
    pickled.write_bytes(pickle.dumps(SimpleNamespace(state_dict={})))
    with pytest.raises(UserInputError, match=r"model=.*code\.pt is not a tensor state dict"):
        get_reward("hpsv2", {**hps.args, "model": str(pickled)}).load()
    foreign = tmp_path / "foreign.pt"
    torch.save(
        {"state_dict": {"visual.conv1.weight": torch.zeros(4, 3, 8, 8), "head.w": torch.zeros(2)}}, foreign
    )
    with pytest.raises(UserInputError, match=r"not an open_clip CLIP state dict.*head\.w"):
        get_reward("hpsv2", {**hps.args, "model": str(foreign)}).load()
    with pytest.raises(UserInputError, match=r"hpsv2\.model"):
        get_reward("hpsv2", {"tokenizer": hps.args["tokenizer"]})
    with pytest.raises(
        UserInputError, match=r"'hpsv2': vision_heads=0, text_heads=16 .* ViT-H-14 has 16 and 16"
    ):
        get_reward("hpsv2", {**hps.args, "vision_heads": "0", "text_heads": "16"})


# --- ImageReward --------------------------------------------------------------------------------------

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _bert_vocab() -> dict[str, int]:
    """A WordPiece vocabulary: BERT's special tokens, the prompts' words, every character alone and as
    a continuation (so that nothing becomes [UNK])."""
    words = sorted({w for p in PROMPTS for w in p.lower().replace('"', " ").replace("&", " ").split()})
    characters = list(string.ascii_lowercase + string.digits + string.punctuation)
    tokens = BERT_SPECIALS + words + characters + ["##" + c for c in string.ascii_lowercase + string.digits]
    return {token: index for index, token in enumerate(dict.fromkeys(tokens))}


@pytest.fixture(scope="module")
def imagereward(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The reference `ImageReward` module built by its own constructor, with BLIP_Pretrain, the MLP and
    the transform at a tiny size (the constructor hard-codes ViT-L, 768 and 224), saved as ImageReward.pt is."""
    from transformers import BertTokenizer

    vit, med, reference_module = oracle_modules(
        "ImageReward.models.BLIP.vit", "ImageReward.models.BLIP.med", "ImageReward.ImageReward"
    )
    root = tmp_path_factory.mktemp("imagereward")
    BertTokenizer(vocab=_bert_vocab()).save_pretrained(root / "bert")
    # BLIP's init_tokenizer (bert-base-uncased plus [DEC] and [ENC]); its enc_token_id line needs an
    # attribute transformers 5 removed and only BLIP's pre-training uses it.
    tokenizer = BertTokenizer.from_pretrained(root / "bert")
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    with pytest.MonkeyPatch.context() as patch:
        torch.manual_seed(0)
        tiny = torch.nn.Module()
        tiny.visual_encoder = vit.VisionTransformer(
            img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3
        )
        config = med.BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=40,
            layer_norm_eps=1e-12,
            hidden_act="gelu",
            add_cross_attention=True,
        )
        config.encoder_width = 48
        tiny.text_encoder = med.BertModel(config=config, add_pooling_layer=False)
        tiny.vision_proj, tiny.text_proj = torch.nn.Linear(48, 8), torch.nn.Linear(32, 8)
        tiny.tokenizer = tokenizer
        transform, mlp = reference_module._transform, reference_module.MLP
        patch.setattr(reference_module, "BLIP_Pretrain", lambda **_: tiny)
        patch.setattr(reference_module, "_transform", lambda _: transform(32))
        patch.setattr(reference_module, "MLP", lambda _: mlp(32))
        model = reference_module.ImageReward(med_config=None, device="cpu").eval()
    _perturb(model, 2)
    with (
        torch.no_grad()
    ):  # the reference initialises its head near 0 (std 1/(D+1)): unit gain spreads the scores
        for layer in model.mlp.layers:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.normal_(0, layer.in_features**-0.5, generator=torch.Generator().manual_seed(3))
    checkpoint = root / "ImageReward.pt"
    torch.save(model.state_dict(), checkpoint)

    def forward(images: list[Image.Image], prompt: str) -> list[float]:
        with torch.no_grad():
            return model.inference_rank(prompt, images)[1]

    args = {"model": str(checkpoint), "tokenizer": str(root / "bert"), "vision_heads": 3, "text_heads": 2}
    return SimpleNamespace(args=args, forward=forward)


def test_imagereward_equals_the_reference(imagereward):
    expected = {prompt: imagereward.forward(IMAGES, prompt) for prompt in PROMPTS}
    scorer = get_reward("imagereward", {**imagereward.args, "batch_size": 7})
    images, prompts = _pairs()
    got = scorer(images, prompts, [{}] * len(images))
    want = [expected[prompt][IMAGES.index(image)] for image, prompt in zip(images, prompts)]
    assert np.abs(np.array(got) - np.array(want)).max() < 1e-6  # float32 rounding: 1.2e-7 measured
    assert np.ptp(want) > 0.05


def test_imagereward_refuses_unsafe_or_foreign_checkpoints(imagereward, tmp_path):
    pickled = tmp_path / "code.pt"
    pickled.write_bytes(pickle.dumps(SimpleNamespace(state_dict={})))
    with pytest.raises(UserInputError, match=r"model=.*code\.pt is not a tensor state dict"):
        get_reward("imagereward", {**imagereward.args, "model": str(pickled)}).load()
    state = torch.load(imagereward.args["model"], weights_only=True)
    state.pop("mlp.layers.4.bias")
    partial = tmp_path / "partial.pt"
    torch.save(state, partial)
    with pytest.raises(UserInputError, match=r"does not match ImageReward's MLP head.*layers\.4\.bias"):
        get_reward("imagereward", {**imagereward.args, "model": str(partial)}).load()
    with pytest.raises(UserInputError, match=r"'imagereward': vision_heads=3, text_heads=0 .* has 16 and 12"):
        get_reward("imagereward", {**imagereward.args, "text_heads": "0"})


def test_imagereward_preprocessing_is_torchvisions(imagereward):
    """Our PIL resize/crop equals the reference's torchvision `_transform` pixel for pixel."""
    (reference_module,) = oracle_modules("ImageReward.ImageReward")
    from stages.score.imagereward import resize_crop_pixels

    for image in IMAGES:
        assert torch.equal(resize_crop_pixels(image, 32), reference_module._transform(32)(image))


# --- through `omnirl score` ---------------------------------------------------------------------------


def test_score_cli_runs_both_with_reward_args(hps, imagereward, tmp_path):
    """Flags reach both scorers (strings converted), the numbers equal the in-process ones, and a
    missing model is the one-line error naming the argument."""
    from stages.shards.reader import ShardSet
    from stages.shards.writer import ShardSetWriter

    images, prompts = IMAGES[:4], PROMPTS
    samples = tmp_path / "samples"
    writer = ShardSetWriter(
        samples, num_shards=1, command="sample", config={}, kinds={"image": "image", "prompt_meta": "json"}
    )
    blobs = []
    for image in images:
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="PNG")
        blobs.append(buffer.getvalue())
    rows = {"sample_id": [f"s{i}" for i in range(4)], "prompt": prompts, "prompt_meta": [{}] * 4}
    writer.write_shard(0, {**rows, "image": blobs})
    writer.finalize(extra={"modality": "image"})
    flags = [f"--reward-arg=hpsv2.{k}={v}" for k, v in hps.args.items()]
    flags += [f"--reward-arg=imagereward.{k}={v}" for k, v in imagereward.args.items()]
    run(
        "score",
        "--in",
        str(samples),
        "--reward",
        "hpsv2",
        "--reward",
        "imagereward",
        *flags,
        "--out",
        str(tmp_path / "r"),
    )
    table = ShardSet(tmp_path / "r").read_all()
    rgb = [image.convert("RGB") for image in images]
    for name, args in (("hpsv2", hps.args), ("imagereward", imagereward.args)):
        expected = get_reward(name, args)(rgb, prompts, [{}] * 4)
        assert table[f"reward.{name}"].tolist() == pytest.approx(expected, abs=1e-6)
    digests = ShardSet(tmp_path / "r").manifest.config["reward_args_sha256"]
    assert {"hpsv2.model", "hpsv2.tokenizer", "imagereward.model", "imagereward.tokenizer"} <= set(digests)
    fails(
        ["score", "--in", str(samples), "--reward", "imagereward", "--out", str(tmp_path / "r2")],
        "imagereward.model",
    )


def test_imagereward_bf16_stays_near_fp32(imagereward):
    images, prompts = _pairs()
    full = get_reward("imagereward", imagereward.args)(images[:8], prompts[:8], [{}] * 8)
    half = get_reward("imagereward", {**imagereward.args, "dtype": "bf16"})(images[:8], prompts[:8], [{}] * 8)
    assert half == pytest.approx(full, abs=0.05) and half != full
