"""The settings of `omnirl init-model` and `omnirl plan` as typed configs, and the names they take;
torch-free.

`FAMILIES` is the factory's registry of built-in families (name → its builder as "module:function",
imported only when built: `stages.models.factory`), and `MODEL_SIZES` the sizes their builders offer
(each family module's `SIZES`, and the `PUBLISHED` sizes of Wan's and FLUX.2 [klein]'s, draw from it;
tests hold them equal). From these the CLI generates both commands' options (`omnirl_cli.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stages import knobs
from stages.errors import UserInputError
from stages.knobs import DTYPES, MIXED_PRECISION_MODES, OPTIMISATION, STRATEGIES, knob

if TYPE_CHECKING:
    from stages.parallelism import ModelParallel

FAMILIES: dict[str, str] = {
    "bagel": "stages.models.bagel_folder:build_bagel",
    "flux": "stages.models.flux:build_flux",
    "flux2": "stages.models.flux2_build:build_flux2",
    "flux2_klein": "stages.models.flux2_build:build_flux2_klein",
    "flux_kontext": "stages.models.flux_kontext:build_flux_kontext",
    "qwen2_5_vl": "stages.models.qwen2_5_vl:build_qwen2_5_vl",
    "qwen3_omni_thinker": "stages.models.qwen3_omni:build_qwen3_omni_thinker",
    "qwen3_vl": "stages.models.qwen3_vl:build_qwen3_vl",
    "qwen3_vl_moe": "stages.models.qwen3_vl:build_qwen3_vl_moe",
    "qwen_image": "stages.models.qwen_image:build_qwen_image",
    "qwen_image_edit": "stages.models.qwen_image_edit:build_qwen_image_edit",
    "qwen_image_edit_plus": "stages.models.qwen_image_edit:build_qwen_image_edit_plus",
    "sd3": "stages.models.sd3:build_sd3",
    "wan2_1": "stages.models.wan:build_wan2_1",
    "wan2_1_i2v": "stages.models.wan_i2v:build_wan2_1_i2v",
    "wan2_2_5b": "stages.models.wan:build_wan2_2_5b",
    "wan2_2_5b_i2v": "stages.models.wan_i2v:build_wan2_2_5b_i2v",
    "wan2_2_a14b": "stages.models.wan:build_wan2_2_a14b",
    "wan2_2_a14b_i2v": "stages.models.wan_i2v:build_wan2_2_a14b_i2v",
    "z_image": "stages.models.z_image:build_z_image",
}
FAMILY_NAMES = tuple(FAMILIES)
# test, benchmark and published sizes: "full" names each family's flagship, the others their published names
MODEL_SIZES = ("tiny", "small", "demo", "full", "medium", "1.3b", "3b", "4b", "7b", "8b")

MODEL = "Model"
DEVICE = "Devices"
GIB = 2**30


@dataclass
class InitModelConfig:
    """Every setting of `omnirl init-model`: which family and size to build, with which seed, where."""

    out: Path | None = knob(None, "Directory to write the model folder to.", argument=True)
    family: str = knob("sd3", f"Model family: {', '.join(FAMILY_NAMES)}.", names=FAMILY_NAMES)
    size: str = knob(
        "tiny",
        "tiny (fast tests), small (benchmarks), for sd3 demo (the pixel-VAE shape `omnirl pretrain` "
        "trains for the demo: 4 latent channels, 64 px at most, 24 CLIP + 32 T5 tokens), or a published "
        "size with random weights, for GPU benchmarks: full (each family's flagship: SD3.5 Large, FLUX.1-dev, "
        "FLUX.2 [dev], FLUX.2 [klein] 9B, "
        "Qwen-Image 20B, Z-Image, Wan 2.1 T2V 14B, Wan 2.2 5B / A14B, Qwen2.5-VL 7B, Qwen3-VL 8B, the "
        "Qwen3-Omni thinker), sd3 medium, wan2_1 1.3b, flux2_klein 4b, qwen2_5_vl 3b / 7b, qwen3_vl 8b. `omnirl plan --family F --size S` says "
        "what a size needs.",
        choices=MODEL_SIZES,
    )
    seed: int = knob(0, "Weight seed: the same seed gives the same weights.")


@dataclass
class PlanConfig:
    """Every setting of `omnirl plan`: the model (a folder's configs or a family's size) and the run's
    settings a plan is made for, named and defaulting as the stages' own options (`stages.models.plan`)."""

    model: str | None = knobs.model(
        "Model folder whose configs are read (no weights; or --family)", MODEL, required=False
    )
    family: str | None = knob(
        None,
        f"A built-in architecture instead of --model: {', '.join(FAMILY_NAMES)}.",
        names=FAMILY_NAMES,
        panel=MODEL,
    )
    size: str = knob(
        "full",
        "Size of --family: full (its flagship: Qwen-Image 20B, FLUX.1-dev, FLUX.2 [dev], Wan 2.1 T2V 14B, SD3.5 "
        "Large, ...), another published size (sd3 medium, wan2_1 1.3b, flux2_klein 4b, qwen2_5_vl 3b / 7b, qwen3_vl 8b) or tiny / "
        "small.",
        choices=MODEL_SIZES,
        panel=MODEL,
    )
    understand: bool = knob(
        False,
        "A model that both generates images and understands them (BAGEL): plan its understanding "
        "(sample --understand, logprob and update of answers: LoRA on both experts, --text-tokens through the "
        "language model) instead of its generation.",
        panel=MODEL,
    )
    dtype: str = knobs.dtype()
    mixed_precision: str | None = knobs.mixed_precision(
        "the forwards (activations in 16 bits under bf16 / fp16)", OPTIMISATION, recorded="Planned for."
    )
    resolution: str | None = knobs.resolution()  # None: the model's own (its card's image_size), else 512
    frames: int = knobs.frames()
    guidance: float = knobs.guidance()
    batch_size: int = knobs.batch_size()
    micro_batch: int = knobs.micro_batch()  # 0: batch_size, as update
    text_tokens: int | None = knob(
        None,
        "Text tokens per sample (default: the model's text length; VLM: 1024, prompt and response).",
        low=1,
    )
    references: int | None = knob(
        None,
        "Condition images per prompt of an editing model (its sources or references), each at the output "
        "size: Kontext, Qwen-Image-Edit (Plus: 1 to 3) and FLUX.2 (0 to 10) append each one's latent tokens "
        "to the sequence; Wan I2V's first frame enters as channels or frame 0 and adds none. Default: the "
        "fewest the model takes (1 for an editing model, 0 for FLUX.2).",
        low=0,
    )
    lora_rank: int = knobs.lora_rank()
    full: bool = knobs.full()
    gradient_checkpointing: bool = knobs.gradient_checkpointing()
    strategy: str = knobs.strategy()
    num_processes: int = knob(
        1,
        "Ranks the stages run on (accelerate launch --num_processes, torchrun --nproc_per_node).",
        low=1,
        panel=DEVICE,
    )
    sp_degree: int = knobs.sp_degree()
    sp_kind: str = knobs.sp_kind()
    tp_degree: int = knobs.tp_degree()
    cpu_offload: bool = knob(
        False,
        "FSDP2 with the accelerate config's fsdp_offload_params: the trained module's shards, "
        "gradients and optimizer state in host memory.",
        panel=DEVICE,
    )
    cpu: bool = knob(
        False,
        "Plan a run on the CPU: the device is the process's own memory, so each stage's total also "
        "counts the process's runtime (interpreter, torch and the libraries: 0.51 GiB, measured on the tiny "
        "builds), a row of its own; the total is then the process's peak resident memory.",
        panel=DEVICE,
    )
    device_memory: float | None = knob(
        None,
        "Memory of one device in GiB, for the verdict (default: the visible accelerator's, "
        "torch.accelerator; none on a CPU-only machine).",
        low=0,
        metavar="GIB",
        panel=DEVICE,
    )

    @property
    def parallel(self) -> ModelParallel:
        """The model parallelism planned for (--sp-degree, --sp-kind, --tp-degree)."""
        from stages.parallelism import ModelParallel

        return ModelParallel(self.sp_degree, self.sp_kind, self.tp_degree)

    def validate(self) -> None:
        """One line per setting a user got wrong."""
        if self.dtype not in DTYPES:
            raise UserInputError(f"--dtype {self.dtype}: choose one of {', '.join(DTYPES)}")
        if self.mixed_precision not in (None, *MIXED_PRECISION_MODES):
            raise UserInputError(
                f"--mixed-precision {self.mixed_precision}: choose one of {', '.join(MIXED_PRECISION_MODES)}"
            )
        for flag, value in (("--num-processes", self.num_processes), ("--batch-size", self.batch_size)):
            if value < 1:
                raise UserInputError(f"{flag} {value}: must be at least 1")
        if self.micro_batch < 0 or self.lora_rank < 0:
            raise UserInputError("--micro-batch and --lora-rank must be >= 0")
        if not self.full and self.lora_rank == 0:
            raise UserInputError("--lora-rank 0 trains nothing: pass --lora-rank > 0 or --full")
        if self.strategy not in STRATEGIES:
            raise UserInputError(f"--strategy {self.strategy}: choose one of {', '.join(STRATEGIES)}")
        if self.cpu_offload and self.kind() != "fsdp2":
            raise UserInputError("--cpu-offload is FSDP2's: pass --strategy fsdp2")
        self.parallel.validate(self.num_processes, ranks_option="--num-processes")
        if self.tp_degree > 1 and not self.full:
            raise UserInputError(
                f"--tp-degree {self.tp_degree}: diffusers' tensor-parallel plan does not shard LoRA "
                "layers, so update refuses it; pass --full (or plan --sp-degree)"
            )

    def kind(self) -> str:
        """ "none", "ddp" or "fsdp2", as `stages.update.parallel.resolve_strategy` picks it."""
        if self.strategy == "fsdp2":
            return "fsdp2"
        return "ddp" if self.num_processes > 1 else "none"
