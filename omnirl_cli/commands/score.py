"""`omnirl score`: rewards for every sample, written as their own column group."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..config import resolve
from ..console import emit_json, log
from ..errors import handle_errors
from ..options import ConfigOpt, FormatOpt, InOpt, JsonOpt, OutOpt, OverwriteOpt, SetOpt
from ..runtime import check_format, map_shards, open_inputs, run_config


@handle_errors
def score(
    ctx: typer.Context,
    inputs: InOpt = None,
    out: OutOpt = Path("rewards"),
    reward: Annotated[
        list[str] | None,
        typer.Option(
            "--reward",
            "-r",
            help="NAME[=WEIGHT], repeatable: a built-in (jpeg_compressibility, jpeg_incompressibility, ocr), "
            "module:function, or an 'omnirl.rewards' entry point. The total is the weighted sum.",
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Samples per scorer call.")] = 32,
    on_error: Annotated[
        str,
        typer.Option(
            "--on-error", help="fail (default): stop on a failed/NaN score; zero: record 0 and flag it."
        ),
    ] = "fail",
    fmt: FormatOpt = "parquet",
    overwrite: OverwriteOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Score each sample's image with one or more rewards; writes reward and reward.<name> columns.

    A scorer that fails or returns NaN stops the run naming the sample, unless --on-error zero.
    Plugins take (images: list[PIL.Image], prompts: list[str], meta: list[dict]) and return one float
    (or None) per sample.

    Example: [bold]omnirl score --in run/it0/samples --reward ocr --reward jpeg_compressibility=0.1 --out run/it0/rewards[/]
    """
    c = resolve(ctx, "score")
    from stages.score.registry import parse_reward_spec
    from stages.score.stage import score_shard
    from stages.shards.writer import ShardSetWriter

    specs = [parse_reward_spec(s) for s in c["reward"] or []]
    if not specs:
        from stages.errors import UserInputError

        raise UserInputError("--reward: give at least one reward, e.g. --reward jpeg_compressibility")
    src = open_inputs(c["inputs"])
    writer = ShardSetWriter(
        c["out"],
        num_shards=src.num_shards,
        format=check_format(c["fmt"]),
        command="score",
        config=run_config(c),
        parents=list(src.paths),
        policy=src.manifests[0].policy,
        overwrite=c["overwrite"],
    )
    if not writer.complete:
        map_shards(
            src,
            writer,
            "scoring",
            ["sample_id", "prompt", "prompt_meta", "image"],
            lambda shard, advance: score_shard(
                shard, specs, batch_size=c["batch_size"], on_error=c["on_error"], on_batch=advance
            ),
            bar=not json_,
        )
        writer.finalize()
    from stages.shards.reader import ShardSet

    rewards = ShardSet(c["out"]).read_all()
    result = {"out": str(c["out"]), "rows": len(rewards["sample_id"])}
    for key in [k for k in rewards if k.startswith("reward")]:
        if rewards[key].dtype.is_floating_point:
            result[f"{key}/mean"] = float(rewards[key].mean())
            result[f"{key}/std"] = float(rewards[key].std(unbiased=False))
    if json_:
        emit_json(result)
    else:
        log(
            f"[green]scored[/] {result['rows']} samples → {c['out']}  reward mean {result['reward/mean']:.4f} "
            f"± {result['reward/std']:.4f}"
        )
