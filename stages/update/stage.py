"""The `update` stage: train the policy on stored rollouts and write an inference-ready adapter.

The output directory holds the adapter (diffusers `load_lora_weights` format, or a full
transformer), `omnirl_adapter.json` with the step counter and lineage, the trainer
state the next update resumes from, and `metrics.jsonl`. It appears under its final name atomically.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from stages.advantage.gardo import GATE_COLUMN
from stages.dist import world_and_rank
from stages.errors import UserInputError
from stages.finite import check_finite
from stages.models.diffusion import FlowPolicy
from stages.models.factory import DEFAULT_RESOLUTION
from stages.models.folders import ADAPTER_CONFIG, read_adapter_config
from stages.models.vlm import VLMPolicy
from stages.models.vlm_families import is_vlm_model, understands
from stages.reporting import step_means
from stages.sample.rollout import SampleConfig, sample_config_of
from stages.sample.vlm_stage import VLMSampleConfig, vlm_sample_config_of
from stages.score.scoring import FAILED_COLUMN, failed_rewards
from stages.shards.atomic import recover_dir
from stages.shards.manifest import config_hash, manifest_sha256
from stages.shards.writer import check_output_path
from stages.update.config import UpdateConfig
from stages.update.losses import get_algorithm
from stages.update.rows import held_columns, split_columns
from stages.update.trainer import Trainer

BASE_COLUMNS = (
    "sample_id",
    "group_id",
    "prompt",
    "negative_prompt",
    "advantages",
    "reward",
    "train_mask",
    FAILED_COLUMN,
    GATE_COLUMN,
)
# offline data (pairs, encoded images) has no rollout: the schedule of 1000 steps at the default size
OFFLINE = SampleConfig(steps=1000, guidance=1.0, batch_size=8, resolution=DEFAULT_RESOLUTION)


def check_policy_out(out: Path, inputs: list[Path]) -> None:
    """Refuse an --out that `update` could not replace without losing someone's data.

    `out` may be new, an empty directory or an adapter directory; never an input (--in or
    --adapter), a folder holding one, the working directory (it is replaced by a swap), a file, or a
    directory of other files.
    """
    check_output_path(out, inputs)
    here = Path.cwd().resolve()
    if out.resolve() in (here, *here.parents):
        raise UserInputError(
            f"--out {out} is the current directory or holds it; pick a new folder for the adapter"
        )
    if out.is_dir() and not (out / ADAPTER_CONFIG).is_file() and any(out.iterdir()):
        raise UserInputError(
            f"--out {out} is a non-empty directory without an adapter ({ADAPTER_CONFIG}); update only "
            "replaces adapters it wrote, pick a new --out"
        )


def adapter_complete(out: Path, digest: str, overwrite: bool) -> bool:
    """True when `out` already holds this very update (same config hash): the run is skipped."""
    if not (out / ADAPTER_CONFIG).is_file():
        return False
    if read_adapter_config(out, "--out").get("config_hash") == digest:
        return True
    if not overwrite:
        raise UserInputError(
            f"--out {out}: holds an adapter from a different update; pass --overwrite or pick another --out"
        )
    return False


def run_update(
    model: str | Path,
    adapter: str | Path | None,
    inputs: Any,
    out: Path,
    cfg: UpdateConfig,
    *,
    dtype: str = "fp32",
    device: torch.device | str = "cpu",
    run_config: dict[str, Any],
    overwrite: bool = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train on the zipped inputs (samples ⋈ logprobs ⋈ advantages) and write the adapter to `out`.

    Rows whose reward failed (`failed_rewards`) are skipped (`rows.trained_rows`); the result and the
    adapter's omnirl_adapter.json count them as reward_failed."""
    out = Path(out)
    check_policy_out(out, [*inputs.paths, *([Path(adapter)] if adapter else [])])
    if world_and_rank()[1] == 0:
        recover_dir(out)
    digest = config_hash({**run_config, "input_manifests": [manifest_sha256(p) for p in inputs.paths]})
    if adapter_complete(out, digest, overwrite):
        return {
            "out": str(out),
            "skipped": True,
            **{k: v for k, v in read_adapter_config(out).items() if k in ("step", FAILED_COLUMN)},
        }
    algo = get_algorithm(cfg.algo)
    if "advantages" not in inputs.columns and not (
        algo.family == "preference" and "reward" in inputs.columns
    ):
        raise UserInputError("--in: no 'advantages' column; add the output of `omnirl advantage` as an --in")
    sampled = any((m.extra or {}).get("sample_config") for m in inputs.manifests)
    # Offline data (pairs, encoded images) has no rollout: train unguided on the 1000-step grid.
    sample_cfg: SampleConfig | VLMSampleConfig = OFFLINE
    if algo.family != "token" and (sampled or algo.family == "policy_gradient"):
        sample_cfg = sample_config_of(inputs.manifests)

    policy: FlowPolicy | VLMPolicy
    if algo.family == "token":
        if not understands(model):
            raise UserInputError(
                f"--algo {algo.name} trains vision-language models; --model {model} is not one"
            )
        sample_cfg = vlm_sample_config_of(inputs.manifests)
        policy = VLMPolicy.load(model, adapter=adapter, device=device, dtype=dtype)
        if not policy.lora and not cfg.full:
            policy.add_lora(rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed)
    else:
        if is_vlm_model(model):
            raise UserInputError(
                f"--algo {algo.name} trains diffusion models; for a VLM use grpo, dapo or gspo"
            )
        # no VAE (no algorithm decodes), and no text encoder when the rollout stores its conditioning
        policy = FlowPolicy.for_rollout(
            model, inputs, sample_cfg.max_sequence_length, adapter=adapter, device=device, dtype=dtype
        )
        if policy.untrained_loras():
            trained = policy.family.trained_module
            raise UserInputError(
                f"--adapter {adapter}: its LoRA also changes {', '.join(policy.untrained_loras())}, which "
                f"update neither trains nor saves; pass a LoRA of the {trained} alone (sample and logprob "
                "take this one)"
            )
        if not policy.lora and not cfg.full:
            policy.add_lora(rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed)
        if sample_cfg is OFFLINE:  # the family's own unguided setting, at the encoded resolution
            encoded = [m.config.get("resolution") for m in inputs.manifests if m.command == "encode"]
            sample_cfg = replace(
                OFFLINE,
                guidance=policy.family.default_guidance,
                resolution=encoded[0] if encoded and encoded[0] else OFFLINE.resolution,
            )
    trainer = Trainer.resume(policy, cfg, adapter)
    light, heavy = split_columns(
        inputs, [c for c in dict.fromkeys((*BASE_COLUMNS, *algo.columns)) if c in inputs.columns]
    )
    data: dict[str, Any] = inputs.read_all(columns=light)
    held, read_held = held_columns(inputs, heavy)
    data.update(held)
    corrupt = "the input shard sets are corrupt; re-run the stage that wrote that column into a new --out"
    failed = failed_rewards(data, len(data["sample_id"]))  # never trained on (`rows.trained_rows`)
    scored = (~failed).nonzero().flatten().tolist()
    check_finite(
        {k: v[scored] for k, v in data.items() if isinstance(v, torch.Tensor)},
        [data["sample_id"][i] for i in scored],
        where="--in",
        hint=corrupt,
    )

    def load_rows(rows: list[int]) -> None:
        batch = read_held(rows)
        check_finite(batch, batch.get("sample_id"), where="--in", hint=corrupt)

    metrics = trainer.step(data, sample_cfg, on_step=on_step, load_rows=load_rows)
    rows_read = max((c.held for c in held.values()), default=len(data["sample_id"]))
    last = metrics[-1] if metrics else {}
    result = {
        "out": str(out),
        "skipped": False,
        "step": trainer.global_step,
        "optimizer_steps": len(metrics),
        "rows_read": rows_read,
        FAILED_COLUMN: int(failed.sum()),
        "last": last,
        "step_means": step_means(metrics),
    }
    if isinstance(policy, FlowPolicy):
        result.update(loaded_components=policy.loaded_components, conditioning=policy.conditioning_source)
    trainer.save(  # rank 0 writes the one adapter; every rank returns once it is in place
        out,
        metrics,
        extra={
            "config_hash": digest,
            FAILED_COLUMN: result[FAILED_COLUMN],
            "parent_adapter": str(adapter) if adapter else None,
            "inputs": [str(p) for p in inputs.paths],
        },
    )
    return result
