"""The per-iteration sample sheets of a run report (`omnirl report`): image grids, a video run's contact
sheets and GIF preview, before/after comparisons, and a text rollout's page of responses.

Drawn with Pillow, so no plotting stack is needed. A video run's grids are contact sheets: each sample
is its first, middle and last frame side by side (`KEY_FRAMES`); `video_preview` animates the first
samples together as a GIF. A conditioned run's grids (an editing or image-to-video model's,
`stages.models.condition_images`) show each prompt group's source image first, in a column of its own,
then its results: source → result. The numbers and curves of a report are reporting.py's.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.shards.manifest import MANIFEST_NAME, read_manifest

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
