"""`omnirl export`: an adapter merged into its base model, as a plain folder for deployment."""

from __future__ import annotations

from pathlib import Path

from stages.export.config import ExportConfig

from ..console import emit_json, print_result, progress
from ..generate import config_command
from ..runtime import device


def run(c: ExportConfig, json_: bool) -> None:
    """Merge a LoRA adapter into its base model (or take full weights) and write a plain model folder.

    A diffusion model becomes a whole diffusers pipeline folder (the trained transformer merged, every
    other component as loaded); a VLM a transformers model folder with its processor (of a whole
    Qwen3-Omni folder, the thinker). Both load with `from_pretrained`, without peft, vLLM and SGLang
    included, and compute what the base model with the adapter computes (within 1e-5 in fp32). The
    merge runs in fp32; --dtype is the exported weights' dtype.

    The base model is the one the adapter records; --out must not exist, and is written as a hidden
    sibling renamed into place once complete.

    Example: [bold]omnirl export runs/x/it9/policy --out deploy/x-it9 --dtype bf16[/]
    """
    from stages.export.stage import export_adapter

    with progress() as bar:
        bar.add_task(f"exporting {c.adapter}", total=None, rate="")
        result = export_adapter(
            Path(str(c.adapter)),
            Path(str(c.out)),
            model=Path(c.model) if c.model else None,
            dtype=c.dtype,
            device=device(),
        )
    if json_:
        emit_json(result)
    else:
        size = result["bytes"] / 2**20
        print_result(
            f"[green]exported[/] → {result['out']}  {result['kind']} adapter on {result['base_model']}, "
            f"{result['merged_layers']} LoRA layers merged, {result['dtype']}, {size:.1f} MiB"
        )


export = config_command(ExportConfig, "export", run)
