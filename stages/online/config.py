"""The settings of one `omnirl online` run, and what they fix per iteration (its rows, seeds, media).

`OnlineConfig` holds the staged commands' own `sample` and `update` configs; the driver
(`pipeline`) and the workers (`workers`) read every per-iteration choice from here.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stages.advantage.config import AdvantageConfig
from stages.sample.engines import DEFAULT_ENGINE, EngineOptions
from stages.sample.prompts import Prompt
from stages.sample.rollout import SampleConfig
from stages.update.config import UpdateConfig

# the trajectory columns the sampler hands the driver (through the ring) and the trainer trains on
TENSORS = ("latents", "log_probs", "sigmas", "timesteps", "final_latent", "seed", "policy_version")


@dataclass
class OnlineConfig:
    """Everything one online run needs; `sample` and `update` are the staged commands' configs."""

    model: str
    prompts: list[Prompt]
    out: Path
    iterations: int
    sample: SampleConfig
    update: UpdateConfig
    # the settings below are knobs declared once elsewhere (online's own: `stages.online.settings`;
    # the scorer's: `ScoreConfig`; the group size: `SampleRun`), so they have no second default here
    group_size: int
    score_batch_size: int
    on_error: str
    max_staleness: int
    save_trajectories: bool
    # with save_trajectories: media columns only every N-th iteration and the last (the others keep final
    # latents, `stages.media.deferred`); every iteration is still decoded in memory and scored
    media_every: int
    dtype: str
    threads: int
    seed: int | None
    engine: str  # the sampler's rollout engine: diffusers (in-process) or one taking pushes
    num_prompts: int | None = None
    rewards: list[tuple[str, float]] = field(default_factory=list)
    reward_args: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the staged `advantage` command's settings
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    rollout: EngineOptions | None = None  # how to reach a remote engine (server URL, token, timeouts)
    # this driver's own name for the weights it pushes to a shared server: random, so two runs never
    # share one (the same --out on two machines did); a resumed run pushes again before sampling
    weights_name: str = field(default_factory=lambda: "online-" + secrets.token_hex(8))

    def engine_options(self) -> EngineOptions:
        """The sampler engine's options: this run's model, and weights the driver pushes under a name of
        this driver's own (`weights_name`), so other runs sharing the server keep theirs."""
        base = self.rollout or EngineOptions(model=Path(self.model))
        return replace(
            base,
            model=Path(self.model),
            adapter=None,
            dtype=self.dtype,
            pushed_weights=True,
            weights_name=self.weights_name,
        )

    @property
    def in_process(self) -> bool:
        """Whether the sampler runs the pipeline itself (weights through shared memory, not pushed)."""
        return self.engine == DEFAULT_ENGINE

    def sampling(self, k: int) -> SampleConfig:
        """Iteration k's sampling settings: seed k (or the fixed --seed) and window position k."""
        return replace(self.sample, seed=k if self.seed is None else self.seed, iteration=k)


def iteration_rows(cfg: OnlineConfig, k: int) -> list[Any]:
    """The rows iteration k samples: the staged `sample --seed k --iteration k` plan (seed: --seed if fixed)."""
    from stages.sample.prompts import pick_prompts
    from stages.sample.stage import plan_rows

    scfg = cfg.sampling(k)
    return plan_rows(pick_prompts(cfg.prompts, cfg.num_prompts, scfg.seed), cfg.group_size, scfg)


def stores_media(cfg: OnlineConfig, k: int) -> bool:
    """Whether iteration k's saved samples hold their media: every `media_every`-th iteration (0, N,
    2N, ...) and the run's last."""
    return k % cfg.media_every == 0 or k == cfg.iterations - 1
