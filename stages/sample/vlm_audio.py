"""Audio clips of omni prompts: a row's `audios` entries to encoded files, and files to waveforms.

A row may give each clip as a file path (relative paths from the table's folder), the file's bytes, a
`datasets` Audio struct (`{bytes, path}`, or decoded `{array, sampling_rate}`) or an `(array,
sampling_rate)` pair. Every form becomes the bytes of an audio file, stored once per prompt in the
rollout; arrays become float32 WAV files, so no sample changes. Sampling and every replay decode those
same bytes with PyAV (FFmpeg: WAV, FLAC, MP3, OGG, M4A, ...) to mono float32 at the model's sampling
rate, so the rollout and the replay see identical waveforms.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from stages.errors import UserInputError
from stages.media.video import pyav

_HINT = "fix the data (a WAV/FLAC/MP3/OGG file, its path, or an (array, sampling_rate) pair)"


def wav_bytes(samples: Any, rate: int) -> bytes:
    """A float32 WAV file of a waveform [S] (or [channels, S], averaged to mono) at `rate` Hz."""
    av = pyav("audio prompts", "audio")
    wave = np.asarray(samples, dtype=np.float32)
    wave = wave.mean(0) if wave.ndim == 2 else wave
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as container:
        stream = container.add_stream("pcm_f32le", rate=int(rate), layout="mono")
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[None, :]), format="flt", layout="mono")
        frame.sample_rate = int(rate)
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buf.getvalue()


def audio_bytes(value: Any, base: Path | None, where: str) -> bytes:
    """The encoded file of one `audios` entry (forms in the module docstring), checked to decode."""
    if isinstance(value, dict) and value.get("array") is not None:
        value = (value["array"], value.get("sampling_rate"))
    elif isinstance(value, dict):
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(value, (tuple, list)) and len(value) == 2 and not isinstance(value[0], (int, float)):
        samples, rate = value
        if not isinstance(rate, (int, np.integer)) or rate <= 0:
            raise UserInputError(f"{where}: an audio array needs a positive integer sampling_rate; {_HINT}")
        blob = wav_bytes(samples, int(rate))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        blob = bytes(value)
    elif isinstance(value, str):
        path = Path(value) if base is None or Path(value).is_absolute() else Path(base) / value
        if not path.is_file():
            raise UserInputError(f"{where}: audio file {value!r} not found; {_HINT}")
        blob = path.read_bytes()
    else:
        raise UserInputError(f"{where}: an audios entry is {type(value).__name__}; {_HINT}")
    decode_audio(blob, None, where)
    return blob


def decode_audio(blob: bytes, rate: int | None, where: str) -> np.ndarray:
    """An audio file's first audio stream as mono float32 samples [S] at `rate` Hz (None: its own rate).

    A file that does not decode, or holds no audio, is a one-line error naming `where`.
    """
    av = pyav("audio prompts", "audio")
    try:
        with av.open(io.BytesIO(bytes(blob)), "r") as container:
            if not container.streams.audio:
                raise ValueError("no audio stream")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate or stream.rate)
            chunks = [
                out.to_ndarray().reshape(-1)
                for frame in container.decode(stream)
                for out in resampler.resample(frame)
            ]
            chunks += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    except (av.FFmpegError, ValueError, OSError) as error:
        raise UserInputError(f"{where}: an audio clip does not decode ({error}); {_HINT}") from None
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if not len(samples):
        raise UserInputError(f"{where}: an audio clip holds no samples; {_HINT}")
    return samples.astype(np.float32, copy=False)
