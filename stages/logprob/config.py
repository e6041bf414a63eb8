"""`logprob`'s settings as one typed config, and the names its knobs take; torch-free.

`LogprobConfig` is the single declaration of every `omnirl logprob` option (help, choices, panel),
from which the CLI generates its options (`omnirl_cli.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages import knobs
from stages.knobs import knob

REPLAY_MODES = (
    "auto",
    "yes",
)  # `logprob --replay`: only when it can differ (`stages.logprob.decide`), or always


@dataclass
class LogprobConfig:
    """Every setting of the `logprob` stage (`omnirl logprob`)."""

    # first, so that a missing --model is named before a missing --out
    model: str | None = knobs.model("Diffusers pipeline or transformers VLM")
    inputs: list[Path] | None = knobs.inputs()
    out: Path | None = knobs.out()
    adapter: str | None = knobs.adapter("Adapter to replay under", " (default: base model).")
    dtype: str = knobs.dtype(trains=False)
    reference: bool = knob(
        False, "Also store the frozen base model's step means (ref_means; VLM: token ref_log_probs) for KL."
    )
    means: bool = knob(
        False, "Also store the step means under these weights (old_means, for --algo grpo_guard)."
    )
    mixed_precision: str | None = knobs.mixed_precision(
        "the replayed forward, as `update --mixed-precision` (give both the same, so the old log-probs "
        "carry the trainer's numerics)",
        fallback="the rollout's `sample --mixed-precision` (so the replay reproduces the rollout log-probs)",
    )
    replay: str = knob(
        "yes",
        "yes: always run the model. auto: only when the replay can give other values than the "
        "rollout's log-probs: a rollout of another engine than the in-process diffusers one (remote, "
        "vllm-omni, a plugin), other weights (model or adapter digest), another --dtype, "
        "--mixed-precision or device type, a quantized --attention-backend (sage) on one side only, a "
        "text rollout, or --reference / --means (another exact kernel or --compile agrees to "
        "rounding and is no reason); otherwise it "
        "loads no model and writes the sample ids only, as for an ODE rollout, and `update` trains "
        "on the rollout's own log-probs, the very values the replay would give. The manifest (and "
        "--json) records replayed and replay_reason either way.",
        choices=REPLAY_MODES,
    )
    fraction: float = knob(
        1.0,
        "0 < F ≤ 1: replay round(F·B) (at least one) of the rollout's B sampling batches, drawn "
        "with --seed; whole batches, so each row is replayed in the batch it was sampled in. A cheap "
        "health check of every iteration: |Δlogp| vs the rollout (mean, p99, max). Below all batches "
        "the output holds only those rows (`subset` in its manifest): a check, not the replay, so "
        "`update` and every other stage refuse it as an --in. Diffusion rollouts; not with --replay auto.",
        low=0.0,
        high=1.0,
    )
    seed: int | None = knob(None, "Seeds --fraction's draw of batches (default: the rollout's --seed).")
    sp_degree: int = knobs.sp_degree()
    sp_kind: str = knobs.sp_kind()
    tp_degree: int = knobs.tp_degree()
    attention_backend: str | None = knobs.attention_backend()
    compile: bool = knobs.compile()
    packing: str = knobs.packing()
    micro_batch_tokens: int | None = knobs.micro_batch_tokens()
    fmt: str = knobs.shard_format()
    overwrite: bool = knobs.overwrite()
