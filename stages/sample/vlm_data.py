"""Prompt rows for vision-language RL: verl's Parquet layout as is, and EasyR1-style raw columns.

verl: `data_source`, `prompt` (chat messages whose text holds literal `<image>` / `<video>` /
`<audio>` placeholders), `images` (list of {bytes, path} structs, raw bytes or paths), `videos`,
`audios`, `reward_model.ground_truth`, `extra_info`. EasyR1: `problem`, `answer`, `images`,
`videos`, `audios` (keys configurable). Rows come from any prompt source (`stages.sample.sources`).
Each row becomes a `VLMPrompt` whose messages are built as verl builds them (system and multi-turn
messages kept, each placeholder a typed content part at its position), whose media are encoded files
per kind (stored once per prompt downstream) and whose metadata carries what text rewards read
(`ground_truth`, `data_source`, `extra_info`).

Input modes: a row without media (no media column, null or an empty list) is a text-only prompt; a
row may hold several images, videos and audio clips, and one batch may mix rows of every kind. Each
media kind is one `MediaKind` entry (its column, placeholder and content-part type) in `MEDIA_KINDS`;
a kind's values are normalised to a list of encoded files per item: an image is one PNG/JPEG file, a
video a list of frame files (given as frames, or decoded from a video file with PyAV,
`decode_video_file`), an audio clip one audio file, checked to decode at sample time
(`stages.sample.vlm_audio`).
"""

from __future__ import annotations

import io
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.models.vlm_inputs import media_parts
from stages.sample.prompts import pick_rows
from stages.sample.sources import PromptSource, SourceRow
from stages.sample.vlm_audio import audio_bytes
from stages.tables import image_bytes, png_bytes


@dataclass(frozen=True)
class MediaKind:
    """One kind of media a prompt row can carry: its `type` (the content part `{"type": type}` and the
    processor's argument `type + "s"`), the verl/EasyR1 column holding a row's items and the literal
    placeholder that marks each item's position in the text."""

    type: str
    column: str
    placeholder: str


IMAGE = MediaKind("image", "images", "<image>")
VIDEO = MediaKind("video", "videos", "<video>")
AUDIO = MediaKind("audio", "audios", "<audio>")
MEDIA_KINDS = (IMAGE, VIDEO, AUDIO)
_PLACEHOLDERS = re.compile("(" + "|".join(re.escape(k.placeholder) for k in MEDIA_KINDS) + ")")
_BY_PLACEHOLDER = {k.placeholder: k for k in MEDIA_KINDS}
_PACK_MAGIC = b"OMNIIMG1"
# Frame sampling of a video file, qwen-vl-utils' defaults: 2 frames per second (also the rate of a
# video given as frames), a frame count that is a multiple of 2 (the temporal patch) and at least 4.
VIDEO_FPS = 2.0
VIDEO_FRAME_FACTOR = 2
VIDEO_MIN_FRAMES = 4
VIDEO_MAX_FRAMES = 768


@dataclass
class VLMPrompt:
    """A prompt row: `messages` as the model sees them (each `{"type": KIND}` part takes the next item
    of `media[KIND's column]`), `question` the user turns' text without placeholders (the rollout's
    `prompt` column, what rewards and reports read), `meta` what text rewards read.

    media: per kind column, the row's items as encoded files: `images` a list of PNG/JPEG files,
    `videos` a list of videos, each a list of frame files (its frame rate is the part's `fps`),
    `audios` a list of audio files (`stages.sample.vlm_audio`).
    """

    question: str
    media: dict[str, list[Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def images(self) -> list[bytes]:
        return self.media.get(IMAGE.column, [])

    @property
    def videos(self) -> list[list[bytes]]:
        return self.media.get(VIDEO.column, [])

    @property
    def audios(self) -> list[bytes]:
        return self.media.get(AUDIO.column, [])


def typed_parts(content: str) -> list[dict[str, Any]]:
    """verl's rule for a message of a row with media: the text is cut at every placeholder (`<image>`,
    `<video>`), each becoming a `{"type": "image"}` / `{"type": "video"}` part at its position and each
    non-empty piece between them a text part (kept as it is, spaces included)."""
    parts: list[dict[str, Any]] = []
    for piece in _PLACEHOLDERS.split(content):
        if piece in _BY_PLACEHOLDER:
            parts.append({"type": _BY_PLACEHOLDER[piece].type})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _as_messages(value: Any, where: str) -> list[dict[str, Any]]:
    """A row's prompt as chat messages: a string is one user message; every message needs a role and
    string (or typed-part list) content."""
    messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if not isinstance(messages, list) or not messages:
        raise UserInputError(f"{where}: 'prompt' must be text or a non-empty list of chat messages")
    out = []
    for m in messages:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), (str, list))
        ):
            raise UserInputError(f"{where}: every chat message needs a 'role' and text 'content'")
        content = m["content"]
        if isinstance(
            content, list
        ):  # typed parts read from Parquet carry every struct field, unset ones None
            content = [{k: v for k, v in p.items() if v is not None} for p in content if isinstance(p, dict)]
        out.append({**{k: v for k, v in m.items() if v is not None}, "content": content})
    if not any(m["role"] == "user" for m in out):
        raise UserInputError(f"{where}: the prompt's chat messages have no user message")
    return out


def build_messages(
    value: Any, counts: dict[str, int], where: str, columns: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The chat messages of a row as verl's `RLHFDataset._build_messages` makes them: system, user and
    assistant turns kept in order; in a row with media every string content cut into typed parts
    (`typed_parts`). `counts` is the number of items per media type ("image", "video"); each type's
    parts must match its items one to one, except that a type with items but no placeholder at all
    gets its parts before the text of the first user turn (images, then videos). A mismatch names the
    row and the column (`columns`: type → column name, default `MediaKind.column`)."""
    messages = _as_messages(value, where)
    if any(counts.values()):
        messages = [
            {**m, "content": typed_parts(m["content"]) if isinstance(m["content"], str) else m["content"]}
            for m in messages
        ]
    leading: list[dict[str, Any]] = []
    for kind in MEDIA_KINDS:
        items, placed = counts.get(kind.type, 0), len(media_parts(messages, kind.type))
        if placed == 0 and items:
            leading += [{"type": kind.type} for _ in range(items)]
        elif placed != items:
            column = (columns or {}).get(kind.type, kind.column)
            raise UserInputError(
                f"{where}: {placed} {kind.placeholder} placeholders but column '{column}' holds "
                f"{items} {kind.type}s; a row needs one {kind.type} per placeholder"
            )
    if leading:
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[first] = {**messages[first], "content": leading + messages[first]["content"]}
    return messages


def question_text(messages: list[dict[str, Any]]) -> str:
    """The user turns' text, placeholders removed, one line break between turns."""
    texts = []
    for m in messages:
        if m["role"] != "user":
            continue
        content = m["content"]
        if isinstance(content, list):
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        texts.append(_PLACEHOLDERS.sub("", content))
    return "\n".join(texts).strip()


def _media_list(value: Any, column: str, where: str) -> list[Any]:
    """A row's media column as a list: null or absent is none (a text-only row)."""
    if value is None:
        return []
    if hasattr(value, "tolist") and not isinstance(value, (bytes, bytearray)):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise UserInputError(f"{where}: column '{column}' must hold a list per row")
    return list(value)


def decode_video_file(blob: bytes, where: str, fps: float = VIDEO_FPS) -> tuple[list[bytes], float]:
    """A video file (any container PyAV reads, e.g. MP4) → frames sampled as qwen-vl-utils samples
    them, as PNG files, and their frame rate: round(seconds · fps) frames, rounded to a multiple of
    `VIDEO_FRAME_FACTOR` within [`VIDEO_MIN_FRAMES`, min(`VIDEO_MAX_FRAMES`, frames in the file)], taken
    at evenly spaced indices; the rate is frames kept / frames in the file × the file's rate. Stored
    as frames, the video replays without decoding it again."""
    from stages.media.video import MediaDecodeError, decode_video

    try:
        video = decode_video(blob)
    except MediaDecodeError as exc:
        raise UserInputError(f"{where}: a video file: {exc}; or give the video as a list of frames") from None
    frames, rate = video.frames, video.fps
    total = len(frames)
    wanted = round(total / rate * fps / VIDEO_FRAME_FACTOR) * VIDEO_FRAME_FACTOR
    ceiling = max(VIDEO_FRAME_FACTOR, min(VIDEO_MAX_FRAMES, total) // VIDEO_FRAME_FACTOR * VIDEO_FRAME_FACTOR)
    count = min(max(wanted, VIDEO_MIN_FRAMES), ceiling)
    index = [round(k * (total - 1) / max(1, count - 1)) for k in range(count)]
    return [png_bytes(frames[i]) for i in index], count / total * rate


def video_frames(value: Any, base: Path, where: str) -> tuple[list[bytes], float]:
    """One video of a row → (frame files, frame rate). A video is a list of frames (each as an image
    is given), a video file (bytes, {bytes, path} struct or path; `decode_video_file`), or a dict
    `{"video": frames or file, "fps": rate}` (qwen-vl-utils' form; frames default to `VIDEO_FPS`)."""
    fps = None
    if isinstance(value, dict) and "video" in value:
        fps = value.get("fps")
        value = value["video"]
    if hasattr(value, "tolist") and not isinstance(value, (bytes, bytearray)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            raise UserInputError(f"{where}: a video is an empty list of frames")
        return [image_bytes(frame, base, where) for frame in value], float(fps or VIDEO_FPS)
    return decode_video_file(image_bytes(value, base, where), where, float(fps or VIDEO_FPS))


def vlm_prompt(
    row: SourceRow,
    *,
    layout: str = "verl",
    prompt_key: str = "problem",
    answer_key: str = "answer",
    image_key: str = "images",
    video_key: str = "videos",
    audio_key: str = "audios",
) -> VLMPrompt:
    """One row of a verl table (`layout="verl"`) or an EasyR1-style table (`layout="easyr1"`); its
    `audio_key` column (`audios`) lists the row's audio clips (forms: `stages.sample.vlm_audio`)."""
    data, where = row.data, row.where
    if layout == "verl":
        if "prompt" not in data:
            raise UserInputError(
                f"{where}: no 'prompt' column (verl layout); use --layout easyr1 for problem/answer"
            )
        prompt = data["prompt"]
        reward_model = data.get("reward_model") or {}
        meta = {
            "ground_truth": reward_model.get("ground_truth"),
            "data_source": data.get("data_source"),
            "extra_info": data.get("extra_info") or {},
        }
    else:
        if prompt_key not in data:
            raise UserInputError(f"{where}: no '{prompt_key}' column (--prompt-key)")
        prompt = str(data[prompt_key])
        meta = {
            "ground_truth": data.get(answer_key),
            "data_source": row.name,
            "extra_info": {"index": row.index},
        }
    images = [image_bytes(im, row.base, where) for im in _media_list(data.get(image_key), image_key, where)]
    videos = [video_frames(v, row.base, where) for v in _media_list(data.get(video_key), video_key, where)]
    audios = [audio_bytes(a, row.base, where) for a in _media_list(data.get(audio_key), audio_key, where)]
    messages = build_messages(
        prompt,
        {IMAGE.type: len(images), VIDEO.type: len(videos), AUDIO.type: len(audios)},
        where,
        {IMAGE.type: image_key, VIDEO.type: video_key, AUDIO.type: audio_key},
    )
    for part, (_, fps) in zip(media_parts(messages, VIDEO.type), videos):
        part["fps"] = fps
    media = {IMAGE.column: images, VIDEO.column: [frames for frames, _ in videos], AUDIO.column: audios}
    return VLMPrompt(question_text(messages), media, meta, messages)


def read_vlm_prompts(
    source: PromptSource | str | Path | Sequence[str | Path], **keys: str
) -> list[VLMPrompt]:
    """Every row of a prompt source as a `VLMPrompt`; `keys` are `vlm_prompt`'s layout and column names."""
    return [p for _, p in pick_rows(source, None, 0, partial(vlm_prompt, **keys))]


def sample_vlm_prompts(
    source: PromptSource | str | Path | Sequence[str | Path], num: int | None, seed: int, **keys: str
) -> list[tuple[int, VLMPrompt]]:
    """(index, prompt) of `num` rows drawn with `seed` (all when None), reading only those rows."""
    return pick_rows(source, num, seed, partial(vlm_prompt, **keys))


def unpack_images(blob: bytes, where: str) -> list[bytes]:
    """The image files of a schema-version-1 VLM rollout, packed into one blob: magic `OMNIIMG1`,
    count (u32), lengths (u64 each), the files. A malformed blob names `where` (set and sample)."""
    blob = bytes(blob)
    start = len(_PACK_MAGIC) + 4
    if not blob.startswith(_PACK_MAGIC) or len(blob) < start:
        raise UserInputError(
            f"{where}: the images column does not hold packed images; re-run `omnirl sample`"
        )
    (count,) = struct.unpack_from("<I", blob, len(_PACK_MAGIC))
    offset, out = start + 8 * count, []
    # A blob shorter than its header lists no lengths and fails the size check below.
    lengths = struct.unpack_from(f"<{count}Q", blob, start) if len(blob) >= offset else ()
    for length in lengths:
        out.append(blob[offset : offset + length])
        offset += length
    if offset != len(blob):
        raise UserInputError(f"{where}: the packed images are truncated or padded; re-run `omnirl sample`")
    return out


def decode_image(blob: bytes, where: str) -> Any:
    """Encoded bytes → RGB PIL image; unreadable bytes name `where`."""
    from PIL import Image

    try:
        return Image.open(io.BytesIO(blob)).convert("RGB")
    except Exception:
        raise UserInputError(
            f"{where}: an image is not a readable PNG/JPEG file; re-run `omnirl sample` or fix the data"
        ) from None
