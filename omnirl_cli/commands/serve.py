"""`omnirl serve`: a diffusion rollout server for `omnirl sample --engine remote` and vLLM-Omni clients."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from stages.sample.serve_config import ServeConfig

from ..generate import config_command
from ..runtime import device, serve_until_stopped, server_token

if TYPE_CHECKING:
    from stages.sample.lockstep import Pipelines


def run(c: ServeConfig, json_: bool) -> None:
    """Serve diffusion rollouts over HTTP until SIGTERM or Ctrl-C, on this process's device.

    Routes: POST /omnirl/v1/rollout (omnirl rollout protocol v1: SDE trajectories that `omnirl
    logprob` replays exactly, and when asked the prompt conditioning they were sampled with, which
    the client stores so that the stages after it load no text encoder; clients: `omnirl sample
    --engine remote --server-url URL`), POST
    /v1/images/generations (vLLM-Omni's images API, b64_json PNGs), POST /v1/videos/sync (its videos
    API for a video family: a form in, the MP4 out), GET/POST/DELETE /omnirl/v1/weights (the
    weights held; swap in another adapter folder, or a LoRA file a trainer pushes with its SHA-256 and
    version, without a restart; forget named weights), GET /health, GET /v1/models. JSON only, no pickle; a malformed or
    oversized request gets a 4xx and the server keeps serving: a field of the wrong type is a 400 naming
    it, a request costing more than --max-request-cost a 413. An adapter folder loads by path only
    under --weights-root, or on a server with --token-env (403 otherwise). A batch whose client hung up
    stops at its next denoising step. Named weights not renewed for --named-weights-ttl seconds are
    forgotten (docs/serving.md). When ready it prints its URL (with
    --json, one JSON line on stdout: url, model, weights, pid). `omnirl online --engine remote` pushes
    each new policy version to it. Threads, connections and the time to send a request are bounded
    (--workers, --max-connections: 503 past it, --request-timeout: 408): docs/serving.md. Under a launcher
    with --sp-degree N (or --tp-degree N) over exactly N ranks, rank 0 serves and every rank runs each
    batch and weight change with it on its part of the model; stopping rank 0 stops them all
    (docs/scaling.md). --attention-backend / --compile set the kernels of every pipeline it loads.

    Example: [bold]omnirl serve --model models/sd3-tiny --port 18091[/], then
    [bold]omnirl sample --engine remote --server-url http://127.0.0.1:18091 --model models/sd3-tiny
    --prompts prompts.txt --out run/it0/samples[/]
    """
    from stages.models.folders import check_pipeline_folder
    from stages.models.kernels import Kernels
    from stages.parallelism import ModelParallel
    from stages.sample.lockstep import Pipelines

    pipelines = Pipelines(
        check_pipeline_folder(c.model),
        dtype=c.dtype,
        device=device(),
        parallel=ModelParallel.from_options(asdict(c)),
        kernels=Kernels.from_options(asdict(c)),
    )
    if not pipelines.leads:
        pipelines.follow()  # until rank 0 stops
        return
    try:
        _serve(c, json_, pipelines)
    finally:
        pipelines.close()


def _serve(c: ServeConfig, json_: bool, pipelines: Pipelines) -> None:
    """Serve on this rank (the only one, or the group's rank 0) until stopped."""
    from stages.sample.rollout_server import RolloutService
    from stages.web import JsonServer

    token = server_token(c)
    service = RolloutService(
        c.model,
        c.adapter,
        device=device(),
        dtype=c.dtype,
        served_name=c.served_model_name,
        token=token,
        max_request_bytes=c.max_request_mb * 2**20,
        max_batch=c.max_batch,
        max_weights_bytes=c.max_weights_mb * 2**20,
        max_named=c.max_named_weights,
        max_cost=c.max_request_cost,
        weights_root=c.weights_root,
        named_ttl=c.named_weights_ttl,
        pipelines=pipelines,
    )
    serve_until_stopped(
        lambda host, port, limits: JsonServer(service, host, port, limits=limits),
        c,
        token=token,
        json_=json_,
        ready=lambda server: {"url": server.url, "model": service.served_name, "weights": service.weights},
        banner=f"{service.served_name} ({service.engine.family}, weights version {service.weights['version']})",
    )


serve = config_command(ServeConfig, "serve", run)
