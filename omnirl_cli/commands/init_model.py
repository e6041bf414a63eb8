"""`omnirl init-model`: build a tiny model offline and save it as a loadable pipeline folder."""

from __future__ import annotations

from stages.models.config import InitModelConfig

from ..console import emit_json, print_result, progress
from ..generate import config_command


def run(c: InitModelConfig, json_: bool) -> None:
    """Build a tiny model of a family from its config, with locally built tokenizers, and save it.

    The folder loads with the family's own `from_pretrained(OUT)` and no network, so tests and demos
    exercise the same loading path as real checkpoints.

    Example: [bold]omnirl init-model --family sd3 --size tiny --seed 0 models/sd3-tiny[/]
    """
    from stages.models.factory import init_model as build

    with progress() as bar:
        bar.add_task(f"building {c.size} {c.family} model", total=None, rate="")
        summary = build(c.family, c.out, size=c.size, seed=c.seed)
    if json_:
        emit_json(summary)
    else:
        print_result(f"[green]wrote[/] {c.family}/{c.size} model (seed {c.seed}) to {c.out}")


init_model = config_command(InitModelConfig, "init-model", run, presets=False)  # flags only, as before
