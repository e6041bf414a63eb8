"""`omnirl serve-reward`: serve registered rewards over HTTP for `--reward remote:http://host:port/NAME`."""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

import typer

from ..choices import REWARD_ENTRY_POINTS, REWARDS, complete
from ..config import resolve
from ..console import log
from ..errors import handle_errors
from ..options import ConfigOpt, JsonOpt, SetOpt


@handle_errors
def serve_reward(
    ctx: typer.Context,
    reward: Annotated[
        list[str] | None,
        typer.Option(
            "--reward",
            "-r",
            autocompletion=complete(REWARDS, REWARD_ENTRY_POINTS),
            help="NAME[=WEIGHT], repeatable: a reward to serve (built-in, module:function, path/file.py:function "
            "or entry point), as `omnirl score --reward` takes it. POST /NAME scores one, POST /score all "
            "(the weighted sum in `reward`).",
        ),
    ] = None,
    reward_args: Annotated[
        list[str] | None,
        typer.Option(
            "--reward-arg",
            help="NAME.KEY=VALUE, repeatable: an argument of reward NAME, as `omnirl score --reward-arg`.",
        ),
    ] = None,
    host: Annotated[
        str,
        typer.Option(
            "--host", help="Address to bind: 127.0.0.1 (default) keeps it on this machine; 0.0.0.0 opens it."
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port to bind; 0 picks a free one (printed).")
    ] = 18090,
    token_env: Annotated[
        str | None,
        typer.Option(
            "--token-env",
            help="Environment variable holding a bearer token every POST must carry (clients: "
            "--reward-arg remote:URL.token_env=VAR).",
        ),
    ] = None,
    max_request_mb: Annotated[
        int, typer.Option("--max-request-mb", min=1, help="Largest request body, in MiB (413 above).")
    ] = 64,
    max_batch: Annotated[
        int, typer.Option("--max-batch", min=1, help="Most images in one request (413 above).")
    ] = 256,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Serve rewards over HTTP until SIGTERM or Ctrl-C, for `omnirl score --reward remote:URL/NAME`.

    A POST carries JSON {images: list of base64 PNG/JPEG, prompts, meta}; the reply is {rewards: {NAME:
    list of float or null}, reward: the weighted sums}. GET /health lists the rewards. No pickle; a request
    that is malformed, over --max-request-mb or --max-batch, or without the token gets a 4xx JSON error and
    the server keeps serving. When ready it prints its URL (with --json, one JSON line on stdout: url,
    rewards, pid).

    Example: [bold]omnirl serve-reward --reward ocr --port 18090[/], then
    [bold]omnirl score --in run/it0/samples --reward remote:http://127.0.0.1:18090/ocr --out run/it0/rewards[/]
    """
    c = resolve(ctx, "serve-reward")
    from stages.errors import UserInputError
    from stages.score.registry import check_reward_args, parse_reward_args, parse_reward_spec, reward_kind
    from stages.score.reward_server import RewardServer, RewardService, is_loopback

    specs = [parse_reward_spec(s) for s in c["reward"] or []]
    if not specs:
        raise UserInputError(
            "--reward: give at least one reward to serve, e.g. --reward jpeg_compressibility"
        )
    for name, _ in specs:
        if reward_kind(name) != "image":
            raise UserInputError(
                f"--reward {name}: it scores {reward_kind(name)}s; serve-reward serves image rewards"
            )
    args = check_reward_args([name for name, _ in specs], parse_reward_args(c["reward_args"]))
    token = None
    if c["token_env"]:
        token = os.environ.get(c["token_env"])
        if not token:
            raise UserInputError(
                f"--token-env {c['token_env']}: ${c['token_env']} is not set; export the token"
            )
    service = RewardService(
        specs,
        args,
        token=token,
        max_request_bytes=c["max_request_mb"] * 2**20,
        max_batch=c["max_batch"],
    )
    try:
        server = RewardServer(service, c["host"], c["port"])
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
            ready = {"url": server.url, "rewards": service.weights, "pid": os.getpid()}
            sys.stdout.write(json.dumps(ready, sort_keys=True) + "\n")
            sys.stdout.flush()
        else:
            names = ", ".join(service.weights)
            log(
                f"[green]serving[/] {names} at {server.url} (POST /NAME or /score, GET /health); Ctrl-C stops"
            )
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    log("[green]stopped[/] reward server", quiet=json_)
