"""`omnirl advantage`: group-normalised advantages from rewards."""

from __future__ import annotations

from typing import Annotated

import typer

from ..choices import ESTIMATOR_ENTRY_POINTS, ESTIMATORS, Aggregation, StdMode, complete
from ..config import resolve
from ..console import emit_json, print_result, progress
from ..errors import handle_errors
from ..options import ConfigOpt, FormatOpt, InOpt, JsonOpt, OutOpt, OverwriteOpt, SetOpt
from ..runtime import check_format, open_inputs, plugin_files, run_config


@handle_errors
def advantage(
    ctx: typer.Context,
    inputs: InOpt = None,
    out: OutOpt = None,
    estimator: Annotated[
        str,
        typer.Option(
            "--estimator",
            autocompletion=complete(ESTIMATORS, ESTIMATOR_ENTRY_POINTS),
            help=f"One of {', '.join(ESTIMATORS)} (grpo: flow_grpo's, global std; dance: unbiased group "
            "std; drgrpo: no std; pairs: +1 best, −1 worst of each group, online DPO; docs/algorithms.md has "
            "each), or a plugin module:function.",
        ),
    ] = "grpo",
    std: Annotated[StdMode | None, typer.Option("--std", help="Override the estimator's std.")] = None,
    clip: Annotated[float | None, typer.Option("--clip", help="Clip advantages to ±CLIP.")] = None,
    drop_zero_std: Annotated[
        bool,
        typer.Option(
            "--drop-zero-std", help="Mark samples of all-equal-reward groups as not trained (flow_grpo)."
        ),
    ] = False,
    aggregation: Annotated[
        Aggregation,
        typer.Option(
            "--aggregation",
            help="reward_aggr: normalise the weighted total reward (flow_grpo); "
            "advantage_aggr: normalise each reward.<name> on its own, then weight and sum (MixGRPO).",
        ),
    ] = "reward_aggr",
    fmt: FormatOpt = "parquet",
    overwrite: OverwriteOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Normalise rewards within each prompt group and broadcast over the stored steps.

    Reports zero_std_ratio (groups whose rewards are all equal, whose advantages are 0).

    A failed reward (flagged in reward_failed by `score --on-error zero`, or NaN/±inf in a set from
    another tool) is left out of every statistic (group and batch) and gets advantage 0; a group left
    with fewer than two scored samples gets 0 for all of them. The rows stay flagged in reward_failed,
    so `update` skips them; their count is reported as reward_failed (stats in the manifest, --json).

    Example: [bold]omnirl advantage --in run/it0/samples --in run/it0/rewards --out run/it0/advantages[/]
    """
    c = resolve(ctx, "advantage", required=("out",))
    from stages.advantage.stage import compute_advantages, reward_weights
    from stages.errors import UserInputError
    from stages.score.registry import reward_column
    from stages.score.scoring import FAILED_COLUMN
    from stages.shards.reader import rollout_modality, slice_batch
    from stages.shards.writer import ShardSetWriter

    name = c["estimator"]
    if c["std"] is not None:
        name = {"global": "grpo", "group": "grpo_group", "none": "drgrpo"}.get(c["std"])
        if name is None:
            raise UserInputError(f"--std {c['std']}: choose global, group or none")
    src = open_inputs(c["inputs"])
    writer = ShardSetWriter(
        c["out"],
        num_shards=src.num_shards,
        format=check_format(c["fmt"]),
        command="advantage",
        config=run_config(c),
        parents=[*src.paths, *plugin_files([name])],
        policy=src.manifests[0].policy,
        overwrite=c["overwrite"],
    )
    steps_col = src.columns.get("log_probs")
    # one advantage per stored denoising step; a text rollout's outcome advantage covers every token
    stepwise = steps_col is not None and steps_col.shape and rollout_modality(src.manifests) != "text"
    num_steps = steps_col.shape[0] if stepwise else 1
    weights = None
    if c["aggregation"] == "advantage_aggr":
        weights = reward_weights(src.manifests)
    elif c["aggregation"] != "reward_aggr":
        raise UserInputError(f"--aggregation {c['aggregation']}: choose reward_aggr or advantage_aggr")
    columns = ["sample_id", "group_id", "reward", *(reward_column(n) for n in weights or {})]
    columns += [FAILED_COLUMN] if FAILED_COLUMN in src.columns else []
    with progress() as bar:
        task = bar.add_task("advantages", total=src.num_rows, rate="")
        data = src.read_all(columns=columns)
        cols, stats = compute_advantages(
            data,
            estimator=name,
            clip=c["clip"],
            drop_zero_std=c["drop_zero_std"],
            num_steps=num_steps,
            weights=weights,
        )
        if not writer.complete:
            start = 0
            for s, info in enumerate(src.manifests[0].shards):
                if not writer.shard_done(s):
                    writer.write_shard(s, slice_batch(cols, start, start + info.rows))
                start += info.rows
                bar.advance(task, info.rows)
            writer.finalize(extra={"stats": stats})
    result = {"out": str(c["out"]), "estimator": name, **stats}
    if json_:
        emit_json(result)
    else:
        print_result(
            f"[green]advantages[/] → {c['out']}  reward {stats['reward_mean']:.4f} ± {stats['reward_std']:.4f} "
            "(mean ± sd), "
            f"zero_std_ratio {stats['zero_std_ratio']:.3f}, {stats['num_groups']} groups, "
            f"{stats[FAILED_COLUMN]} failed rewards left out"
        )
