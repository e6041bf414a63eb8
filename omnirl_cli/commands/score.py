"""`omnirl score`: rewards for every sample, written as their own column group."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..config import resolve
from ..console import emit_json, log
from ..errors import handle_errors
from ..options import ConfigOpt, FormatOpt, InOpt, JsonOpt, OutOpt, OverwriteOpt, SetOpt
from ..runtime import check_format, finalize, map_shards, open_inputs, plugin_files, run_config


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
            help="NAME[=WEIGHT], repeatable: a built-in image reward (jpeg_compressibility, "
            "jpeg_incompressibility, ocr) or text reward for VLM rollouts (format_think_answer, format_boxed, "
            "accuracy, bleu, rouge_l, rouge_l_recall, meteor, text_similarity, length_penalty, "
            "repetition_penalty), module:function or path/file.py:function, or an 'omnirl.rewards' entry "
            "point. The total is the weighted sum.",
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
    """Score each sample's image (or VLM response) with one or more rewards; writes reward and reward.<name>.

    A scorer that fails or returns NaN stops the run naming the sample, unless --on-error zero.
    Plugins take (images: list[PIL.Image], prompts: list[str], meta: list[dict]) and return one float
    (or None) per sample; text plugins take the response strings instead and set `reward_kind = "text"`
    (wrap verl `compute_score` or trl reward functions with stages.score.text_rewards.verl_compute_score
    / trl_reward). Meta holds the prompt row's ground_truth, data_source, extra_info,
    max_response_length and response_length.

    VLM: [bold]omnirl score --in run/it0/samples --reward accuracy=0.9 --reward format_boxed=0.1 --out run/it0/rewards[/]

    Example: [bold]omnirl score --in run/it0/samples --reward ocr --reward jpeg_compressibility=0.1 --out run/it0/rewards[/]
    """
    c = resolve(ctx, "score")
    from stages.score.registry import parse_reward_spec
    from stages.score.stage import needed_columns, score_shard
    from stages.shards.reader import rollout_modality
    from stages.shards.writer import ShardSetWriter

    specs = [parse_reward_spec(s) for s in c["reward"] or []]
    if not specs:
        from stages.errors import UserInputError

        raise UserInputError("--reward: give at least one reward, e.g. --reward jpeg_compressibility")
    src = open_inputs(c["inputs"])
    modality = rollout_modality(src.manifests)
    writer = ShardSetWriter(
        c["out"],
        num_shards=src.num_shards,
        format=check_format(c["fmt"]),
        command="score",
        config=run_config(c),
        parents=[*src.paths, *plugin_files([name for name, _ in specs])],
        policy=src.manifests[0].policy,
        overwrite=c["overwrite"],
    )
    if not writer.complete:
        map_shards(
            src,
            writer,
            "scoring",
            needed_columns(modality),
            lambda shard, advance: score_shard(
                shard,
                specs,
                modality=modality,
                batch_size=c["batch_size"],
                on_error=c["on_error"],
                on_batch=advance,
            ),
            bar=not json_,
        )
    if not finalize(writer):
        return
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
