"""Encoded media of a rollout's outputs: PNG images and MP4 videos, and the columns that hold them.

A family adapter's `decode` returns one output per sample: a PIL image (an image family) or a list of
PIL frames (a video family). `media_columns` turns them into the shard columns `sample` writes
(`image`: PNG bytes; `video`: MP4 bytes, `stages.media.video`), and `output_modality` names the kind
of rollout those columns make ("image" or "video", recorded in the manifest for the stages after it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stages.media.video import encode_mp4s
from stages.tables import png_bytes

FRAMES_COLUMN = "frames"  # the lossless frames of a video rollout (`--save-frames`): PNG per frame
# the media columns a decoded batch may make, and the file format of their cells
MEDIA_FORMATS = {"image": "png", "video": "mp4"}
_SIGNATURES = {"png": lambda b: b.startswith(b"\x89PNG\r\n\x1a\n"), "mp4": lambda b: b[4:8] == b"ftyp"}
MEDIA_COLUMNS = (*MEDIA_FORMATS, FRAMES_COLUMN)  # the decoded outputs' columns a rollout may hold


def is_video(output: Any) -> bool:
    """Whether one decoded output is a video (a list or tuple of frames) rather than an image."""
    return isinstance(output, (list, tuple))


def media_columns(outputs: Sequence[Any], fps: float, *, save_frames: bool = False) -> dict[str, list]:
    """The media columns of B decoded outputs: ``{"image": [PNG bytes]}`` for images, or
    ``{"video": [MP4 bytes]}`` for frame lists (at `fps`, the clips encoded concurrently: `encode_mp4s`),
    plus ``{"frames": [[PNG bytes per frame]]}`` with `save_frames`. A batch mixes no images and videos."""
    videos = [is_video(o) for o in outputs]
    if any(videos) and not all(videos):
        raise ValueError("a decoded batch mixes images and frame lists")
    if not all(videos) or not outputs:
        return {"image": [png_bytes(o) for o in outputs]}
    out: dict[str, list] = {"video": encode_mp4s(outputs, fps)}
    if save_frames:
        out[FRAMES_COLUMN] = [[png_bytes(f) for f in frames] for frames in outputs]
    return out


def output_modality(kinds: Sequence[str]) -> str:
    """The modality of a diffusion rollout whose columns have `kinds`: "video" when it holds a video
    column, else "image"."""
    return "video" if "video" in kinds else "image"


def media_column(columns: Mapping[str, Any]) -> str:
    """The name of the media column among a rollout's `columns` (`MEDIA_FORMATS`: "image" or "video")."""
    found = [name for name in MEDIA_FORMATS if name in columns]
    if len(found) != 1:
        raise ValueError(f"a rollout holds one media column of {list(MEDIA_FORMATS)}, not {found}")
    return found[0]


def has_signature(fmt: str, blob: bytes) -> bool:
    """Whether `blob` starts like a file of format `fmt` ("png": its 8-byte signature; "mp4": an ISO
    media file, whose first box is ``ftyp``). Unknown formats never match."""
    check = _SIGNATURES.get(fmt)
    return check is not None and check(blob)
