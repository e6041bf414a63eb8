"""Qwen-Image-Edit and Edit Plus (stages/models/qwen_image_edit.py): the adapters' velocity is the stock
`QwenImageEditPipeline` / `QwenImageEditPlusPipeline` `__call__`'s, several references reach the model
and replay exactly, the processor loads without torchvision while model_index.json names
`Qwen2VLProcessor`, and the inputs the models cannot take are one-line errors. The invariants every
family shares run in tests/test_families.py."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PROMPTS, fails, run
from PIL import Image
from transformers.utils import logging as transformers_logging

from stages.models.diffusion import FlowPolicy
from stages.models.packing import pack, unpack
from stages.sample.rollout import SampleConfig, rollout_batch

transformers_logging.disable_progress_bar()
SIDE = 48  # the sources' side: another size than the 32 px output


def square(colour: tuple[int, int, int], side: int = SIDE) -> Image.Image:
    """A black image with a coloured square in the middle."""
    pixels = np.zeros((side, side, 3), np.uint8)
    pixels[side // 4 : 3 * side // 4, side // 4 : 3 * side // 4] = colour
    return Image.fromarray(pixels)


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    built = {}
    for family, pipeline in (
        ("qwen_image_edit", "QwenImageEditPipeline"),
        ("qwen_image_edit_plus", "QwenImageEditPlusPipeline"),
    ):
        summary = run("init-model", "--family", family, "--size", "tiny", str(root / family))
        assert summary["pipeline_class"] == pipeline
        built[family] = root / family
    return built


def ours(model: Path, sources: list[Image.Image], guidance: float = 4.0) -> torch.Tensor:
    """The final latent of an ODE rollout of PROMPTS[0] from seed 1 on `sources` [1, 16, 8, 8]."""
    policy = FlowPolicy.load(model)
    cfg = SampleConfig(steps=3, guidance=guidance, resolution=32, sampler="ode", batch_size=1)
    return rollout_batch(
        policy, cfg, PROMPTS[:1], [""], [1], [1], groups=[0], sample_ids=["a"],
        images=[[png(s) for s in sources]],
    )["final_latent"]  # fmt: skip


def theirs(model: Path, sources: list[Image.Image] | Image.Image) -> torch.Tensor:
    """The stock pipeline's final latent for the same prompt, noise, steps and true CFG 4.0 (its own
    `__call__`, the processor given as the family loads it)."""
    from diffusers import DiffusionPipeline

    from stages.models.qwen_image_edit import QwenImageEditProcessor

    processor = QwenImageEditProcessor.from_pretrained(model / "processor")
    pipe = DiffusionPipeline.from_pretrained(model, processor=processor)
    pipe.set_progress_bar_config(disable=True)
    x_t = FlowPolicy.load(model).initial_noise([1], 32)
    latents = pipe(
        image=sources, prompt=PROMPTS[0], negative_prompt="", true_cfg_scale=4.0, latents=pack(x_t),
        num_inference_steps=3, height=32, width=32, output_type="latent",
    ).images  # fmt: skip
    return unpack(latents, 8, 8)


def test_the_folder_names_qwen2vlprocessor_and_loads_without_torchvision(models: dict[str, Path]) -> None:
    import subprocess
    import sys

    index = json.loads((models["qwen_image_edit"] / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    # in a fresh interpreter: another test of this process may have put the reference oracles' packages
    # (torchvision among them) on sys.path
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('torchvision') is None\n"
        "from stages.models.diffusion import FlowPolicy\n"
        f"policy = FlowPolicy.load({str(models['qwen_image_edit'])!r})\n"
        "print(type(policy.pipe.processor).__name__, 'torchvision' in sys.modules)\n"
    )
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert fresh.stdout.split()[-2:] == ["QwenImageEditProcessor", "False"]
    policy = FlowPolicy.load(models["qwen_image_edit"])
    # the system turn of the edit template is the 64 tokens the pipeline drops, as with the real tokenizer
    template = policy.pipe.prompt_template_encode
    prefix = template[: template.index("<|im_start|>user\n") + len("<|im_start|>user\n")]
    assert len(policy.pipe.tokenizer(prefix).input_ids) == policy.pipe.prompt_template_encode_start_idx == 64


def test_ode_rollout_equals_the_stock_edit_pipeline(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit

    # the stock __call__ resizes the source to a 1024² px area (a literal inside it); the adapter takes the
    # source's own area: the test runs the stock pipeline at the source's area, 48² (the two agree there)
    stock = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: stock(SIDE * SIDE, ratio))
    mine = ours(models["qwen_image_edit"], [square((255, 0, 0))])
    assert mine.shape == (1, 16, 8, 8)
    assert (mine - theirs(models["qwen_image_edit"], square((255, 0, 0)))).abs().max().item() == 0.0
    assert (ours(models["qwen_image_edit"], [square((0, 0, 255))]) - mine).abs().max().item() > 1e-4


def test_ode_rollout_equals_the_stock_edit_plus_pipeline_with_two_references(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", SIDE * SIDE)  # the stock 1024² area, as above
    model = models["qwen_image_edit_plus"]
    references = [square((255, 0, 0)), square((0, 200, 0))]
    mine = ours(model, references)
    assert (mine - theirs(model, references)).abs().max().item() == 0.0
    # the second reference acts (through the vision tower and its VAE tokens)
    assert (ours(model, [references[0], square((0, 0, 255))]) - mine).abs().max().item() > 1e-4


def test_several_references_replay_exactly(models: dict[str, Path], tmp_path: Path) -> None:
    for i, colour in enumerate([(255, 0, 0), (0, 0, 255), (0, 200, 0)]):
        square(colour, 32).save(tmp_path / f"s{i}.png")
    table = tmp_path / "edits.jsonl"
    rows = [
        {"prompt": PROMPTS[0], "images": ["s0.png", "s1.png"]},
        {"prompt": PROMPTS[1], "images": ["s2.png", "s0.png"]},
    ]
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(
        "sample", "--model", str(models["qwen_image_edit_plus"]), "--prompts", str(table), "-n", "2",
        "--steps", "3", "--batch-size", "2", "--resolution", "32", "--guidance", "4", "--out", str(tmp_path / "s"),
    )  # fmt: skip
    replay = run(
        "logprob", "--model", str(models["qwen_image_edit_plus"]), "--in", str(tmp_path / "s"),
        "--out", str(tmp_path / "lp"),
    )  # fmt: skip
    assert replay["abs_delta_count"] > 0 and replay["abs_delta_max"] == 0.0
    # from the stored conditioning: no text encoder, tokenizer, processor or VAE is loaded
    assert replay["conditioning"] == "stored" and replay["loaded_components"] == ["scheduler", "transformer"]


def test_the_lora_is_verl_omnis_qwen_image_edit_layout(models: dict[str, Path]) -> None:
    policy = FlowPolicy.load(models["qwen_image_edit_plus"])
    policy.add_lora(rank=4, alpha=8)
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.module.named_parameters() if ".lora_A." in n}
    # both streams' q/k/v/out and both MLPs' two linears: 12 per block
    assert len(wrapped) == 12 * policy.module.config.num_layers


def test_bad_condition_images_exit_2_with_one_line(models: dict[str, Path], tmp_path: Path) -> None:
    for i in range(4):
        square((60 * i, 0, 0), 32).save(tmp_path / f"s{i}.png")
    square((255, 0, 0), 16).save(tmp_path / "small.png")

    def sample(family: str, *records: dict) -> list[str]:
        path = tmp_path / f"t{len(list(tmp_path.glob('t*.jsonl')))}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return [
            "sample", "--model", str(models[family]), "--prompts", str(path), "-n", "2", "--steps", "2",
            "--resolution", "32", "--out", str(tmp_path / "out"),
        ]  # fmt: skip

    fails(sample("qwen_image_edit", {"prompt": "x"}), "qwen_image_edit edits a source image", "none")
    two = {"prompt": "x", "images": ["s0.png", "s1.png"]}
    fails(sample("qwen_image_edit", two), "2 condition images", "takes 1")
    four = {"prompt": "x", "images": [f"s{i}.png" for i in range(4)]}
    fails(sample("qwen_image_edit_plus", four), "4 condition images", "takes 1 to 3")
    fails(sample("qwen_image_edit", {"prompt": "x", "image": "small.png"}), "16x16 px", "at least 32 px")
    assert not (tmp_path / "out").exists()
