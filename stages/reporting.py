"""Run reports: the per-iteration reward table (`collect`) and the reward-curve PNG.

A run directory holds `it<K>/{samples,rewards,advantages,...}` shard sets and `it<K>/policy`
adapters (the layout the recipes write). Plots are drawn with Pillow, so no plotting stack is needed.
Each iteration's sheets of samples (image grids, video contact sheets, response pages) are
report_sheets.py's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.shards.manifest import MANIFEST_NAME, read_manifest
from stages.shards.run_card import EVAL_DIR, ITER_DIR

TAG_KEY = "tag"  # the prompt_meta key of a prompt's task family (GenEval metadata's "tag")


def iterations(run: Path) -> list[tuple[int, Path]]:
    """(k, it<k> directory) pairs of a run, in order."""
    if not run.is_dir():
        raise UserInputError(f"{run}: no such run directory")
    found = sorted(
        (int(m.group(1)), p) for p in run.iterdir() if (m := ITER_DIR.match(p.name)) and p.is_dir()
    )
    return found


SOURCE_KEY = "data_source"  # the prompt_meta key of a prompt's data source (verl's data_source column)
MEDIA_KINDS = ("image", "video", "audio")  # the chat-message part types of a VLM prompt's media
TEXT_ONLY = "text"  # the media kind of a prompt without any


def prompt_media(messages: Any) -> list[str]:
    """The media kinds (`MEDIA_KINDS`, in that order) of a prompt's chat messages, or [`TEXT_ONLY`] for a
    prompt without media."""
    from stages.models.vlm_inputs import media_parts

    listed = messages if isinstance(messages, list) else []
    kinds = [kind for kind in MEDIA_KINDS if media_parts(listed, kind)]
    return kinds or [TEXT_ONLY]


def row_slices(
    meta: Sequence[Any] | None = None, messages: Sequence[Any] | None = None
) -> dict[str, list[bool]]:
    """The subsets of a rollout's rows that reward statistics are also given for, by name: `tag/<tag>`
    (prompt_meta's GenEval task family), `source/<data_source>` (prompt_meta's data source, verl's
    data_source column) and, with the rows' chat `messages` (a VLM rollout), `media/<kind>` for each
    media kind a prompt holds (image, video, audio; text for none; a prompt with an image and audio
    counts under both)."""
    slices: dict[str, list[bool]] = {}
    for prefix, key in (("tag", TAG_KEY), ("source", SOURCE_KEY)):
        values = [m.get(key) if isinstance(m, Mapping) else None for m in meta or ()]
        for value in sorted({v for v in values if isinstance(v, str) and v}):
            slices[f"{prefix}/{value}"] = [v == value for v in values]
    kinds = [prompt_media(m) for m in messages or ()]
    for kind in (*MEDIA_KINDS, TEXT_ONLY):
        if any(kind in k for k in kinds):
            slices[f"media/{kind}"] = [kind in k for k in kinds]
    return slices


def reward_statistics(
    rewards: Mapping[str, Any], meta: Sequence[Any] | None = None, messages: Sequence[Any] | None = None
) -> dict[str, float]:
    """`<column>/mean` and `<column>/std` (population) of every float reward column (`reward`,
    `reward.<name>`) of a scored batch: what `score` reports and the trackers log.

    With the rows' prompt_meta `meta` (and chat `messages`), also `<column>/<slice>/mean` over the rows
    of each `row_slices` subset: per GenEval tag (`tag/<tag>`: single_object, counting, ..., so a strict
    0/1 reward such as geneval_strict reports GenEval's per-tag accuracy, and `<column>/tag_mean`, their
    unweighted mean, GenEval's overall score), per data source (`source/<data_source>`) and per media
    kind (`media/image`, `media/video`, `media/audio`, `media/text`): a 0/1 reward's mean there is that
    subset's accuracy.

    Rows whose reward failed (`failed_rewards`) are left out: their stored value is no reward.
    """
    import torch

    from stages.score.scoring import failed_rewards

    columns = {k: v for k, v in rewards.items() if k.startswith("reward") and isinstance(v, torch.Tensor)}
    scored = ~failed_rewards(columns, len(next(iter(columns.values()), ())))
    slices = {name: torch.tensor(rows) & scored for name, rows in row_slices(meta, messages).items()}
    stats = {}
    for key, column in columns.items():
        if column.dtype.is_floating_point:
            stats[f"{key}/mean"] = float(column[scored].mean())
            stats[f"{key}/std"] = float(column[scored].std(unbiased=False))
            per_tag = []
            for name, rows in slices.items():
                stats[f"{key}/{name}/mean"] = float(column[rows].double().mean())
                if name.startswith("tag/"):
                    per_tag.append(stats[f"{key}/{name}/mean"])
            if per_tag:
                stats[f"{key}/tag_mean"] = sum(per_tag) / len(per_tag)
    return stats


def _summary(rewards: Mapping[str, Any], rows: Any) -> dict[str, Any]:
    """Samples, mean, standard error of the mean (sample std / √n), std, min and max of `reward` over the
    boolean `rows`, and the mean of every `reward.<name>` column there as `reward.<name>_mean`."""
    r = rewards["reward"].double()[rows]
    n = int(r.numel())
    row: dict[str, Any] = {
        "samples": n,
        "reward_mean": float(r.mean()),
        "reward_se": float(r.std() / math.sqrt(n)) if n > 1 else 0.0,
        "reward_std": float(r.std(unbiased=False)),
        "reward_min": float(r.min()) if n else math.nan,
        "reward_max": float(r.max()) if n else math.nan,
    }
    for key in rewards:
        if key.startswith("reward.") and rewards[key].dtype.is_floating_point:
            row[f"{key}_mean"] = float(rewards[key].double()[rows].mean())
    return row


def reward_stats(rewards_dir: Path, samples_dir: Path | None = None) -> dict[str, Any]:
    """Summary of one rewards shard set (`_summary`: samples, mean, standard error, std, min, max of
    `reward`, each `reward.<name>` mean, e.g. an accuracy). Rows whose reward failed are left out of all
    of them and counted as `reward_failed`. With the rollout's `samples_dir`, also the summary of each
    data source (`sources`: verl's data_source) and media kind (`media`: image, video, audio, text) of
    `row_slices`, where the rollout has more than one source or kind."""
    import torch

    from stages.score.scoring import failed_rewards
    from stages.shards.reader import ShardSet

    rewards = ShardSet(rewards_dir).read_all()
    scored = ~failed_rewards(rewards, len(rewards["sample_id"]))
    row = {**_summary(rewards, scored), "reward_failed": int((~scored).sum())}
    if samples_dir is None or not (samples_dir / MANIFEST_NAME).is_file():
        return row
    samples = ShardSet(samples_dir)
    prompts = samples.read_all([c for c in ("sample_id", "prompt_meta", "messages") if c in samples.columns])
    if prompts["sample_id"] != rewards["sample_id"]:
        raise UserInputError(
            f"{rewards_dir}: its rows are not those of {samples_dir} (sample_id differs); re-run `omnirl score "
            f"--in {samples_dir}`"
        )
    slices = row_slices(prompts.get("prompt_meta"), prompts.get("messages"))
    for group, prefix in (("sources", "source/"), ("media", "media/")):
        named = {k[len(prefix) :]: rows for k, rows in slices.items() if k.startswith(prefix)}
        if len(named) > 1:
            row[group] = {k: _summary(rewards, torch.tensor(rows) & scored) for k, rows in named.items()}
    return row


# The statistics of an update's optimizer steps that `omnirl report` tabulates per iteration and
# `omnirl update` prints, each the mean over that update's steps: (summary name, metrics.jsonl key).
STEP_MEANS = (
    ("pg_loss", "actor/pg_loss"),
    ("ratio_mean", "actor/ratio_mean"),
    ("clipfrac", "actor/pg_clipfrac"),
    ("grad_norm", "actor/grad_norm"),
)


def step_means(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean over an update's optimizer steps (its metrics records, one per step) of each `STEP_MEANS`
    statistic the records hold; one a loss never logs (dpo has no pg_loss) is left out."""
    means = {}
    for name, key in STEP_MEANS:
        values = [float(m[key]) for m in records if m.get(key) is not None]
        if values:
            means[name] = sum(values) / len(values)
    return means


def collect(run: Path, iteration: int | None = None) -> list[dict[str, Any]]:
    """One summary row per iteration that has scored samples (`reward_stats` of it<K>/rewards), with the
    advantage and replay statistics, the update's `step_means`, and under `eval` the `reward_stats` of
    it<K>/eval/rewards: the policy of iteration K on a held-out prompt set (what `recipes/eval.mk`
    writes). With `iteration`, that iteration's row alone (none before it is scored)."""
    rows = []
    for k, it in iterations(run):
        if iteration is not None and k != iteration:
            continue
        rewards_dir = it / "rewards"
        eval_dir = it / EVAL_DIR / "rewards"
        has_eval = (eval_dir / MANIFEST_NAME).is_file()
        if not (rewards_dir / MANIFEST_NAME).is_file() and not has_eval:
            continue
        row: dict[str, Any] = {"iteration": k}
        if (rewards_dir / MANIFEST_NAME).is_file():
            row.update(reward_stats(rewards_dir, it / "samples"))
        if has_eval:
            row["eval"] = reward_stats(eval_dir, it / EVAL_DIR / "samples")
        adv_dir = it / "advantages"
        if (adv_dir / MANIFEST_NAME).is_file():
            stats = read_manifest(adv_dir).extra.get("stats", {})
            row["zero_std_ratio"] = stats.get("zero_std_ratio")
        lp_dir = it / "logprobs"
        if (lp_dir / MANIFEST_NAME).is_file():
            row["replay_abs_delta_max"] = read_manifest(lp_dir).extra.get("abs_delta_max")
        metrics = run / f"it{k + 1}" / "policy" / "metrics.jsonl"
        if metrics.is_file():
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            row.update(step_means(records))
        rows.append(row)
    return rows


CURVE_SERIES = (
    ("sampled (training) reward", None, (30, 90, 200), (205, 222, 245)),
    ("held-out eval reward", "eval", (210, 90, 20), (250, 222, 200)),
)


def reward_curve(rows: list[dict[str, Any]], path: Path, *, size: tuple[int, int] = (640, 400)) -> Path:
    """Mean reward per iteration with a ±1 standard-error band, as a PNG at `path`: the training
    samples' reward and, where the rows have one, the held-out evaluation's (`collect`'s `eval`)."""
    series = []
    for name, key, line, band in CURVE_SERIES:
        points = [
            (r["iteration"], s["reward_mean"], s.get("reward_se", 0.0))
            for r in rows
            if (s := (r.get(key) if key else r)) and "reward_mean" in s
        ]
        if points:
            series.append((name, points, line, band))
    if not series:
        raise UserInputError("no scored iterations to plot (no it<K>/rewards shard sets)")
    path.parent.mkdir(parents=True, exist_ok=True)
    curve_image(series, title="mean reward per iteration (band: ±1 standard error)", size=size).save(path)
    return path


# One curve of `curve_image`: its legend name, (iteration, mean, standard error) points, line colour and
# band colour (None: the ±1 se as a whisker at each point, for plots of many curves).
Curve = tuple[str, Sequence[tuple[int, float, float]], tuple[int, int, int], tuple[int, int, int] | None]

# Line colours told apart at a glance, for plots of up to ten curves (`CURVE_COLOURS[i % 10]`).
CURVE_COLOURS = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
)  # fmt: skip


def curve_image(series: Sequence[Curve], *, title: str, size: tuple[int, int] = (640, 400)) -> Any:
    """Curves of a mean per iteration with its ±1 standard error (`Curve`: a band, or a whisker per
    point) and a legend, as a PIL image: `reward_curve`'s plot and the leaderboard's panels
    (recipes/leaderboard.py)."""
    from PIL import Image, ImageDraw

    w, h = size
    left, right, top, bottom = 70, 20, 30 + 14 * len(series), 45
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    xs = [x for _, points, _, _ in series for x, _, _ in points]
    lo = min(m - se for _, points, _, _ in series for _, m, se in points)
    hi = max(m + se for _, points, _, _ in series for _, m, se in points)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    x_min, x_span = min(xs), (max(xs) - min(xs)) or 1

    def px(x: float, y: float) -> tuple[float, float]:
        return (
            left + (x - x_min) / x_span * (w - left - right),
            top + (hi - y) / (hi - lo) * (h - top - bottom),
        )

    for _, points, _, band in series:
        if band is not None and len(points) > 1:
            outline = [px(x, m + se) for x, m, se in points] + [
                px(x, m - se) for x, m, se in reversed(points)
            ]
            draw.polygon(outline, fill=band)
    draw.line([(left, top), (left, h - bottom), (w - right, h - bottom)], fill="black")
    for i in range(5):
        y = lo + (hi - lo) * i / 4
        _, yy = px(x_min, y)
        draw.line([(left - 4, yy), (left, yy)], fill="black")
        draw.text((5, yy - 6), f"{y:.3g}", fill="black")
    for x in sorted(set(xs)):
        xx, _ = px(x, lo)
        draw.text((xx - 4, h - bottom + 6), str(x), fill="black")
    for row, (name, points, line, band) in enumerate(series):
        centres = [px(x, m) for x, m, _ in points]
        if band is None:
            for x, m, se in points:
                (xx, y0), (_, y1) = px(x, m - se), px(x, m + se)
                draw.line([(xx, y0), (xx, y1)], fill=line, width=1)
        if len(centres) > 1:
            draw.line(centres, fill=line, width=3)
        for x, y in centres:
            draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=line)
        draw.line([(left, 28 + 14 * row), (left + 24, 28 + 14 * row)], fill=line, width=3)
        draw.text((left + 30, 22 + 14 * row), "  ".join(name.split()), fill="black")
    draw.text((left, 8), "  ".join(title.split()), fill="black")
    draw.text((w // 2 - 20, h - 18), "iteration", fill="black")
    return img
