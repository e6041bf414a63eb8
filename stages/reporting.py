"""Run reports: per-iteration reward table, a reward-curve PNG and per-iteration image grids.

A run directory holds `it<K>/{samples,rewards,advantages,...}` shard sets and `it<K>/policy`
adapters (the layout the recipes write). Plots are drawn with Pillow, so no plotting stack is needed.
A video run's grids are contact sheets: each sample is its first, middle and last frame side by side
(`KEY_FRAMES`); `video_preview` animates the first samples together as a GIF. A conditioned run's
grids (an editing or image-to-video model's, `stages.models.condition_images`) show each prompt group's
source image first, in a column of its own, then its results: source → result.
"""

from __future__ import annotations

import io
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


LABEL_WIDTH = 170  # the prompt column beside each grid row
LINE_HEIGHT = 14
KEY_FRAMES = 3  # a video's tile in a contact sheet: its first, middle and last frame


def key_frame_indices(count: int) -> list[int]:
    """The first, middle and last frame of a `count`-frame video (repeated for very short ones)."""
    return [0, (count - 1) // 2, count - 1]


def _tile(data: bytes, media: str, cell: int) -> Any:
    """One sample's tile: its image `cell`×`cell`, or for a video its key frames side by side
    (`KEY_FRAMES`·`cell` wide)."""
    from PIL import Image

    if media != "video":
        return Image.open(io.BytesIO(data)).convert("RGB").resize((cell, cell), Image.Resampling.NEAREST)
    from stages.media.video import decode_mp4

    frames = decode_mp4(data).frames
    strip = Image.new("RGB", (KEY_FRAMES * cell, cell), "white")
    for j, index in enumerate(key_frame_indices(len(frames))):
        strip.paste(frames[index].resize((cell, cell), Image.Resampling.NEAREST), (j * cell, 0))
    return strip


def _rollout(samples: Path, rewards: Path | None) -> Any:
    """The samples shard set, zipped with its rewards when they exist."""
    from stages.shards.reader import ShardSet, open_inputs

    paths = [samples] + ([rewards] if rewards and (rewards / MANIFEST_NAME).is_file() else [])
    return open_inputs(paths) if len(paths) > 1 else ShardSet(samples)


def has_media(samples: Path, rewards: Path | None, media: str = "image") -> bool:
    """Whether the samples or their rewards hold the `media` column a grid draws: a rollout sampled with
    --defer-decode (`stages.media.deferred`) has one only where `score --keep-media` wrote it."""
    return ("video" if media == "video" else "image") in _rollout(samples, rewards).columns


Group = tuple[str, list[tuple[bytes, float | None]], bytes | None]


def _groups(samples: Path, rewards: Path | None, media: str = "image") -> list[Group]:
    """The first shard's prompt groups in order: (prompt, [(PNG or, for `media` "video", MP4 bytes,
    reward or None)], the group's first condition image or None); the media from the samples, or from
    the rewards (`score --keep-media`)."""
    from stages.models.condition_images import stored_condition_images

    column = "video" if media == "video" else "image"
    src = _rollout(samples, rewards)
    sources = stored_condition_images([samples], [read_manifest(samples)])
    cols = ["sample_id", "group_id", "prompt", column] + (["reward"] if "reward" in src.columns else [])
    data = src.read_shard(0, columns=cols)
    order: dict[str, list[int]] = {}
    for i, g in enumerate(data["group_id"]):
        order.setdefault(g, []).append(i)
    return [
        (
            data["prompt"][members[0]],
            [(data[column][i], float(data["reward"][i]) if "reward" in data else None) for i in members],
            next(iter(sources.get(group) or []), None),
        )
        for group, members in order.items()
    ]


def _wrap(text: str, width: int, draw: Any) -> list[str]:
    """`text` broken at spaces into lines at most `width` pixels wide in the default font (words two
    spaces apart: its space is a sliver)."""
    lines: list[str] = []
    for word in text.split():
        trial = f"{lines[-1]}  {word}" if lines else word
        if lines and draw.textlength(trial) <= width:
            lines[-1] = trial
        else:
            lines.append(word)
    return lines


def _reward_colour(value: float, lo: float, hi: float) -> tuple[int, int, int]:
    """Red (lowest reward of the grid) to green (highest)."""
    t = 0.5 if hi - lo < 1e-12 else (value - lo) / (hi - lo)
    return round(220 * (1 - t)), round(170 * t), 40


def _draw_rows(
    blocks: list[list[Group]],
    headers: list[str] | None,
    path: Path,
    *,
    per_group: int,
    cell: int,
    media: str = "image",
) -> Path:
    """Rows of images (for `media` "video", key-frame strips) with the prompt beside each: `blocks` are
    side-by-side column blocks (one per policy) over the same prompts; each tile is labelled with its
    reward and underlined in a colour from red (the grid's lowest reward) to green (its highest). When
    the rows have condition images, a "source" column shows each row's before the blocks."""
    from PIL import Image, ImageDraw

    kinds = [media] * len(blocks)
    if any(row[2] is not None for row in blocks[0]):  # source → result
        blocks = [[(p, [] if s is None else [(s, None)], s) for p, _, s in blocks[0]], *blocks]
        headers = ["source", *(headers or [""] * len(kinds))]
        kinds = ["image", *kinds]

    rewards = [r for block in blocks for row in block for _, r in row[1][:per_group] if r is not None]
    lo, hi = (min(rewards), max(rewards)) if rewards else (0.0, 0.0)
    n_rows = len(blocks[0])
    widths = [min(per_group, max(len(row[1]) for row in block)) for block in blocks]
    gap = 12
    top = LINE_HEIGHT + 4 if headers else 0
    row_h = cell + LINE_HEIGHT + 4
    tile_ws = [cell * (KEY_FRAMES if kind == "video" else 1) for kind in kinds]
    width = LABEL_WIDTH + sum(n * w for n, w in zip(widths, tile_ws)) + gap * (len(blocks) - 1)
    img = Image.new("RGB", (width, top + n_rows * row_h), "white")
    draw = ImageDraw.Draw(img)
    x0s = []
    x = LABEL_WIDTH
    for n, tile_w in zip(widths, tile_ws):
        x0s.append(x)
        x += n * tile_w + gap
    for x0, header in zip(x0s, headers or []):
        draw.text((x0 + 2, 2), "  ".join(header.split()), fill="black")
    for r in range(n_rows):
        y = top + r * row_h
        prompt = blocks[0][r][0]
        for i, line in enumerate(_wrap(prompt, LABEL_WIDTH - 8, draw)[: cell // LINE_HEIGHT]):
            draw.text((4, y + LINE_HEIGHT + 4 + i * LINE_HEIGHT), line, fill="black")
        for x0, n, block, kind, tile_w in zip(x0s, widths, blocks, kinds, tile_ws):
            for c, (data, reward) in enumerate(block[r][1][:n]):
                img.paste(_tile(data, kind, cell), (x0 + c * tile_w, y + LINE_HEIGHT))
                if reward is not None:
                    colour = _reward_colour(reward, lo, hi)
                    draw.text((x0 + c * tile_w + 2, y), f"{reward:.3f}", fill=colour)
                    draw.rectangle(
                        [
                            x0 + c * tile_w + 1,
                            y + LINE_HEIGHT + cell,
                            x0 + (c + 1) * tile_w - 2,
                            y + LINE_HEIGHT + cell + 2,
                        ],
                        fill=colour,
                    )
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def image_grid(
    samples: Path, rewards: Path | None, path: Path, *, groups: int = 4, per_group: int = 8, cell: int = 96
) -> Path:
    """A grid of the first `groups` prompt groups (rows, the prompt beside each) × `per_group` members,
    each labelled with its reward."""
    return _draw_rows([_groups(samples, rewards)[:groups]], None, path, per_group=per_group, cell=cell)


def contact_sheet(
    samples: Path, rewards: Path | None, path: Path, *, groups: int = 4, per_group: int = 4, cell: int = 64
) -> Path:
    """A video rollout's grid: the first `groups` prompt groups (rows, the prompt beside each) ×
    `per_group` samples, each shown as its first, middle and last frame and labelled with its reward.
    The PNG is LABEL_WIDTH + per_group·KEY_FRAMES·cell wide and groups·(cell + LINE_HEIGHT + 4) high."""
    rows = _groups(samples, rewards, "video")[:groups]
    return _draw_rows([rows], None, path, per_group=per_group, cell=cell, media="video")


def video_preview(
    samples: Path,
    path: Path,
    *,
    count: int = 8,
    columns: int = 4,
    cell: int = 96,
    max_frames: int = 48,
    rewards: Path | None = None,
) -> Path:
    """An animated GIF of the first `count` samples of a video rollout, playing together in a grid of
    `columns` (`cell`-pixel tiles) at their fps; longer videos are shown every k-th frame (at most
    `max_frames` frames, k times as long each). A video that ends early holds its last frame. The videos
    come from the samples, or from `rewards` where `score --keep-media` wrote them."""
    from PIL import Image

    from stages.media.video import decode_mp4

    blobs = _rollout(samples, rewards).read_shard(0, columns=["video"])["video"][:count]
    videos = [decode_mp4(blob) for blob in blobs]
    if not videos:
        raise UserInputError(f"{samples}: no video to preview")
    length = max(len(v.frames) for v in videos)
    step = max(1, math.ceil(length / max_frames))
    columns = min(columns, len(videos))
    rows = math.ceil(len(videos) / columns)
    pictures = []
    for t in range(0, length, step):
        canvas = Image.new("RGB", (columns * cell, rows * cell), "white")
        for i, video in enumerate(videos):
            frame = video.frames[min(t, len(video.frames) - 1)].resize(
                (cell, cell), Image.Resampling.BILINEAR
            )
            canvas.paste(frame, ((i % columns) * cell, (i // columns) * cell))
        pictures.append(canvas)
    duration = max(20, round(1000 * step / videos[0].fps))  # GIF frame times are in 10 ms units
    path.parent.mkdir(parents=True, exist_ok=True)
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=duration, loop=0)
    return path


def comparison_grid(
    before: tuple[Path, Path | None],
    after: tuple[Path, Path | None],
    path: Path,
    *,
    headers: tuple[str, str] = ("before", "after"),
    groups: int = 8,
    per_group: int = 4,
    cell: int = 64,
    media: str = "image",
) -> Path | None:
    """Before/after grid: per prompt (rows, the prompt beside each), `per_group` samples of the
    `before` (samples, rewards) sets next to the same prompt's samples of `after` (key-frame strips for
    `media` "video"). Meant for two rollouts of the same prompts and seeds (a held-out evaluation, or a
    fixed-seed recipe), so a column is the same starting noise under two policies; None when their
    prompts differ."""
    first, last = _groups(*before, media), _groups(*after, media)
    if [row[0] for row in first] != [row[0] for row in last]:
        return None
    blocks = [first[:groups], last[:groups]]
    return _draw_rows(blocks, list(headers), path, per_group=per_group, cell=cell, media=media)


def response_sheet(samples: Path, rewards: Path | None, path: Path, *, groups: int = 8) -> Path:
    """A Markdown page of a text rollout: per prompt group (first `groups`), the question, its ground
    truth and every response with its reward, best first."""
    src = _rollout(samples, rewards)
    cols = ["sample_id", "group_id", "prompt", "prompt_meta", "response_text"]
    data = src.read_shard(0, columns=cols + (["reward"] if "reward" in src.columns else []))
    order: dict[str, list[int]] = {}
    for i, g in enumerate(data["group_id"]):
        order.setdefault(g, []).append(i)
    lines = [f"# Responses of {samples}", ""]
    for group, members in list(order.items())[:groups]:
        first = members[0]
        truth = (data["prompt_meta"][first] or {}).get("ground_truth")
        lines += [f"## {group}: {data['prompt'][first]}", "", f"ground truth: `{truth}`", ""]
        if "reward" in data:
            members = sorted(members, key=lambda i: -float(data["reward"][i]))
        lines += ["| sample | reward | response |", "|---|---|---|"]
        for i in members:
            reward = f"{float(data['reward'][i]):.4f}" if "reward" in data else ""
            text = data["response_text"][i].replace("|", "\\|").replace("\n", "⏎")
            lines.append(f"| {data['sample_id'][i]} | {reward} | {text} |")
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path
