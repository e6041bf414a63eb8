"""`omnirl advantage`: group-normalised advantages from rewards."""

from __future__ import annotations

from dataclasses import asdict

from stages.advantage.config import AdvantageConfig
from stages.outputs import check_format, open_inputs, plugin_files, run_config

from ..console import emit_json, print_result, progress
from ..generate import config_command


def run(c: AdvantageConfig, json_: bool) -> None:
    """Normalise rewards within each prompt group and broadcast over the stored steps.

    Reports zero_std_ratio (groups whose rewards are all equal, whose advantages are 0).

    A failed reward (flagged in reward_failed by `score --on-error zero`, or NaN/±inf in a set from
    another tool) is left out of every statistic (group and batch) and gets advantage 0; a group left
    with fewer than two scored samples gets 0 for all of them. The rows stay flagged in reward_failed,
    so `update` skips them; their count is reported as reward_failed (stats in the manifest, --json).

    Example: [bold]omnirl advantage --in run/it0/samples --in run/it0/rewards --out run/it0/advantages[/]
    """
    from stages.advantage.estimators import get_estimator
    from stages.advantage.stage import compute_advantages, reward_weights
    from stages.score.registry import reward_column
    from stages.score.scoring import FAILED_COLUMN
    from stages.shards.reader import rollout_modality, slice_batch
    from stages.shards.writer import ShardSetWriter

    name = c.estimator_name()
    src = open_inputs(c.inputs)
    writer = ShardSetWriter(
        c.out,
        num_shards=src.num_shards,
        format=check_format(c.fmt),
        command="advantage",
        config=run_config(asdict(c)),
        parents=[*src.paths, *plugin_files([name])],
        policy=src.manifests[0].policy,
        overwrite=c.overwrite,
    )
    steps_col = src.columns.get("log_probs")
    # one advantage per stored denoising step; a text rollout's outcome advantage covers every token
    stepwise = steps_col is not None and steps_col.shape and rollout_modality(src.manifests) != "text"
    num_steps = steps_col.shape[0] if stepwise else 1
    weights = None
    if c.aggregation == "advantage_aggr":
        weights = reward_weights(src.manifests)
    columns = ["sample_id", "group_id", "reward", *(reward_column(n) for n in weights or {})]
    columns += [reward_column(n) for n in c.gate_reward or [] if reward_column(n) in src.columns]
    if getattr(get_estimator(name), "needs_features", False) and c.diversity_features in src.columns:
        columns.append(c.diversity_features)
    columns += [FAILED_COLUMN] if FAILED_COLUMN in src.columns else []
    with progress() as bar:
        task = bar.add_task("advantages", total=src.num_rows, rate="")
        data = src.read_all(columns=columns)
        cols, stats = compute_advantages(
            data,
            estimator=name,
            clip=c.clip,
            drop_zero_std=c.drop_zero_std,
            num_steps=num_steps,
            weights=weights,
            std_ddof=c.std_ddof,
            features=c.diversity_features,
            gate_rewards=c.gate_reward,
            gate_fraction=c.gate_fraction,
        )
        if not writer.complete:
            start = 0
            for s, info in enumerate(src.manifests[0].shards):
                if not writer.shard_done(s):
                    writer.write_shard(s, slice_batch(cols, start, start + info.rows))
                start += info.rows
                bar.advance(task, info.rows)
            writer.finalize(extra={"stats": stats})
    result = {"out": str(c.out), "estimator": name, **stats}
    if json_:
        emit_json(result)
    else:
        print_result(
            f"[green]advantages[/] → {c.out}  reward {stats['reward_mean']:.4f} ± {stats['reward_std']:.4f} "
            "(mean ± sd), "
            f"zero_std_ratio {stats['zero_std_ratio']:.3f}, {stats['num_groups']} groups, "
            f"{stats[FAILED_COLUMN]} failed rewards left out"
        )


advantage = config_command(AdvantageConfig, "advantage", run)
