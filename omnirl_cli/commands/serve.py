"""`omnirl serve`: a diffusion rollout server for `omnirl sample --engine remote` and vLLM-Omni clients."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stages.knobs import MAX_CONNECTIONS, REQUEST_TIMEOUT_S, SERVER, WEIGHTS_METAVAR, WORKERS

from ..choices import Dtype
from ..config import resolve
from ..errors import handle_errors
from ..options import (
    ADAPTER_HELP,
    ConfigOpt,
    HostOpt,
    JsonOpt,
    MaxConnectionsOpt,
    RequestTimeoutOpt,
    SetOpt,
    TokenEnvOpt,
    WorkersOpt,
    max_batch_opt,
    max_request_mb_opt,
    model_opt,
    no_model_parallel_opt,
    port_opt,
)
from ..runtime import device, serve_until_stopped, server_token

# Why omnirl serve runs no sequence or tensor parallelism, and what does.
NO_MODEL_PARALLEL = (
    "answers each request in one process, and the ranks of a group would all have to run every batch together"
)
IN_PROCESS = "omnirl sample (its in-process engine)"


@handle_errors
def serve(
    ctx: typer.Context,
    model: model_opt("Diffusers pipeline to serve") = None,
    adapter: Annotated[
        str | None,
        typer.Option(
            "--adapter",
            metavar=WEIGHTS_METAVAR,
            help=f"Adapter to start with: {ADAPTER_HELP}. POST /omnirl/v1/weights loads another one later.",
        ),
    ] = None,
    dtype: Annotated[Dtype, typer.Option("--dtype", envvar="OMNIRL_DTYPE", help="Weights dtype.")] = "fp32",
    served_model_name: Annotated[
        str | None,
        typer.Option("--served-model-name", help="The model id of /v1/models (default: the folder name)."),
    ] = None,
    host: HostOpt = "127.0.0.1",
    port: port_opt(18091) = 18091,
    token_env: TokenEnvOpt = None,
    max_request_mb: max_request_mb_opt(16) = 16,
    max_batch: max_batch_opt(64) = 64,
    max_weights_mb: Annotated[
        int,
        typer.Option(
            "--max-weights-mb",
            min=1,
            help="Largest LoRA file a client may push to POST /omnirl/v1/weights, in MiB (413 above).",
            rich_help_panel=SERVER,
        ),
    ] = 1024,
    max_named_weights: Annotated[
        int,
        typer.Option(
            "--max-named-weights",
            min=1,
            help="Named weights (trainers sharing the server, each up to 2 LoRA versions) held at once; a "
            "push of one more name is 409 until DELETE /omnirl/v1/weights?name=NAME forgets one, or one's "
            "lease runs out (--named-weights-ttl).",
            rich_help_panel=SERVER,
        ),
    ] = 16,
    named_weights_ttl: Annotated[
        int,
        typer.Option(
            "--named-weights-ttl",
            min=1,
            help="Seconds named weights are held without a push, a rollout naming them or a POST "
            "/omnirl/v1/weights/lease (the heartbeat of `omnirl online --engine remote`); then they are "
            "forgotten, so a killed trainer's name frees its place.",
            rich_help_panel=SERVER,
        ),
    ] = 600,
    max_request_cost: Annotated[
        int,
        typer.Option(
            "--max-request-cost",
            min=1,
            help="Most work one request may ask for, in megapixel-steps: samples × frames × height × width "
            "× denoising steps / 10^6 (413 above, naming both; e.g. 8 samples of 1024x1024 at 40 steps: 335).",
            rich_help_panel=SERVER,
        ),
    ] = 10_000,
    weights_root: Annotated[
        Path | None,
        typer.Option(
            "--weights-root",
            help="Folder under which POST /omnirl/v1/weights may load adapter folders by path (symlinks "
            "resolved first; any other path is 403, alike whether it exists). Without it only a server "
            "with --token-env loads folders by path, any folder; pushed LoRA files need neither.",
            rich_help_panel=SERVER,
        ),
    ] = None,
    max_connections: MaxConnectionsOpt = MAX_CONNECTIONS,
    workers: WorkersOpt = WORKERS,
    request_timeout: RequestTimeoutOpt = REQUEST_TIMEOUT_S,
    sp_degree: no_model_parallel_opt("--sp-degree", "serve", IN_PROCESS) = 1,
    tp_degree: no_model_parallel_opt("--tp-degree", "serve", IN_PROCESS) = 1,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
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
    (--workers, --max-connections: 503 past it, --request-timeout: 408): docs/serving.md.

    Example: [bold]omnirl serve --model models/sd3-tiny --port 18091[/], then
    [bold]omnirl sample --engine remote --server-url http://127.0.0.1:18091 --model models/sd3-tiny
    --prompts prompts.txt --out run/it0/samples[/]
    """
    c = resolve(ctx, "serve", required=("model",))
    from stages.parallelism import ModelParallel

    ModelParallel.from_options(c).refuse("omnirl serve", NO_MODEL_PARALLEL, IN_PROCESS)
    from stages.sample.rollout_server import RolloutService
    from stages.web import JsonServer

    token = server_token(c)
    service = RolloutService(
        c["model"],
        c["adapter"],
        device=device(),
        dtype=c["dtype"],
        served_name=c["served_model_name"],
        token=token,
        max_request_bytes=c["max_request_mb"] * 2**20,
        max_batch=c["max_batch"],
        max_weights_bytes=c["max_weights_mb"] * 2**20,
        max_named=c["max_named_weights"],
        max_cost=c["max_request_cost"],
        weights_root=c["weights_root"],
        named_ttl=c["named_weights_ttl"],
    )
    serve_until_stopped(
        lambda host, port, limits: JsonServer(service, host, port, limits=limits),
        c,
        token=token,
        json_=json_,
        ready=lambda server: {"url": server.url, "model": service.served_name, "weights": service.weights},
        banner=f"{service.served_name} ({service.engine.family}, weights version {service.weights['version']})",
    )
