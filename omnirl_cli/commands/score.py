"""`omnirl score`: rewards for every sample, written as their own column group."""

from __future__ import annotations

from stages.score.config import ScoreConfig

from ..console import emit_json, print_result, progress
from ..generate import config_command
from ..runtime import report_complete


def run(c: ScoreConfig, json_: bool) -> None:
    """Score each sample's image (or VLM response) with one or more rewards; writes reward and reward.<name>.

    A scorer that fails or returns NaN stops the run naming the sample, unless --on-error zero
    (a dead `serve-reward` mid-run fails its batches: their rows are flagged and counted as failed).
    Plugins take (images: list[PIL.Image], prompts: list[str], meta: list[dict]) and return one float
    (or None) per sample; video plugins set `reward_kind = "video"` and take one list of frames
    (PIL images) per sample instead of an image; text plugins take the response strings instead and set `reward_kind = "text"`
    (wrap verl `compute_score` or trl reward functions with stages.score.text_rewards.verl_compute_score
    / trl_reward). Meta holds the prompt row's ground_truth, data_source, extra_info,
    max_response_length, response_length and truncated (the response hit --max-new-tokens, OmniRL's
    max_output_token_length, without a stop token: every format reward scores it 0; the result counts
    them as "truncated"). In a conditioned rollout (an editing or image-to-video model's) meta also
    holds condition_images: the row's source images as PIL images (the edit rewards compare with them).

    --report-to logs reward/mean, reward/std and reward.<name>/mean, /std at the iteration K of --out
    RUN/it<K>/rewards (0 outside that layout); a held-out evaluation, --out RUN/it<K>/eval/rewards
    (recipes/eval.mk), logs them as eval/reward/mean ... on a series of its own, never the training curve.

    A re-run skips shards that are complete and verified; over a finished --out it scores nothing, says
    so, and reports that output's statistics (`"skipped": true` with --json).

    A rollout sampled with --defer-decode holds final latents, no media: score decodes them with the VAE
    of the rollout's model (or --model) on this process's device, in the rollout's batches and under its
    --dtype and --mixed-precision, so the rewards equal those of the decoded rollout's PNGs (frames).

    VLM: [bold]omnirl score --in run/it0/samples --reward accuracy=0.9 --reward format_boxed=0.1 --out run/it0/rewards[/]

    Example: [bold]omnirl score --in run/it0/samples --reward ocr --reward jpeg_compressibility=0.1 --out run/it0/rewards[/]

    CLIP: [bold]omnirl score --in run/it0/samples --reward pickscore --reward-arg pickscore.model=/models/PickScore_v1 \\
    --reward-arg pickscore.processor=/models/CLIP-ViT-H-14-laion2B-s32B-b79K --out run/it0/rewards[/]
    """
    from stages.score.scoring import FAILED_COLUMN
    from stages.score.stage import run_score

    with progress() as bar:
        result = run_score(c, bar)
    if result is None:
        return
    skipped = result.pop("skipped")
    if skipped:
        report_complete(c.out, json_, result)
    elif json_:
        emit_json({**result, "skipped": False})
    else:
        print_result(
            f"[green]scored[/] {result['rows']} samples → {c.out}  reward {result['reward/mean']:.4f} "
            f"± {result['reward/std']:.4f} (mean ± sd over the scored samples), {result[FAILED_COLUMN]} failed"
        )


score = config_command(ScoreConfig, "score", run)
