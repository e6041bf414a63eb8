"""omnirl's vLLM-Omni custom pipeline: rollouts with replayable trajectories inside vLLM-Omni's workers.

Imported only by vLLM-Omni (the ``vllm-omni`` extra, GPU/NPU only), never by omnirl's CPU code or tests:
``Omni(model=M, diffusion_load_format="custom_pipeline", custom_pipeline_args={"pipeline_class":
"stages.sample.vllm_omni_pipeline:OmnirlRolloutPipeline", "adapter": A | None, "dtype": "bf16"})``, or
``vllm serve M --omni --diffusion-load-format custom_pipeline --custom-pipeline-args '{...}'``.

The pipeline loads M (and the adapter A) as omnirl's `FlowPolicy` on the worker's device and answers
each request whose ``sampling_params.extra_args["omnirl"]`` holds a rollout protocol v1 request (one
batch) with `rollout_batch`: the family adapter and `samplers.step`, the code ``omnirl logprob``
replays. The trajectory fills vLLM-Omni's own fields (``trajectory_latents``, ``trajectory_log_probs``,
``trajectory_timesteps``); the σ window, final latent and weight version travel in ``custom_output``
(`vllm_omni_engine.pipeline_fields`). The client side converts the outputs back to protocol v1
(`vllm_omni_engine.outputs_to_reply`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from vllm_omni.diffusion.data import DiffusionOutput

from stages.models.diffusion import FlowPolicy
from stages.models.folders import read_adapter_config
from stages.sample.vllm_omni_engine import EXTRA_KEY, pipeline_fields


def _worker_device() -> torch.device:
    """The device vLLM-Omni gave this worker (its local rank's accelerator)."""
    from vllm_omni.diffusion.distributed.utils import get_local_device

    return torch.device(get_local_device())


class OmnirlRolloutPipeline(torch.nn.Module):
    """A vLLM-Omni diffusion pipeline that samples with omnirl's `FlowPolicy` (module docstring)."""

    def __init__(self, *, od_config: Any, prefix: str = ""):
        super().__init__()
        args = dict(getattr(od_config, "custom_pipeline_args", None) or {})
        adapter = args.get("adapter")
        self.policy = FlowPolicy.load(
            od_config.model, adapter=adapter, device=_worker_device(), dtype=args.get("dtype", "fp32")
        )
        self.weight_version = int(read_adapter_config(adapter).get("step", 0)) if adapter else 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Nothing to load from vLLM-Omni's loader: `__init__` loaded the pipeline folder itself."""
        return set()

    @torch.no_grad()
    def forward(self, req: Any) -> DiffusionOutput:
        """One request: the omnirl batch in ``req.sampling_params.extra_args[EXTRA_KEY]``."""
        extra = getattr(req.sampling_params, "extra_args", None) or {}
        body = extra.get(EXTRA_KEY)
        if not isinstance(body, dict):
            return DiffusionOutput(error=f"no extra_args[{EXTRA_KEY!r}]: send omnirl rollout protocol v1")
        return DiffusionOutput(**pipeline_fields(self.policy, body, self.weight_version))
