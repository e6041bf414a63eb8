"""The weights `omnirl serve` holds and swaps without a restart (the weights routes of
`stages.sample.rollout_server`, whose docstring states them): the pipeline, its unnamed weights
(the ``--adapter`` or the last ones loaded), and the named weights several trainers push, each kept
on a lease. A LoRA is swapped onto the pipeline in place (`FlowPolicy.set_lora`); other adapters load
as a second pipeline beside, then swap in.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from http import HTTPStatus
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.sample.engines import DiffusersEngine
from stages.sample.lockstep import Pipelines
from stages.sample.rollout_protocol import WEIGHTS_NAME, WEIGHTS_NAME_RULE, check_weights
from stages.web import HttpError, parse_json_object

logger = logging.getLogger(__name__)
WEIGHTS_ROUTE = "/omnirl/v1/weights"
PUSHED = "pushed"  # the `adapter` of weights a client pushed as a LoRA file
# versions of each named weights the server keeps (the latest pushed): a sampler at --max-staleness 1
# pins the version before the one its trainer pushes meanwhile
KEEP_VERSIONS = 2
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def weights_name_field(value: Any) -> str | None:
    """The `name` of named weights (None: the unnamed ones); 400 unless 1–64 letters, digits, ``._-``."""
    if value is None:
        return None
    if not isinstance(value, str) or not WEIGHTS_NAME.match(value):
        raise HttpError(HTTPStatus.BAD_REQUEST, f"name must be {WEIGHTS_NAME_RULE}")
    return value


class ServedWeights:
    """The pipeline a rollout server runs (`engine`, one request at a time under `lock`) and the weights
    on it: the unnamed ones (`weights`, their record) and the named ones (`named`, on leases).

    `weights_root` is the folder adapter paths load from; without one, `any_folder` says whether a
    request may name any folder (a server with a token trusts its holders with its files). Every
    pipeline is opened, changed and run through `pipelines` (`stages.sample.lockstep`: on one process,
    or on every rank of a sequence/tensor-parallel group); default: this process's, of `model`."""

    def __init__(
        self,
        model: Path,
        adapter: str | Path | None = None,
        *,
        device: Any = "cpu",
        dtype: str = "fp32",
        max_named: int = 16,
        named_ttl: float = 600.0,
        weights_root: str | Path | None = None,
        any_folder: bool = False,
        pipelines: Pipelines | None = None,
    ):
        from stages.shards.digest import content_digest

        self.model = model
        self.pipelines = pipelines or Pipelines(model, dtype=dtype, device=device)
        self.model_sha256 = content_digest(self.model, "--model")
        self.max_named = max_named  # names of named weights held at once (each up to KEEP_VERSIONS LoRAs)
        self.named_ttl = named_ttl  # seconds a name is held without a renewal (`_renew`)
        self.any_folder = any_folder
        self.weights_root = None if weights_root is None else Path(weights_root).resolve()
        if self.weights_root is not None and not self.weights_root.is_dir():
            raise UserInputError(f"--weights-root {weights_root}: not a folder; create it or pass another")
        self.lock = threading.Lock()  # the model runs one request at a time
        self.loading = threading.Lock()  # one adapter loads at a time
        self.weights = self._start(adapter)
        self.engine = self._open(adapter)
        # named weights (several trainers on one server): name → version → (layers, config, record),
        # the latest KEEP_VERSIONS pushed of each, behind `table` (never held while the model runs, so
        # pushes and /health do not wait for a batch); `active` is the one on the pipeline (None: the
        # unnamed weights, `self.weights`, whose LoRA `default_lora` holds once swapped away from) and
        # `active_entry` the table entry it was copied from (a version pushed again is a new entry)
        self.table = threading.Lock()
        self.named: dict[str, dict[int, tuple[Any, Any, dict[str, Any]]]] = {}
        self.leases: dict[str, float] = {}  # name → when (time.monotonic) it is forgotten unless renewed
        self.active: tuple[str, int] | None = None
        self.active_entry: tuple[Any, Any, dict[str, Any]] | None = None
        self.default_lora: tuple[Any, Any] | None = None

    def _open(self, adapter: str | Path | None) -> DiffusersEngine:
        return self.pipelines.open(adapter)

    def _replace(self, engine: DiffusersEngine) -> None:
        """Serve `engine` from now on, forgetting the one served (the caller holds the model lock)."""
        old, self.engine = self.engine, engine
        self.pipelines.drop(old)

    def rollout(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`DiffusersEngine.rollout` on the pipeline served (on every rank of its group); the caller
        holds the model lock."""
        return self.pipelines.rollout(self.engine, *args, **kwargs)

    def _record(
        self, adapter: str | None, digest: str | None, version: int, name: str | None = None
    ) -> dict[str, Any]:
        record = {
            "model_sha256": self.model_sha256,
            "adapter": adapter,
            "adapter_sha256": digest,
            "version": version,
        }
        return record if name is None else {"name": name, **record}

    def _start(self, adapter: str | Path | None) -> dict[str, Any]:
        from stages.models.folders import read_adapter_config
        from stages.shards.digest import content_digest

        self.full = False  # whether the pipeline holds a full adapter (no LoRA swaps onto it in place)
        if adapter is None:
            return self._record(None, None, 0)
        config = read_adapter_config(adapter)
        self.full = config["kind"] == "full"
        return self._record(str(adapter), content_digest(adapter, "adapter"), int(config.get("step", 0)))

    def _swap(self, layers: Any, config: Any, record: dict[str, Any]) -> dict[str, Any]:
        """Swap a LoRA (None: the base model) onto the pipeline in place (`FlowPolicy.set_lora`); a
        pipeline holding a full adapter or text-encoder LoRA layers is reloaded beside instead."""
        if self.full or self.engine.policy.untrained_loras():
            engine = self._open(None)
            try:
                how = self.pipelines.set_lora(engine, layers, config)
            except UserInputError:
                self.pipelines.drop(engine)
                raise
            with self.lock:
                self._replace(engine)
                self.weights, self.full = record, False
                self.active, self.active_entry, self.default_lora = None, None, (layers, config)
            return {"how": f"reloaded, {how}"}
        with self.lock:  # no rollout sees half-copied weights
            how = self.pipelines.set_lora(self.engine, layers, config)
            self.weights = record
            self.active, self.active_entry, self.default_lora = None, None, (layers, config)
        return {"how": how}

    def _store_named(self, name: str, layers: Any, config: Any, record: dict[str, Any]) -> dict[str, Any]:
        """Keep LoRA `layers` as version ``record["version"]`` of the weights `name` (the latest
        KEEP_VERSIONS pushed stay); the pipeline changes only when a request asks for them."""
        if self.full or self.engine.policy.untrained_loras():
            raise HttpError(
                HTTPStatus.UNPROCESSABLE_ENTITY,
                "named weights are LoRAs swapped onto the base model, and this server holds a full adapter or "
                "text-encoder LoRAs (its --adapter); serve the base model for named weights",
            )
        version = record["version"]
        with self.table:  # a version on the pipeline now is swapped anew by the next batch asking for it
            self._forget_expired()
            if name not in self.named and len(self.named) >= self.max_named:
                raise HttpError(
                    HTTPStatus.CONFLICT,
                    f"the server holds {len(self.named)} named weights, its --max-named-weights; forget "
                    f"one first (DELETE {WEIGHTS_ROUTE}?name=NAME; GET {WEIGHTS_ROUTE} lists them)",
                )
            held = self.named.setdefault(name, {})
            held.pop(version, None)
            held[version] = (layers, config, record)
            while len(held) > KEEP_VERSIONS:
                held.pop(next(iter(held)))  # the oldest pushed
            self._renew(name)
            return {
                "how": "stored",
                "weights": {**record, "versions": sorted(held), "lease_s": self.named_ttl},
            }

    def _forget_expired(self) -> None:
        """Forget the named weights whose lease ran out (the caller holds `table`)."""
        now = time.monotonic()
        for name in [n for n, until in self.leases.items() if until <= now]:
            del self.named[name], self.leases[name]
            logger.info("forgot weights %r: no push, batch or lease renewal for %g s", name, self.named_ttl)

    def _renew(self, name: str) -> None:
        """Hold the named weights `name` --named-weights-ttl seconds more (the caller holds `table`)."""
        self.leases[name] = time.monotonic() + self.named_ttl

    def activate(
        self, target: tuple[str, int] | None, entry: tuple[Any, Any, dict[str, Any]] | None = None
    ) -> None:
        """Put the unnamed weights (None) or version `target` of named weights (its table `entry`) on
        the pipeline, in place; the caller holds the model lock."""
        from stages.models.lora_weights import read_lora_file

        if target == self.active and entry is self.active_entry:
            return
        if target is None:
            layers, config = self.default_lora  # type: ignore[misc]  (kept when swapped away)
        else:
            if self.full:
                raise HttpError(
                    HTTPStatus.CONFLICT,
                    "the server now holds a full adapter: named LoRAs no longer swap onto it; push again "
                    "after loading a LoRA or the base model",
                )
            if self.active is None and self.default_lora is None:
                policy = self.engine.policy
                self.default_lora = (
                    read_lora_file(policy.lora_file(), policy.family.trained_module)
                    if policy.lora
                    else (None, None)
                )
            layers, config, _ = entry  # type: ignore[misc]
        self.pipelines.set_lora(self.engine, layers, config)
        self.active, self.active_entry = target, entry

    def select(self, weights: dict[str, Any]) -> int:
        """Put the weights a rollout request names on the pipeline (the caller holds the model lock);
        their version. 409 when the server does not hold them (`stages.sample.rollout_server` docstring)."""
        name = weights.get("name")
        if name is None:
            conflict = check_weights(weights, self.weights)
            if conflict:
                raise HttpError(
                    HTTPStatus.CONFLICT,
                    f"{conflict}; load those weights (POST {WEIGHTS_ROUTE}) or restart with that --adapter",
                )
            self.activate(None)
            return int(self.weights["version"])
        model = weights.get("model_sha256")
        if model is not None and model != self.model_sha256:
            raise HttpError(
                HTTPStatus.CONFLICT,
                f"model_sha256 {model!r} was asked, the server holds {self.model_sha256!r}",
            )
        with self.table:
            self._forget_expired()
            held = dict(self.named.get(name) or {})
            if held:
                self._renew(name)
        if not held:
            raise HttpError(
                HTTPStatus.CONFLICT,
                f"no weights named {name!r} here (never pushed, deleted, or its lease ran out); push them "
                f"first (POST {WEIGHTS_ROUTE}?name={name}&sha256=...&version=N)",
            )
        version = weights.get("version")
        version = next(reversed(held)) if version is None else version  # the latest pushed
        if version not in held:
            raise HttpError(
                HTTPStatus.CONFLICT,
                f"weights {name!r} version {version} was asked; the server holds versions "
                f"{sorted(held)} of it (the latest {KEEP_VERSIONS} pushed): push that version again",
            )
        digest = weights.get("adapter_sha256")
        if digest is not None and digest != held[version][2]["adapter_sha256"]:
            raise HttpError(
                HTTPStatus.CONFLICT,
                f"weights {name!r} version {version} hold adapter_sha256 {held[version][2]['adapter_sha256']!r}, "
                f"not the {digest!r} asked",
            )
        try:
            self.activate((name, version), held[version])
        except UserInputError as exc:  # a model whose LoRA does not swap in place (two experts)
            raise HttpError(HTTPStatus.UNPROCESSABLE_ENTITY, str(exc)) from None
        return int(version)

    def named_weights(self) -> dict[str, Any]:
        """``{name: {"versions", "version", "adapter_sha256", "lease_left_s"}}`` of the named weights
        held (latest last)."""
        with self.table:
            self._forget_expired()
            now = time.monotonic()
            return {
                name: {
                    "versions": sorted(held),
                    "version": next(reversed(held)),
                    "adapter_sha256": held[next(reversed(held))][2]["adapter_sha256"],
                    "lease_left_s": round(self.leases[name] - now, 3),
                }
                for name, held in self.named.items()
            }

    def renew_lease(self, raw: bytes) -> dict[str, Any]:
        """``POST /omnirl/v1/weights/lease`` ``{"name": NAME}``: NAME is held --named-weights-ttl seconds
        more; 404 when it is not held."""
        name = weights_name_field(parse_json_object(raw).get("name"))
        if name is None:
            raise HttpError(HTTPStatus.BAD_REQUEST, 'name the weights whose lease to renew: {"name": NAME}')
        with self.table:
            self._forget_expired()
            if name not in self.named:
                raise HttpError(
                    HTTPStatus.NOT_FOUND,
                    f"no weights named {name!r} here (never pushed, deleted, or its lease ran out); push them again",
                )
            self._renew(name)
            return {"name": name, "versions": sorted(self.named[name]), "lease_s": self.named_ttl}

    def _load_folder(self, adapter: str | None, version: int | None, name: str | None) -> dict[str, Any]:
        """``POST /omnirl/v1/weights`` with a folder path (`stages.sample.rollout_server` docstring)."""
        from stages.models.folders import LORA_WEIGHTS, read_adapter_config
        from stages.models.lora_weights import read_lora_file
        from stages.shards.digest import content_digest

        if adapter is None:
            if name is not None:
                return self._store_named(name, None, None, self._record(None, None, version or 0, name))
            return self._swap(None, None, self._record(None, None, 0 if version is None else version))
        config = read_adapter_config(adapter, "adapter")
        digest = content_digest(adapter, "adapter")
        step = int(config.get("step", 0)) if version is None else version
        file = Path(adapter) / LORA_WEIGHTS
        if config["kind"] == "lora" and file.is_file():
            try:
                layers, lora = read_lora_file(file.read_bytes(), self.engine.policy.family.trained_module)
            except ValueError:  # another trainer's file (text-encoder layers, no config): load it whole
                pass
            else:
                record = self._record(adapter, digest, step, name)
                if name is not None:
                    return self._store_named(name, layers, lora, record)
                return self._swap(layers, lora, record)
        if name is not None:
            raise HttpError(
                HTTPStatus.UNPROCESSABLE_ENTITY,
                f"named weights must be a LoRA in diffusers' layout ({LORA_WEIGHTS}); {adapter} is not",
            )
        engine = self._open(adapter)  # a PEFT folder or a full adapter: a pipeline beside, then swapped
        with self.lock:
            self._replace(engine)
            self.full = config["kind"] == "full"
            self.weights = self._record(adapter, digest, step)
            self.active, self.active_entry, self.default_lora = None, None, None
        return {"how": "reloaded"}

    def _adapter_folder(self, adapter: str) -> str:
        """The folder a weights request names, resolved (symlinks followed), when this server may load
        it: under --weights-root when there is one, else anywhere for a server with a token (a token
        holder is trusted with its files). 403 otherwise, one reply whether the path exists or not, so
        that it tells nothing about the server's files."""
        if self.weights_root is None:
            if not self.any_folder:
                raise HttpError(
                    HTTPStatus.FORBIDDEN,
                    "this server loads no adapter folder by path: start it with --weights-root DIR "
                    "(folders under DIR) or --token-env VAR, or push the LoRA file (?sha256=HEX&version=N)",
                )
            return adapter
        try:
            folder = (self.weights_root / adapter).resolve()  # an absolute `adapter` replaces the root
        except (OSError, RuntimeError):  # a symlink loop
            folder = None
        if folder is None or not folder.is_relative_to(self.weights_root) or not folder.is_dir():
            raise HttpError(
                HTTPStatus.FORBIDDEN,
                "adapter: no such folder under this server's --weights-root; put the adapter there, or "
                "push its LoRA file (?sha256=HEX&version=N)",
            )
        return str(folder)

    def _load_pushed(self, raw: bytes, query: dict[str, list[str]], name: str | None) -> dict[str, Any]:
        """``POST /omnirl/v1/weights?sha256=HEX&version=N[&name=NAME]`` with a LoRA file's bytes (`stages.sample.rollout_server`
        docstring)."""
        from stages.models.lora_weights import read_lora_file

        digest = query["sha256"][-1].lower()
        if not _HEX64.match(digest):
            raise HttpError(HTTPStatus.BAD_REQUEST, "sha256 must be 64 hex digits (the body's SHA-256)")
        try:
            version = int(query.get("version", [""])[-1])
        except ValueError:
            raise HttpError(
                HTTPStatus.BAD_REQUEST, "a pushed adapter needs ?version=N (an integer)"
            ) from None
        actual = hashlib.sha256(raw).hexdigest()
        if actual != digest:
            raise HttpError(
                HTTPStatus.BAD_REQUEST,
                f"the body's sha256 is {actual[:12]}…, the request says {digest[:12]}…: the body was cut or "
                "changed on the way; send it again",
            )
        try:
            layers, lora = read_lora_file(raw, self.engine.policy.family.trained_module)
        except ValueError as exc:
            raise HttpError(HTTPStatus.UNPROCESSABLE_ENTITY, f"the pushed adapter: {exc}") from None
        if name is not None:
            return self._store_named(name, layers, lora, self._record(PUSHED, digest, version, name))
        return self._swap(layers, lora, self._record(PUSHED, digest, version))

    def load(self, raw: bytes, query: dict[str, list[str]]) -> dict[str, Any]:
        """``POST /omnirl/v1/weights``: a pushed LoRA file (``?sha256=``) or a JSON body naming a folder;
        answers the weights now held and how they were loaded (``how``, ``seconds``)."""
        t0 = time.perf_counter()
        with self.loading:
            try:
                if "sha256" in query:
                    name = weights_name_field(query.get("name", [None])[-1])
                    load = self._load_pushed(raw, query, name)
                else:
                    body = parse_json_object(raw)
                    adapter, version = body.get("adapter"), body.get("version")
                    name = weights_name_field(body.get("name"))
                    if adapter is not None and not isinstance(adapter, str):
                        raise HttpError(
                            HTTPStatus.BAD_REQUEST, "adapter must be a folder path on the server or null"
                        )
                    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
                        raise HttpError(HTTPStatus.BAD_REQUEST, "version must be an integer or null")
                    folder = None if adapter is None else self._adapter_folder(adapter)
                    load = self._load_folder(folder, version, name)
            except UserInputError as exc:
                raise HttpError(HTTPStatus.UNPROCESSABLE_ENTITY, str(exc)) from None
        held = load.pop("weights", None) or dict(self.weights)  # the named weights stored, else those held
        return {"weights": held, "load": {**load, "seconds": time.perf_counter() - t0}}

    def forget(self, name: str, version: int | None) -> list[int]:
        """Forget version `version` (None: every version) of the named weights `name`; the versions
        forgotten. 404 when they are not held. The pipeline keeps what it has on it until a batch asks
        for other weights."""
        with self.table:
            self._forget_expired()
            held = self.named.get(name) or {}
            versions = sorted(held) if version is None else [version]
            if not held:
                raise HttpError(HTTPStatus.NOT_FOUND, f"no weights named {name!r} here")
            if versions[0] not in held:
                raise HttpError(
                    HTTPStatus.NOT_FOUND,
                    f"weights {name!r} version {version} is not held (versions {sorted(held)})",
                )
            for v in versions:
                del held[v]
            if not held:
                del self.named[name], self.leases[name]
        return versions
