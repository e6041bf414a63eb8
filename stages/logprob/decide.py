"""Whether `logprob` must run the model over a rollout, or can only reproduce its stored log-probs.

A diffusion rollout drawn by the in-process diffusers engine computes each step's log-prob with the
same `FlowPolicy.velocity` and `samplers.step` the replay runs, in the same batches; under the same
weights (model and adapter content digests), weights dtype, mixed precision and device type, the
replay gives those floats back bit for bit (|Δlogp| = 0), and `update` trains on the rollout's own
`log_probs` when no replay is given. Anything else can differ: a server (`remote`, `vllm-omni`, a
plugin engine) samples on its own device, threads and build; another dtype or autocast rounds
otherwise; other weights are another policy; a quantized attention backend (sage) on one side only
computes other attention; a text rollout's cached decoding matches a full forward only to float
rounding. `--reference` and `--means` ask for columns only the replay computes. Another exact
attention kernel (flash, cuDNN), `--compile` or another sequence-parallel degree changes the floats
to rounding only (~1e-7, docs/scaling.md), below anything a replay is for, so they are not reasons
(nor recorded in the run identity, whose `attention_backend` this reads).

`replay_decision` is the one place that says so; `omnirl logprob --replay auto` acts on it and the
recipes (recipes/flow_grpo.mk, recipes/Snakefile) call that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from stages.sample.engines import DEFAULT_ENGINE

NATIVE = "native"  # the attention of every backend that agrees with torch SDPA to rounding


@dataclass(frozen=True)
class Numerics:
    """What fixes the floats of a diffusion forward: the weights (content digests; adapter None for
    the base model), their dtype, the autocast mode, the device type (cpu or an accelerator's) and
    the attention backend where it changes numbers beyond rounding (a quantized one, as the run
    identity records it; "native" for every backend that agrees with native to rounding)."""

    model_sha256: str
    adapter_sha256: str | None
    dtype: str
    mixed_precision: str
    device_type: str
    attention_backend: str = NATIVE


@dataclass(frozen=True)
class ReplayDecision:
    """`needed`: a replay can give other log-probs than the rollout's (or columns it lacks); `reason`
    says why, or why not, in one line."""

    needed: bool
    reason: str


def _rollout_manifest(manifests: Sequence[Any]) -> Any | None:
    """The manifest of the `sample` run among the zipped inputs (the one recording its engine)."""
    for manifest in manifests:
        if manifest.command == "sample" and (manifest.extra or {}).get("engine"):
            return manifest
    return None


def rollout_numerics(manifest: Any) -> Numerics:
    """The `Numerics` a `sample` manifest records: its config's digests, dtype and attention backend
    (there only when quantized), the mixed precision it sampled under (`extra.sample_config`) and its
    engine's device type ("" when not recorded)."""
    extra = manifest.extra or {}
    return Numerics(
        model_sha256=str(manifest.config.get("model_sha256")),
        adapter_sha256=manifest.config.get("adapter_sha256"),
        dtype=str(manifest.config.get("dtype")),
        mixed_precision=str((extra.get("sample_config") or {}).get("mixed_precision", "no")),
        device_type=str(extra["engine"].get("device", "")),
        attention_backend=str(manifest.config.get("attention_backend") or NATIVE),
    )


def replay_decision(
    manifests: Sequence[Any], replay: Numerics, *, computes: Sequence[str] = ()
) -> ReplayDecision:
    """Whether replaying the rollout in `manifests` (the zipped `--in` sets) under `replay`'s numerics
    can give anything but its stored log-probs. `computes` names the options asking for columns only
    a replay makes (e.g. "--reference"). Every difference found is listed in the reason."""
    columns = {c.name for m in manifests for c in m.columns}
    modality = next(
        ((m.extra or {}).get("modality") for m in manifests if (m.extra or {}).get("modality")), None
    )
    if modality != "text" and "latents" not in columns:
        return ReplayDecision(False, "the rollout stores no steps (ODE sampler): nothing to replay")
    reasons = [f"{option} asks for columns only a replay computes" for option in computes]
    rollout = _rollout_manifest(manifests)
    if modality == "text":
        reasons.append("a text rollout's cached decoding matches a full forward only to float rounding")
    elif rollout is None:
        reasons.append("no input records the engine that sampled it (offline data, or an older omnirl)")
    elif (engine := rollout.extra["engine"].get("name")) != DEFAULT_ENGINE:
        reasons.append(f"sampled by the {engine} engine, on its own device, threads and build")
    else:
        recorded = rollout_numerics(rollout)
        for f in fields(Numerics):
            was, now = getattr(recorded, f.name), getattr(replay, f.name)
            if was != now:
                reasons.append(f"{f.name} {_short(was)} in the rollout, {_short(now)} here")
    if reasons:
        return ReplayDecision(True, "; ".join(reasons))
    return ReplayDecision(
        False,
        f"sampled in process by the {DEFAULT_ENGINE} engine under the same weights, dtype {replay.dtype}, "
        f"mixed precision {replay.mixed_precision}, device type {replay.device_type} and "
        f"{replay.attention_backend} attention: a replay reproduces its log-probs exactly (to rounding "
        "under another exact kernel or --compile)",
    )


def _short(value: str | None) -> str:
    """A value for a reason: a digest cut to 12 hex digits, None as "none"."""
    if value is None:
        return "none"
    return value[:12] if len(value) == 64 else value
