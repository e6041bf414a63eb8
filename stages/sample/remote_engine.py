"""The ``remote`` rollout engine: a client of `omnirl serve` speaking rollout protocol v1.

On open it polls ``GET /health`` until the server answers 200 (connection refused or 503 mean "still
starting"; after ``--server-startup-timeout`` seconds it gives up: `RuntimeFailure`, exit 1), then
checks that the server holds the weights this run names: the digest of the local --model and of the
--adapter (or none), as the run's identity records them. A server holding others is a one-line
`UserInputError` (exit 2), as are a URL that is not an http(s) URL, a host that does not resolve and
a server that is not `omnirl serve` (404, not JSON).

Each batch is one ``POST /omnirl/v1/rollout`` carrying the samples' seeds, so a batch sent again
returns the same samples. Connection errors, timeouts, 502, 503 and 504 are retried up to
``--server-retries`` times with exponential backoff (0.5 s doubling, capped at 30 s) and ±50% jitter;
a 500 once; a 4xx never (the request is wrong: exit 2). A server that stays down is a `RuntimeFailure`
naming the URL; the shards written before it are kept and a re-run resumes after them. Every reply is
validated (`rollout_protocol.decode_response`: request id, count, shapes, finiteness); an aborted
batch is drawn again with the same seeds (`rollout_protocol.redraw_aborted`).

When the server's weights dtype (its /health ``dtype``) is the run's --dtype, a batch with a prompt the
engine has no conditioning of yet asks for the batch's prompt conditioning (``return_conditioning``), and
`conditioning` returns what the server sampled with: `omnirl sample` stores it and `online`'s trainer
trains on it, with no text encoder. A server of another dtype (or one that predates the field) is not
asked: its rollouts are encoded downstream, as before.

A run that trains (`online --engine remote`) opens the engine with `EngineOptions.pushed_weights`: it
sends each new LoRA itself (`push_weights`: the LoRA file's bytes with their SHA-256 and a version;
retried like a batch, since the same bytes and version may be sent twice), its requests accept any
adapter the server holds, and each sample records the version the server used. With
`EngineOptions.weights_name` its pushes and requests name its weights, so several trainers share one
server without overwriting each other's, and `pin_weights` makes the requests ask for one version (409
when the server no longer holds it). The server holds a name on a lease (``lease_s`` in the push's
reply) that each push and batch renews; while it holds named weights the engine also renews it from a
thread every third of the lease (``POST /omnirl/v1/weights/lease``), so a long update does not lose
them, while a killed run's name runs out and frees its place. `close` stops that and forgets them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import urllib.parse
from collections.abc import Hashable, Sequence
from typing import Any

from stages.errors import RuntimeFailure, UserInputError
from stages.models.conditioning import Entries, Key
from stages.models.families import Resolution
from stages.sample.engines import EngineOptions, RolloutEngine, register_engine
from stages.sample.rollout_protocol import (
    PROTOCOL,
    ROUTE,
    VERSION,
    decode_conditioning,
    decode_response,
    encode_request,
    redraw_aborted,
    wire_resolution,
)
from stages.web import JsonClient, Retryable, one_line

logger = logging.getLogger(__name__)

WEIGHTS_ROUTE = "/omnirl/v1/weights"
LEASE_ROUTE = "/omnirl/v1/weights/lease"
CLOSE_TIMEOUT_S = 10.0  # the one DELETE `close` sends
START_HINT = "start it with `omnirl serve --model M --port P` and pass --server-url http://HOST:P"


class RolloutClient(JsonClient):
    """JSON requests to one `omnirl serve` at `url`, with its token, timeouts and retries."""

    def __init__(self, url: str, *, token: str | None, timeout: float, retries: int):
        super().__init__(
            url,
            token=token,
            timeout=timeout,
            retries=retries,
            what="`omnirl serve`",
            noun="rollout server",
            hint=START_HINT,
            binary=True,
        )

    def wait_healthy(self, budget: float, check: Any = None) -> dict[str, Any]:
        """``GET /health`` until it answers 200 within `budget` seconds; its reply, which must name
        protocol v1."""

        def speaks_v1(reply: Any) -> None:
            if not isinstance(reply, dict) or f"{PROTOCOL}/{VERSION}" not in (reply.get("protocols") or []):
                raise UserInputError(
                    f"{self.url}/health: not an `omnirl serve` speaking {PROTOCOL}/{VERSION}; {START_HINT}"
                )

        return super().wait_healthy(budget, check or speaks_v1)


@register_engine("remote")
class RemoteEngine(RolloutEngine):
    """Rollouts computed by `omnirl serve` (module docstring)."""

    takes_pushed_weights = True

    def __init__(
        self,
        client: RolloutClient,
        health: dict[str, Any],
        weights: dict[str, Any],
        pushed: bool = False,
        dtype: str | None = None,
    ):
        self.client = client
        self.family = str(health.get("family"))
        self.weights = weights  # what every request asks the server to hold
        self.server_weights = dict(health.get("weights") or {})
        self.pushed = pushed  # the run pushes its weights: samples record the version the server used
        self.pushed_named = False  # this engine pushed named weights, which `close` forgets
        self.heartbeat: threading.Event | None = None  # set to stop renewing their lease (`_keep_lease`)
        # the server's prompt conditioning is the run's own only at the run's --dtype (module docstring)
        self.returns_conditioning = dtype is not None and health.get("dtype") == dtype
        self.received: Entries = {}  # the prompt conditioning the server's replies carried

    @classmethod
    def open(cls, options: EngineOptions, device: Any) -> RemoteEngine:
        """The client of `options.server_url`, once healthy and holding the weights of `options` (with
        `options.pushed_weights`: holding the model; the adapter is the one the run pushes)."""
        from stages.shards.digest import content_digest

        if not options.server_url:
            raise UserInputError(f"--engine remote needs --server-url; {START_HINT}")
        client = RolloutClient(
            options.server_url,
            token=options.token(),
            timeout=options.request_timeout,
            retries=options.retries,
        )
        weights: dict[str, Any] = {"model_sha256": content_digest(options.model, "--model")}
        if options.weights_name is not None:
            weights["name"] = options.weights_name
        if not options.pushed_weights:
            weights["adapter_sha256"] = (
                None if options.adapter is None else content_digest(options.adapter, "--adapter")
            )
            weights["version"] = None
        health = client.wait_healthy(options.startup_timeout)
        held = health.get("weights") or {}
        if held.get("model_sha256") != weights["model_sha256"]:
            raise UserInputError(
                f"--server-url {client.url} serves model {health.get('model')!r}, not the weights of --model "
                f"{options.model}; start `omnirl serve --model {options.model}`"
            )
        if not options.pushed_weights and held.get("adapter_sha256") != weights["adapter_sha256"]:
            have = held.get("adapter") or "the base model"
            want = options.adapter or "the base model (no --adapter)"
            raise UserInputError(
                f"--server-url {client.url} holds {have}, not {want}; load it with POST "
                f"{client.url}/omnirl/v1/weights or restart `omnirl serve` with that --adapter"
            )
        return cls(client, health, weights, options.pushed_weights, options.dtype)

    def rollout(
        self,
        cfg: Any,
        prompts: list[str],
        negatives: list[str],
        seeds: list[int],
        init_seeds: list[int],
        *,
        groups: Sequence[Hashable],
        sample_ids: Sequence[str],
    ) -> dict[str, Any]:
        ids = list(sample_ids)
        request_id = hashlib.sha256(json.dumps([ids, list(seeds)]).encode()).hexdigest()[:16]
        keys = [(p, n, cfg.max_sequence_length, "") for p, n in zip(prompts, negatives)]
        ask = self.returns_conditioning and any(key not in self.received for key in keys)
        body = encode_request(
            request_id, cfg, prompts, negatives, seeds, init_seeds, list(groups), ids, self.weights, ask
        )

        def draw() -> tuple[int, dict[str, Any], Entries | None]:
            reply = self.client.call(ROUTE, body)
            version, columns = decode_response(reply, body)
            return version, columns, decode_conditioning(reply, body)

        version, columns, conditioning = redraw_aborted(
            draw, f"{self.client.url}{ROUTE} samples {ids[0]}..{ids[-1]}"
        )
        self.received.update(conditioning or {})
        self.server_weights["version"] = version
        if self.pushed:
            import torch

            columns["policy_version"] = torch.full((len(ids),), version, dtype=torch.int64)
        return columns

    def conditioning(self, keys: list[Key]) -> Entries | None:
        """The prompt conditioning the server sampled `keys` with, those it returned (module docstring);
        None from a server that is not asked for it."""
        if not self.returns_conditioning:
            return None
        return {key: self.received[key] for key in keys if key in self.received}

    def push_weights(self, lora: bytes, version: int) -> dict[str, Any]:
        """Send a LoRA file's bytes as weights `version` (``POST /omnirl/v1/weights?sha256=&version=``);
        the server swaps them in before answering. Returns its reply (weights held, how loaded)."""
        digest = hashlib.sha256(lora).hexdigest()
        fields: dict[str, Any] = {"sha256": digest, "version": int(version)}
        if "name" in self.weights:
            fields["name"] = self.weights["name"]
        query = urllib.parse.urlencode(fields)
        reply = self.client.call(f"{WEIGHTS_ROUTE}?{query}", lora)
        held = reply.get("weights") if isinstance(reply, dict) else None
        if (
            not isinstance(held, dict)
            or held.get("adapter_sha256") != digest
            or held.get("version") != version
        ):
            raise RuntimeFailure(
                f"{self.client.url}{WEIGHTS_ROUTE}: the server did not take weights version {version} (it "
                f"answered {one_line(reply)!r}); check the server"
            )
        self.server_weights = dict(held)
        self.pushed_named = "name" in self.weights
        lease = held.get("lease_s")
        if self.pushed_named and self.heartbeat is None and isinstance(lease, (int, float)) and lease > 0:
            self._keep_lease(float(lease))
        return reply

    def _keep_lease(self, lease: float) -> None:
        """Renew the lease of this engine's named weights every `lease` / 3 seconds from a daemon thread,
        until `close`; a failed renewal is logged (the next one, a push or a batch may still make it)."""
        stop = self.heartbeat = threading.Event()
        body = {"name": self.weights["name"]}

        def beat() -> None:
            while not stop.wait(lease / 3):
                try:
                    self.client.once(LEASE_ROUTE, body, min(CLOSE_TIMEOUT_S, lease / 3))
                except (UserInputError, Retryable) as exc:
                    logger.warning("could not renew weights %r on %s: %s", body["name"], self.client.url, exc)

        threading.Thread(target=beat, name=f"lease {body['name']}", daemon=True).start()

    def close(self) -> None:
        """Stop renewing the lease of the named weights this engine pushed and forget them (``DELETE
        /omnirl/v1/weights?name=``), so a finished run leaves the shared server's table; one try of `CLOSE_TIMEOUT_S`, a failure is
        logged, never raised."""
        if self.heartbeat is not None:
            self.heartbeat.set()
            self.heartbeat = None
        if not self.pushed_named:
            return
        self.pushed_named = False
        query = urllib.parse.urlencode({"name": self.weights["name"]})
        try:  # one try, briefly: a run failing because the server is gone must not wait on it
            self.client.once(f"{WEIGHTS_ROUTE}?{query}", None, CLOSE_TIMEOUT_S, method="DELETE")
        except (UserInputError, Retryable) as exc:
            logger.warning(
                "could not forget weights %r on %s: %s", self.weights["name"], self.client.url, exc
            )

    def pin_weights(self, version: int | None) -> None:
        """Ask every following request for weights `version` (None: any the server holds)."""
        if version is None:
            self.weights.pop("version", None)
        else:
            self.weights["version"] = int(version)

    def latent_shape(self, resolution: Resolution, frames: int = 1) -> tuple[int, ...]:
        body = {"resolution": wire_resolution(resolution), "frames": frames}
        reply = self.client.call("/omnirl/v1/latent_shape", body)
        return tuple(int(d) for d in reply["latent_shape"])

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "server_url": self.client.url, "server_weights": self.server_weights}
