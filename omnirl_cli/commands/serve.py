"""`omnirl serve`: a diffusion rollout server for `omnirl sample --engine remote` and vLLM-Omni clients."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..config import resolve
from ..console import log
from ..errors import handle_errors
from ..options import ADAPTER_HELP, ConfigOpt, JsonOpt, SetOpt
from ..runtime import device


@handle_errors
def serve(
    ctx: typer.Context,
    model: Annotated[Path, typer.Option("--model", "-m", help="Diffusers pipeline folder to serve.")] = Path(
        "model"
    ),
    adapter: Annotated[
        Path | None,
        typer.Option(
            "--adapter",
            help=f"Adapter to start with: {ADAPTER_HELP}. POST /omnirl/v1/weights loads another one later.",
        ),
    ] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32, bf16 or fp16.")] = "fp32",
    served_model_name: Annotated[
        str | None,
        typer.Option("--served-model-name", help="The model id of /v1/models (default: the folder name)."),
    ] = None,
    host: Annotated[
        str,
        typer.Option(
            "--host", help="Address to bind: 127.0.0.1 (default) keeps it on this machine; 0.0.0.0 opens it."
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port to bind; 0 picks a free one (printed).")
    ] = 18091,
    token_env: Annotated[
        str | None,
        typer.Option(
            "--token-env",
            help="Environment variable holding a bearer token every request but GET /health must carry "
            "(clients: --server-token-env VAR).",
        ),
    ] = None,
    max_request_mb: Annotated[
        int, typer.Option("--max-request-mb", min=1, help="Largest request body, in MiB (413 above).")
    ] = 16,
    max_batch: Annotated[
        int, typer.Option("--max-batch", min=1, help="Most samples in one request (413 above).")
    ] = 64,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Serve diffusion rollouts over HTTP until SIGTERM or Ctrl-C, on this process's device.

    Routes: POST /omnirl/v1/rollout (omnirl rollout protocol v1: SDE trajectories that `omnirl
    logprob` replays exactly; clients: `omnirl sample --engine remote --server-url URL`), POST
    /v1/images/generations (vLLM-Omni's images API, b64_json PNGs), GET/POST /omnirl/v1/weights (the
    weights held; load another adapter folder without a restart), GET /health, GET /v1/models. JSON
    only, no pickle; a malformed or oversized request gets a 4xx and the server keeps serving. When
    ready it prints its URL (with --json, one JSON line on stdout: url, model, weights, pid).

    Example: [bold]omnirl serve --model models/sd3-tiny --port 18091[/], then
    [bold]omnirl sample --engine remote --server-url http://127.0.0.1:18091 --model models/sd3-tiny
    --prompts prompts.txt --out run/it0/samples[/]
    """
    c = resolve(ctx, "serve")
    from stages.errors import UserInputError
    from stages.sample.rollout_server import RolloutService
    from stages.web import JsonServer, is_loopback

    token = None
    if c["token_env"]:
        token = os.environ.get(c["token_env"])
        if not token:
            raise UserInputError(
                f"--token-env {c['token_env']}: ${c['token_env']} is not set; export the token"
            )
    service = RolloutService(
        c["model"],
        c["adapter"],
        device=device(),
        dtype=c["dtype"],
        served_name=c["served_model_name"],
        token=token,
        max_request_bytes=c["max_request_mb"] * 2**20,
        max_batch=c["max_batch"],
    )
    try:
        server = JsonServer(service, c["host"], c["port"])
    except OSError as exc:
        raise UserInputError(
            f"--host {c['host']} --port {c['port']}: cannot bind ({exc.strerror or exc}); "
            "pick a free --port (0 picks one) or a local address"
        ) from None
    if not is_loopback(c["host"]) and token is None:
        log(
            f"[yellow]warning:[/] serving on {c['host']} without --token-env: anyone who reaches it can use it"
        )
    try:  # from here on, SIGTERM or Ctrl-C (a KeyboardInterrupt, see handle_errors) is a normal stop
        if json_:
            ready = {
                "url": server.url,
                "model": service.served_name,
                "weights": service.weights,
                "pid": os.getpid(),
            }
            sys.stdout.write(json.dumps(ready, sort_keys=True) + "\n")
            sys.stdout.flush()
        else:
            log(
                f"[green]serving[/] {service.served_name} ({service.engine.family}, weights version "
                f"{service.weights['version']}) at {server.url}; Ctrl-C stops"
            )
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    log("[green]stopped[/] rollout server", quiet=json_)
