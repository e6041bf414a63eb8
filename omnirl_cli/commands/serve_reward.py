"""`omnirl serve-reward`: serve registered rewards over HTTP for `--reward remote:http://host:port/NAME`."""

from __future__ import annotations

from stages.score.config import ServeRewardConfig

from ..generate import config_command
from ..runtime import serve_until_stopped, server_token


def run(c: ServeRewardConfig, json_: bool) -> None:
    """Serve rewards over HTTP until SIGTERM or Ctrl-C, for `omnirl score --reward remote:URL/NAME`.

    A POST carries JSON {images: list of base64 PNG/JPEG, prompts, meta}; the reply is {rewards: {NAME:
    list of float or null}, reward: the weighted sums}. GET /health lists the rewards. No pickle; a request
    that is malformed, over --max-request-mb or --max-batch, or without the token gets a 4xx JSON error and
    the server keeps serving. When ready it prints its URL (with --json, one JSON line on stdout: url,
    rewards, pid). Threads, connections and the time to send a request are bounded
    (--workers, --max-connections: 503 past it, --request-timeout: 408): docs/serving.md.

    Example: [bold]omnirl serve-reward --reward ocr --port 18090[/], then
    [bold]omnirl score --in run/it0/samples --reward remote:http://127.0.0.1:18090/ocr --out run/it0/rewards[/]
    """
    from stages.errors import UserInputError
    from stages.score.registry import check_reward_args, parse_reward_args, parse_reward_spec, reward_kind
    from stages.score.reward_server import RewardServer, RewardService

    specs = [parse_reward_spec(s) for s in c.reward or []]
    if not specs:
        raise UserInputError(
            "--reward: give at least one reward to serve, e.g. --reward jpeg_compressibility"
        )
    for name, _ in specs:
        if reward_kind(name) != "image":
            raise UserInputError(
                f"--reward {name}: it scores {reward_kind(name)}s; serve-reward serves image rewards"
            )
    args = check_reward_args([name for name, _ in specs], parse_reward_args(c.reward_args))
    token = server_token(c)
    service = RewardService(
        specs,
        args,
        token=token,
        max_request_bytes=c.max_request_mb * 2**20,
        max_batch=c.max_batch,
    )
    serve_until_stopped(
        lambda host, port, limits: RewardServer(service, host, port, limits=limits),
        c,
        token=token,
        json_=json_,
        ready=lambda server: {"url": server.url, "rewards": service.weights},
        banner=f"{', '.join(service.weights)} (POST /NAME or /score, GET /health)",
    )


serve_reward = config_command(ServeRewardConfig, "serve-reward", run)
