"""Rollouts: denoise a batch with the chosen sampler and record the stochastic (trainable) steps.

One row per generated sample, in the trajectory schema of DESIGN.md: only the stored window's
latents [K+1, C, h, w], log-probs [K], timesteps [K] and σ [K+1], plus the final latent and its decoded
media (`stages.media.media_columns`: a PNG, or for a video family an MP4 at `fps`).

Latents are stored in `SampleConfig.latent_dtype` (`LATENT_DTYPES`; bf16 halves the largest columns).
`SampleConfig` (`stages.sample.config`) holds the settings, and is what a rollout records.
The rollout itself carries x in that dtype between steps, so every log-prob it records is the one of
the latents as stored, and `omnirl logprob` replays them exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from stages.errors import UserInputError
from stages.finite import MODEL_HINT, check_finite
from stages.media import media_columns
from stages.models.diffusion import FlowPolicy, seed_generator
from stages.precision import autocast
from stages.sample.config import LATENT_DTYPE_NAMES, SampleConfig
from stages.sample.samplers import step

# --latent-dtype: the dtype of the stored latents, and of x between the rollout's steps
LATENT_DTYPES = dict(zip(LATENT_DTYPE_NAMES, (torch.float32, torch.bfloat16), strict=True))


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any parts (stable across runs, platforms and batchings)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def stored_steps(cfg: SampleConfig, group: Hashable) -> list[int]:
    """Indices of the stochastic, stored steps of one prompt group's samples.

    No window: every step (original Flow-GRPO). A window of W: W consecutive steps placed by the
    window strategy: `random` draws the start uniformly in [lo, hi − W] from (--seed, --iteration,
    group), so each group gets its own window (Flow-GRPO-Fast draws one per pipeline call) and no
    batching or sharding moves it; `progressive` slides it with the iteration number (MixGRPO), so a
    resumed run that passes the same --iteration continues where it was; `fixed` keeps it at
    --window-start.
    """
    if cfg.sampler == "ode":
        return []
    if cfg.window == 0:
        return list(range(cfg.steps))
    seed = derive_seed(cfg.seed, "window", group) if cfg.window_strategy == "random" else 0
    return cfg.schedule().steps_for_iteration(cfg.iteration, seed=seed)


@torch.no_grad()
def rollout_batch(
    policy: FlowPolicy,
    cfg: SampleConfig,
    prompts: list[str],
    negatives: list[str],
    seeds: list[int],
    init_seeds: list[int],
    *,
    groups: Sequence[Hashable],
    sample_ids: Sequence[str],
    decode: bool = True,
    on_step: Callable[[int], None] | None = None,
    images: list[list[bytes]] | None = None,
) -> dict[str, Any]:
    """Denoise one batch of B samples; returns the recorded columns (tensors with leading dim B).

    `seeds` drive each sample's SDE noise, `init_seeds` its x_T (shared within a group with
    --same-noise), `groups` (each sample's prompt group) place its SDE window (`stored_steps`), so
    samples of different groups in one batch may store different steps. Noise is drawn per sample on
    the CPU, only at the sample's own stochastic steps, so batching never changes a sample. A NaN or
    ±inf the model produces stops the batch before decoding, naming the sample (`sample_ids`). The
    model forwards (text encoders, transformer, VAE decode) run under `cfg.mixed_precision`'s autocast.

    x lives in `cfg.latent_dtype` between steps (each step's math is fp32, `samplers.step` rounds its
    x' to the dtype of x), so a stored step's log-prob is that of its stored, rounded x'. The latents
    and final latent come back in that dtype, log-probs, timesteps and σ in fp32.

    Without `decode` (`sample --defer-decode`) the VAE is never run: no media column, only the final
    latent, which `stages.media.deferred.LatentDecoder` decodes later to the same pixels.

    `on_step(i)` is called before each denoising step i (0-based); what it raises stops the batch there
    (`omnirl serve` stops a batch whose client went away). `images`: each sample's condition images
    (encoded files), for an editing model (`FlowPolicy.encode`).
    """
    with autocast(cfg.mixed_precision, policy.device):  # every model forward, as `logprob` replays
        batch = len(prompts)
        sigmas = policy.sigmas(cfg.steps, cfg.resolution).to(policy.device)
        placed = {g: stored_steps(cfg, g) for g in dict.fromkeys(groups)}
        windows = [placed[g] for g in groups]
        if len({len(w) for w in windows}) > 1:
            raise ValueError("every sample of a batch must store the same number of steps")
        x = policy.initial_noise(init_seeds, cfg.resolution, cfg.frames).to(LATENT_DTYPES[cfg.latent_dtype])
        cond = policy.encode(
            prompts, negatives, policy.needs_negative(cfg.guidance), cfg.max_sequence_length, images
        )
        gens = [seed_generator(s) for s in seeds]
        latents: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        log_probs: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        for i in range(cfg.steps):
            if on_step is not None:
                on_step(i)
            v = policy.velocity(x.float(), sigmas[i], cond, cfg.guidance, cfg.guidance_2)
            rows = [b for b in range(batch) if i in windows[b]]
            if len(rows) < batch:  # a deterministic step for the samples outside their window
                x_next = step("ode", v, x, sigmas[i], sigmas[i + 1], noise_level=0.0).prev_sample
            if rows:
                noise = torch.stack(
                    [
                        torch.randn(x.shape[1:], generator=g) if b in rows else torch.zeros(x.shape[1:])
                        for b, g in enumerate(gens)
                    ]
                ).to(x.device)
                sde = step(
                    cfg.sampler,
                    v,
                    x,
                    sigmas[i],
                    sigmas[i + 1],
                    noise_level=cfg.noise_level,
                    sigma_max_safe=sigmas[1],
                    noise=noise,
                )
                if len(rows) == batch:
                    x_next = sde.prev_sample
                else:
                    stochastic = torch.zeros(batch, dtype=torch.bool)
                    stochastic[rows] = True
                    stochastic = stochastic.to(x.device).view(-1, *([1] * (x.ndim - 1)))
                    x_next = torch.where(stochastic, sde.prev_sample, x_next)
                for b in rows:
                    latents[b].append(x[b])
                    log_probs[b].append(sde.log_prob[b])
                    if i == windows[b][-1]:
                        latents[b].append(x_next[b])
            x = x_next
        x = policy.finish(x, cond)  # a given first frame put back, as the pipeline returns it
        result: dict[str, Any] = {"final_latent": x.cpu()}
        if windows[0]:
            result["latents"] = torch.stack([torch.stack(ls) for ls in latents]).cpu()
            result["log_probs"] = torch.stack([torch.stack(lp) for lp in log_probs]).float().cpu()
            result["timesteps"] = torch.stack([sigmas[w] * 1000 for w in windows]).float().cpu()
            result["sigmas"] = torch.stack([sigmas[[*w, w[-1] + 1]] for w in windows]).float().cpu()
        check_finite(result, sample_ids, where="sample", hint=MODEL_HINT)
        if decode:
            result.update(media_columns(policy.decode(x.float()), cfg.fps, save_frames=cfg.save_frames))
        return result


def sample_config_of(manifests: list[Any]) -> SampleConfig:
    """The `SampleConfig` recorded by `omnirl sample` in one of the input manifests."""
    for manifest in manifests:
        recorded = (manifest.extra or {}).get("sample_config")
        if recorded:
            unknown = sorted(set(recorded) - set(SampleConfig.RECORDED))
            if unknown:
                raise UserInputError(
                    f"--in: the rollout records sampling settings this omnirl does not know ({', '.join(unknown)}); "
                    "replay it with the omnirl version that sampled it"
                )
            return SampleConfig.from_record(recorded)
    raise UserInputError(
        "--in: none of the inputs was written by `omnirl sample`; pass the samples shard set first"
    )


def text_length_of(manifests: Sequence[Any]) -> int:
    """The text length the stages after these inputs encode their prompts at: the one `omnirl sample`
    recorded in one of `manifests`, else `SampleConfig`'s default, which `update` takes for offline data
    (pairs, encoded images)."""
    if any((m.extra or {}).get("sample_config") for m in manifests):
        return sample_config_of(list(manifests)).max_sequence_length
    return SampleConfig.max_sequence_length
