"""Deferred media: a rollout stored as final latents only, decoded when it is scored.

`omnirl sample --defer-decode` (and the iterations `omnirl online --media-every N` stores without media)
skip the VAE decode and write no `image` / `video` column; the manifest's `extra[DEFERRED]` records it
with what the decode needs besides the rollout's `sample_config` (the model folder whose VAE decodes and
the weights dtype). `omnirl score` then decodes the `final_latent` column with `LatentDecoder`, in the
rollout's own batches under its mixed precision, so every sample's pixels are those `sample` would have
encoded (PNG is lossless: image rewards are equal bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFERRED = "deferred_media"  # manifest extra key of a rollout whose media is decoded downstream


def deferred_record(model: str | Path, dtype: str) -> dict[str, Any]:
    """The manifest's `extra[DEFERRED]`: the pipeline folder whose VAE decodes the final latents and the
    weights dtype the rollout ran in."""
    return {DEFERRED: {"model": str(Path(model).resolve()), "dtype": dtype}}


def deferred_media(manifests: Sequence[Any]) -> dict[str, Any] | None:
    """The `extra[DEFERRED]` record of the first of `manifests` holding one (a deferred rollout among
    zipped inputs), else None."""
    for manifest in manifests:
        record = (getattr(manifest, "extra", None) or {}).get(DEFERRED)
        if record:
            return dict(record)
    return None


class LatentDecoder:
    """Final latents [N, *latent_shape] of a shard → decoded outputs (a PIL image, or a list of PIL
    frames, per sample), as `sample` decodes them: `decode` (a family adapter's) on `device` under
    `mixed_precision`'s autocast, one rollout batch (`batch_size` rows from the shard's start) at a time,
    since a batched VAE decode differs from another batching by float rounding."""

    def __init__(
        self, decode: Callable[[Any], list[Any]], *, batch_size: int, mixed_precision: str, device: Any
    ) -> None:
        self.decode = decode
        self.batch_size = batch_size
        self.mixed_precision = mixed_precision
        self.device = device

    def _decode(self, latents: Any) -> list[Any]:
        import torch

        from stages.precision import autocast

        with torch.no_grad(), autocast(self.mixed_precision, self.device):
            return self.decode(latents.to(self.device).float())

    def rows(self, latents: Any) -> Callable[[int, int], list[Any]]:
        """A function of (start, stop) giving rows [start, stop) of the shard whose final latents are
        `latents`; it decodes each rollout batch once (holding only the last), so ascending ranges of
        any size decode every row once."""
        b = self.batch_size
        held: dict[int, list[Any]] = {}

        def outputs(start: int, stop: int) -> list[Any]:
            out: list[Any] = []
            for chunk in range(start // b, -(-stop // b)):
                if chunk not in held:
                    held.clear()
                    held[chunk] = self._decode(latents[chunk * b : (chunk + 1) * b])
                lo = chunk * b
                out.extend(held[chunk][max(start, lo) - lo : stop - lo])
            return out

        return outputs
