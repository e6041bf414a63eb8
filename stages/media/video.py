"""MP4 video files (H.264, yuv420p) from PIL frames and back, through PyAV (FFmpeg's libraries).

`encode_mp4(frames, fps)` writes an MP4 that standard players and tools read (ffprobe, browsers,
`datasets`' Video feature): H.264 High profile in yuv420p at constant quality `crf` (18: visually
lossless; 0 is not lossless here since yuv420p halves the chroma resolution), one frame per input frame
at a constant `fps`, no timestamps of the wall clock, no macroblock-tree rate control (`X264_PARAMS`)
and at least two encoder threads (`x264_threads`), so the same frames give the same bytes on any host.
Width and height must be even (yuv420p). Measured on smooth colour frames: 37.6 dB PSNR, max |Δ| 19 of 255.

`decode_mp4(data)` gives the frames (RGB PIL images) and fps back; `probe_mp4(data)` only the
geometry, from the container's index, without decoding. Bytes that are not an MP4, a file cut short
(its top-level boxes do not fill it exactly) and data the decoder rejects raise `MediaDecodeError`:
the stages turn it into one line naming the shard and row (`stages.errors.CorruptRowError`).

PyAV is the optional extra ``omnirl[video]``; it is imported on first use.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from stages.errors import UserInputError

CODEC = "libx264"
PIXEL_FORMAT = "yuv420p"
DEFAULT_CRF = 18
# x264's macroblock-tree rate control made the same frames give different bytes now and then (measured:
# 2-3 distinct files in 20-60 encodes of one tiny clip in one process); without it 310 encodes of four
# clips gave one file each, so a rollout server's MP4s equal the in-process ones byte for byte. The cost
# is size: a 16-frame 64² moving gradient took 4.9 KB at 43.3 dB PSNR, 2.5 KB at 42.6 dB with it
X264_PARAMS = "mbtree=0"
# x264's own default is 1.5 threads per CPU, so one thread on a one-CPU host, and one thread gave other
# bytes than any 2 to 32 threads (measured on 9-128 px clips of 3-33 frames), which gave one file each
# fps as an exact fraction: 16, 24, 30000/1001 (NTSC 29.97) ... are all within this denominator
FPS_DENOMINATOR = 1001


class MediaDecodeError(ValueError):
    """Encoded media bytes that cannot be decoded (not an MP4, corrupt, or truncated)."""


@dataclass(frozen=True)
class VideoInfo:
    """What an MP4's index says: frame count, frames per second, width and height in pixels."""

    frames: int
    fps: float
    width: int
    height: int


@dataclass(frozen=True)
class Video:
    """Decoded frames (RGB PIL images, in order) and their frames per second."""

    frames: list[Any]
    fps: float


def pyav(purpose: str = "video outputs", extra: str = "video") -> Any:
    """The `av` module (PyAV, FFmpeg bindings, imported on first use); missing, a one-line error
    saying what needs it and which extra installs it."""
    try:
        import av
    except ImportError:
        raise UserInputError(
            f"{purpose} need PyAV (FFmpeg bindings): pip install 'omnirl[{extra}]'"
        ) from None
    return av


def fps_fraction(fps: float) -> Fraction:
    """`fps` as the exact frame rate written to the file (a fraction with denominator ≤ 1001)."""
    if not fps > 0:
        raise UserInputError(f"--fps {fps}: the frame rate must be positive")
    return Fraction(fps).limit_denominator(FPS_DENOMINATOR)


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def x264_threads() -> int:
    """x264's default thread count (1.5 per CPU this process may use) but at least 2, so that a one-CPU
    host writes the same bytes as any other (see the note at `X264_PARAMS`)."""
    return max(2, usable_cpus() * 3 // 2)


def encode_mp4(frames: Sequence[Any], fps: float, *, crf: int = DEFAULT_CRF) -> bytes:
    """MP4 bytes of `frames` (PIL images of one even width × height, any mode: converted to RGB) played
    at `fps` frames per second."""
    av = pyav()
    if not frames:
        raise ValueError("a video needs at least one frame")
    width, height = frames[0].size
    if width % 2 or height % 2:
        raise ValueError(f"H.264 yuv420p needs an even width and height, got {width}×{height}")
    rate = fps_fraction(fps)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream(CODEC, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, PIXEL_FORMAT
        stream.options = {"crf": str(crf), "x264-params": X264_PARAMS, "threads": str(x264_threads())}
        for i, image in enumerate(frames):
            if image.size != (width, height):
                raise ValueError(f"frame {i} is {image.size[0]}×{image.size[1]}, frame 0 is {width}×{height}")
            frame = av.VideoFrame.from_image(image.convert("RGB"))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def encode_mp4s(clips: Sequence[Sequence[Any]], fps: float, *, crf: int = DEFAULT_CRF) -> list[bytes]:
    """`encode_mp4` of each clip (a batch's videos), in order. The clips are encoded concurrently, one
    encoder per clip on up to two threads per CPU (x264 waits between the frames of a short clip; 4 clips
    of 9 frames at 128² took 0.10 s this way on 2 CPUs, 0.12 s on one thread per CPU, 0.18 s one by one):
    FFmpeg encodes without Python's lock, and each clip's encoder is independent of the others, so the
    bytes are those of encoding the clips one by one."""
    if len(clips) < 2:
        return [encode_mp4(frames, fps, crf=crf) for frames in clips]
    with ThreadPoolExecutor(max_workers=min(len(clips), 2 * usable_cpus())) as pool:
        return list(pool.map(lambda frames: encode_mp4(frames, fps, crf=crf), clips))


def _check_boxes(data: bytes) -> None:
    """The top-level boxes of an MP4 (ISO BMFF: 32-bit big-endian size and 4-letter type, size 1: a
    64-bit size follows, 0: to the end) must tile the bytes exactly, so a file cut short anywhere is
    caught, also in the index at its end that a decoder may read past."""
    offset = 0
    while offset < len(data):
        if len(data) - offset < 8:
            raise MediaDecodeError(f"truncated: {len(data) - offset} stray bytes at the end")
        size = int.from_bytes(data[offset : offset + 4], "big")
        if size == 1 and len(data) - offset >= 16:
            size = int.from_bytes(data[offset + 8 : offset + 16], "big")
        elif size == 0:
            size = len(data) - offset
        if size < 8:
            raise MediaDecodeError(f"not an MP4 file (a box at byte {offset} has size {size})")
        if offset + size > len(data):
            box = data[offset + 4 : offset + 8].decode("latin-1")
            raise MediaDecodeError(
                f"truncated: its '{box}' box needs {offset + size} bytes, the file has {len(data)}"
            )
        offset += size


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or " ".join(str(exc).split())


def _open(av: Any, data: bytes) -> Any:
    data = bytes(data)
    if data[4:8] != b"ftyp":
        raise MediaDecodeError("not an MP4 file (no 'ftyp' box at its start)")
    _check_boxes(data)
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except av.FFmpegError as exc:
        raise MediaDecodeError(f"not a readable MP4 file ({_reason(exc)})") from None
    if not container.streams.video:
        container.close()
        raise MediaDecodeError("the file has no video stream")
    return container


def _rate(stream: Any) -> float:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    return float(rate) if rate else 0.0


def decode_video(data: bytes) -> Video:
    """The frames (RGB PIL images) and frame rate of a video file in any container FFmpeg reads (a
    prompt's video: MP4, WebM, MKV, ...); `MediaDecodeError` when it is unreadable, has no video
    stream, no frames or no frame rate."""
    av = pyav("video files", "video")
    try:
        with av.open(io.BytesIO(bytes(data)), mode="r") as container:
            if not container.streams.video:
                raise MediaDecodeError("the file has no video stream")
            stream = container.streams.video[0]
            frames = [frame.to_image() for frame in container.decode(stream)]
            rate = _rate(stream)
    except av.FFmpegError as exc:
        raise MediaDecodeError(f"not a readable video file ({_reason(exc)})") from None
    if not frames or rate <= 0:
        raise MediaDecodeError("the file has no frames or no frame rate")
    return Video(frames, rate)


def probe_mp4(data: bytes) -> VideoInfo:
    """Frame count, fps and size of an MP4 from its index (nothing is decoded)."""
    av = pyav()
    with _open(av, data) as container:
        stream = container.streams.video[0]
        return VideoInfo(
            int(stream.frames), _rate(stream), stream.codec_context.width, stream.codec_context.height
        )


def decode_mp4(data: bytes) -> Video:
    """The frames (RGB PIL images) and fps of MP4 bytes; `MediaDecodeError` when the bytes are not a
    readable MP4 or hold fewer frames than the index lists (a truncated file)."""
    av = pyav()
    with _open(av, data) as container:
        stream = container.streams.video[0]
        listed = int(stream.frames)
        try:
            frames = [frame.to_image() for frame in container.decode(stream)]
        except av.FFmpegError as exc:
            raise MediaDecodeError(f"corrupt video data ({_reason(exc)})") from None
        if not frames or (listed and len(frames) < listed):
            raise MediaDecodeError(
                f"truncated: {len(frames)} of the {listed} frames it lists could be decoded"
            )
        return Video(frames, _rate(stream))
