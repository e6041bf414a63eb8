"""omnirl rollout protocol v1: one diffusion rollout batch as a JSON request and reply.

``POST /omnirl/v1/rollout`` (`omnirl serve`, client `stages.sample.remote_engine`). Request::

    {"protocol": "omnirl-rollout", "version": 1, "request_id": str,
     "sampling_params": {SampleConfig.RECORDED but batch_size},   # sampler, σ steps, window settings
                                                                   # "resolution": [height, width], or one side (square)
     "samples": [{"sample_id", "prompt", "negative_prompt", "seed", "init_seed", "group"}],
     "weights": {"model_sha256": str | null, "adapter_sha256": str | null, "version": int | null,
                 "name": str},                                    # name: optional, named weights
     "return_conditioning": bool}                                 # optional, default false

`seed` drives a sample's SDE noise, `init_seed` its x_T, `group` (the prompt's index) places its SDE
window (`rollout.stored_steps`), so a batch sent again returns the same samples. `weights` names the
weights the client expects: the model's digest (null: any weights) with the adapter's (null: the base
model; left out: any adapter, for a run that pushes its own) and a version (null or left out: any); a
server holding other weights answers 409. With a ``name`` the request asks for the weights pushed under
that name (several trainers share one server, each with its own LoRA): the version given (null or left
out: the latest it holds), 409 when the server no longer holds that version. Each ``sampling_params``
field has the type of its `SampleConfig` field (`PARAMS_SCHEMA`; numbers finite): any other value is
a 400 naming the field, before anything runs. Reply::

    {"protocol", "version", "request_id", "weight_version": int, "finish_reason": "stop",
     "media": [{"format": "png" | "mp4", "encoding": "base64", "data": str}],  # one per sample, in order
     "frames": [[{"format": "png", ...}]],          # only for a video with save_frames: PNG per frame
     "final_latent": tensor [B, *latent],
     "trajectory": {"latents": [B, K+1, *latent], "sigmas": [B, K+1],
                    "timesteps": [B, K], "log_probs": [B, K]} | null,   # null for the ode sampler
     "conditioning": {"format": "safetensors", "encoding": "base64", "data": str}}  # when asked

``media`` carries the rollout's media column (`stages.media.MEDIA_FORMATS`): a PNG per sample for an
image family, the MP4 of its frames (at ``sampling_params.fps``) for a video family, whose latents are
5-D (``[C, F', h, w]``); the client stores them as its ``image`` or ``video`` column, byte for byte.

With ``return_conditioning`` true the reply also carries the prompt conditioning the server sampled the
batch with: for each unique (prompt, negative prompt, ``max_sequence_length``) of the batch, what the
family adapter's `encode_prompts` gave, both CFG branches, as one safetensors file
(`stages.models.conditioning.to_bytes`; never pickle), so that the client stores it (`omnirl sample`)
or trains on it (`omnirl online`) without a text encoder. Its size is bounded by the batch (--max-batch
prompts at most). A server that cannot give it (an adapter with text-encoder LoRA layers) leaves the
field out, as does one that predates it; a server that predates the request field ignores it.

Tensors are `stages.sample.tensor_codec` objects, always float32 (never downcast). A client that sends
``Accept: application/x-msgpack`` gets the same reply as msgpack, every ``"encoding": "base64"`` object
(tensors, media) turned into ``"encoding": "raw"`` with its bytes (`stages.web.pack_binary`).

A reply whose ``finish_reason`` is ``"abort"`` (the server dropped the batch: a weight update, sleep,
an explicit abort) carries nothing else; the client draws the same samples again, with the same seeds,
up to `MAX_REDRAWS` times (`redraw_aborted`), then stops in one line. A group is never padded.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, Union

from stages.errors import RuntimeFailure, UserInputError
from stages.media import FRAMES_COLUMN, MEDIA_FORMATS, has_signature, media_column
from stages.models.conditioning import Entries, Key, from_bytes, to_bytes
from stages.models.families import Resolution, parse_resolution
from stages.sample.rollout import LATENT_DTYPES, SampleConfig, stored_steps
from stages.sample.tensor_codec import CodecError, decode_tensor, encode_tensor

PROTOCOL = "omnirl-rollout"
VERSION = 1
ROUTE = "/omnirl/v1/rollout"
WEIGHT_KEYS = ("model_sha256", "adapter_sha256", "version", "name")
WEIGHTS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # of named weights
WEIGHTS_NAME_RULE = "1-64 letters, digits, '.', '_' or '-' (not starting with one of those signs)"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FORMAT_COLUMNS = {fmt: column for column, fmt in MEDIA_FORMATS.items()}  # "png" → "image", "mp4" → "video"
MAX_SEED = 2**63 - 1
TRAJECTORY = ("latents", "log_probs", "timesteps", "sigmas")  # in the column order of rollout_batch
CONDITIONING_FORMAT = "safetensors"  # the reply's ``conditioning`` file
logger = logging.getLogger(__name__)
MAX_REDRAWS = 4  # further draws of an aborted sample before the run stops
_T = TypeVar("_T")


class ProtocolError(ValueError):
    """A request or reply that is not protocol v1 (one line: what and where)."""


class Aborted(ProtocolError):
    """The server aborted the request (``finish_reason`` "abort", or no media): draw it again."""


def redraw_aborted(draw: Callable[[], _T], what: str, attempts: int = MAX_REDRAWS) -> _T:
    """`draw()` again, with the same inputs, while it raises `Aborted`, at most `attempts` more times;
    then a `RuntimeFailure` naming `what` (the samples and the server), as is any other `ProtocolError`
    (a malformed reply) at once."""
    for attempt in range(attempts + 1):
        try:
            return draw()
        except Aborted as exc:
            last = exc
            logger.info("%s: aborted (%s); drawing it again, %d of %d", what, exc, attempt + 1, attempts)
        except ProtocolError as exc:
            raise RuntimeFailure(f"{what}: a malformed reply ({exc}); check the server") from None
    raise RuntimeFailure(
        f"{what}: aborted {attempts + 1} times in a row (last: {last}); the server keeps dropping requests "
        "(weight updates, sleep?): check it, then re-run: finished shards are kept"
    )


@dataclass
class RolloutRequest:
    """A decoded request: the batch of `rollout_batch`'s arguments plus the expected weights."""

    request_id: str
    cfg: SampleConfig
    prompts: list[str]
    negatives: list[str]
    seeds: list[int]
    init_seeds: list[int]
    groups: list[int | str]
    sample_ids: list[str]
    weights: dict[str, Any]
    return_conditioning: bool = False  # reply with the batch's prompt conditioning

    def conditioning_keys(self) -> list[Key]:
        """The batch's unique (prompt, negative prompt, max sequence length, no condition images), in order
        of appearance."""
        length = self.cfg.max_sequence_length
        return list(dict.fromkeys((p, n, length, "") for p, n in zip(self.prompts, self.negatives)))


def wire_resolution(resolution: Resolution) -> int | list[int]:
    """A resolution as requests carry it: one side for a square (as v1 always sent it, so a server of
    square sizes only still answers), else [height, width]."""
    height, width = parse_resolution(resolution)
    return height if height == width else [height, width]


def _sampling_params(cfg: SampleConfig) -> dict[str, Any]:
    """The settings of a request: fields at None are left out (their default), so a server that
    predates a field still answers a request that does not use it."""
    params = {k: v for k, v in cfg.record().items() if v is not None}
    params.pop("batch_size")
    params["resolution"] = wire_resolution(cfg.resolution)
    if "window_range" in params:
        params["window_range"] = list(params["window_range"])
    return params


def encode_request(
    request_id: str,
    cfg: SampleConfig,
    prompts: list[str],
    negatives: list[str],
    seeds: list[int],
    init_seeds: list[int],
    groups: list[Any],
    sample_ids: list[str],
    weights: dict[str, Any],
    return_conditioning: bool = False,
) -> dict[str, Any]:
    """The JSON body of one rollout batch (module docstring); `return_conditioning` asks for the batch's
    prompt conditioning too (left out when false, so a server that predates it reads the same body)."""
    samples = [
        {"sample_id": i, "prompt": p, "negative_prompt": n, "seed": int(s), "init_seed": int(t), "group": g}
        for i, p, n, s, t, g in zip(sample_ids, prompts, negatives, seeds, init_seeds, groups)
    ]
    return {
        "protocol": PROTOCOL,
        "version": VERSION,
        "request_id": request_id,
        "sampling_params": _sampling_params(cfg),
        "samples": samples,
        "weights": {k: weights[k] for k in WEIGHT_KEYS if k in weights},
        **({"return_conditioning": True} if return_conditioning else {}),
    }


def _params_schema() -> dict[str, Any]:
    """The type of each ``sampling_params`` field: `SampleConfig`'s annotation, but the resolution, which
    the wire carries as one side (a square) or [height, width] (`wire_resolution`)."""
    hints = typing.get_type_hints(SampleConfig)
    schema = {name: hints[name] for name in SampleConfig.RECORDED if name != "batch_size"}
    return {**schema, "resolution": int | tuple[int, int]}


PARAMS_SCHEMA = _params_schema()
_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


def _type_name(hint: Any) -> str:
    """How a request spells a value of `hint` (for a refusal): "an integer", "[an integer, ...]"."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"[{', '.join(_type_name(a) for a in typing.get_args(hint))}]"
    return _TYPE_NAMES[hint]


def _is_a(value: Any, hint: Any) -> bool:
    """Whether a JSON `value` is of `hint`: bool, int (not a bool), float (a finite int or float), str,
    None, a fixed-length tuple (a list) or a union of those."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_is_a(value, a) for a in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        return isinstance(value, list) and len(value) == len(args) and all(map(_is_a, value, args))
    if hint is type(None):
        return value is None
    if isinstance(value, bool) or hint is bool:
        return hint is bool and isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, hint)


def _check_params(params: dict[str, Any]) -> None:
    """`ProtocolError` naming the first ``sampling_params`` field that is unknown or not of its type
    (`PARAMS_SCHEMA`); ranges are `SampleConfig.validate`'s."""
    unknown = sorted(set(params) - set(PARAMS_SCHEMA))
    if unknown:
        raise ProtocolError(f"sampling_params has unknown fields {unknown}")
    for key, value in params.items():
        if not _is_a(value, PARAMS_SCHEMA[key]):
            shown = repr(value)[:40]
            raise ProtocolError(
                f"sampling_params.{key} must be {_type_name(PARAMS_SCHEMA[key])}, not {shown}"
            )


def _seed(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEED:
        raise ProtocolError(f"{where} must be an integer in [0, 2^63)")
    return value


def _check_version(body: dict[str, Any]) -> None:
    if body.get("protocol") != PROTOCOL or body.get("version") != VERSION:
        raise ProtocolError(
            f"protocol {body.get('protocol')!r} version {body.get('version')!r}; this speaks "
            f"{PROTOCOL!r} version {VERSION}"
        )


def decode_request(body: dict[str, Any], *, max_samples: int) -> RolloutRequest:
    """A request body checked and decoded; `ProtocolError` (400) when it is not v1, `UserInputError`
    (its settings are refused by `SampleConfig.validate`)."""
    _check_version(body)
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise ProtocolError("request_id must be a non-empty string")
    params, samples, weights = body.get("sampling_params"), body.get("samples"), body.get("weights") or {}
    if not isinstance(params, dict):
        raise ProtocolError("sampling_params must be an object")
    _check_params(params)
    try:
        cfg = SampleConfig.from_record(params)
    except UserInputError as exc:
        raise ProtocolError(f"sampling_params: {exc}") from None
    if not isinstance(samples, list) or not samples:
        raise ProtocolError("samples must be a non-empty list")
    if len(samples) > max_samples:
        raise ProtocolError(f"{len(samples)} samples in one request, more than the server's --max-batch")
    if not isinstance(weights, dict) or set(weights) - set(WEIGHT_KEYS):
        raise ProtocolError(f"weights must be an object with keys among {list(WEIGHT_KEYS)}")
    version = weights.get("version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise ProtocolError("weights.version must be an integer or null")
    if "name" in weights and not (isinstance(weights["name"], str) and WEIGHTS_NAME.match(weights["name"])):
        raise ProtocolError(f"weights.name must be {WEIGHTS_NAME_RULE}")
    return_conditioning = body.get("return_conditioning", False)
    if not isinstance(return_conditioning, bool):
        raise ProtocolError("return_conditioning must be true or false")
    columns: dict[str, list[Any]] = {k: [] for k in ("sample_id", "prompt", "negative_prompt", "group")}
    seeds, init_seeds = [], []
    for i, sample in enumerate(samples):
        where = f"samples[{i}]"
        if not isinstance(sample, dict):
            raise ProtocolError(f"{where} must be an object")
        for key in ("sample_id", "prompt", "negative_prompt"):
            if not isinstance(sample.get(key), str):
                raise ProtocolError(f"{where}.{key} must be a string")
            columns[key].append(sample[key])
        group = sample.get("group")
        if not isinstance(group, (int, str)) or isinstance(group, bool):
            raise ProtocolError(f"{where}.group must be an integer or a string")
        columns["group"].append(group)
        seeds.append(_seed(sample.get("seed"), f"{where}.seed"))
        init_seeds.append(_seed(sample.get("init_seed"), f"{where}.init_seed"))
    return RolloutRequest(
        request_id=request_id,
        cfg=cfg,
        prompts=columns["prompt"],
        negatives=columns["negative_prompt"],
        seeds=seeds,
        init_seeds=init_seeds,
        groups=columns["group"],
        sample_ids=columns["sample_id"],
        weights=dict(weights),
        return_conditioning=return_conditioning,
    )


def media_item(blob: bytes, fmt: str = "png") -> dict[str, Any]:
    """One ``media`` entry of a reply: a file of format `fmt` (png, mp4), base64-encoded."""
    return {"format": fmt, "encoding": "base64", "data": base64.b64encode(blob).decode("ascii")}


def media_fields(columns: dict[str, Any]) -> dict[str, Any]:
    """The ``media`` (and, for saved frames, ``frames``) fields of a reply carrying `columns`."""
    column = media_column(columns)
    fields: dict[str, Any] = {"media": [media_item(b, MEDIA_FORMATS[column]) for b in columns[column]]}
    if FRAMES_COLUMN in columns:
        fields[FRAMES_COLUMN] = [[media_item(png) for png in frames] for frames in columns[FRAMES_COLUMN]]
    return fields


def encode_response(
    request_id: str, weight_version: int, columns: dict[str, Any], conditioning: Entries | None = None
) -> dict[str, Any]:
    """The reply carrying `rollout_batch`'s `columns` and, when given, the batch's prompt `conditioning`
    (module docstring)."""
    trajectory = {k: encode_tensor(columns[k].float()) for k in TRAJECTORY} if "latents" in columns else None
    stored = {} if conditioning is None else {"conditioning": conditioning_item(conditioning)}
    return {
        "protocol": PROTOCOL,
        "version": VERSION,
        "request_id": request_id,
        "weight_version": int(weight_version),
        "finish_reason": "stop",
        **media_fields(columns),
        "final_latent": encode_tensor(columns["final_latent"].float()),
        "trajectory": trajectory,
        **stored,
    }


def conditioning_item(entries: Entries) -> dict[str, Any]:
    """The ``conditioning`` field of a reply: `entries` as a base64 safetensors file."""
    data = base64.b64encode(to_bytes(entries)).decode("ascii")
    return {"format": CONDITIONING_FORMAT, "encoding": "base64", "data": data}


def decode_conditioning(body: dict[str, Any], request: dict[str, Any]) -> Entries | None:
    """The prompt conditioning of a reply to `request` (an `encode_request` body), checked: a safetensors
    file holding exactly the request's unique (prompt, negative prompt, max sequence length), every float
    value finite; None when the reply carries none (module docstring). `ProtocolError` otherwise."""
    import torch
    from safetensors import SafetensorError

    item = body.get("conditioning")
    if item is None:
        return None
    data = item.get("data") if isinstance(item, dict) and item.get("format") == CONDITIONING_FORMAT else None
    try:
        blob = data if isinstance(data, bytes) else base64.b64decode(str(data), validate=True)
        entries = from_bytes(blob)
    except (binascii.Error, ValueError, KeyError, TypeError, IndexError, SafetensorError):
        raise ProtocolError("conditioning is not a base64 safetensors file of prompt conditioning") from None
    length = SampleConfig.from_record(request["sampling_params"]).max_sequence_length
    asked = {(s["prompt"], s["negative_prompt"], length, "") for s in request["samples"]}
    if set(entries) != asked:
        raise ProtocolError(f"conditioning holds {len(entries)} prompts, not the batch's {len(asked)}")
    for key, branches in entries.items():
        for values in branches:
            for name, value in values.items():
                if value.is_floating_point() and not torch.isfinite(value).all():
                    raise ProtocolError(f"conditioning of prompt {key[0][:40]!r}: {name} is not finite")
    return entries


def _media_blob(item: Any, where: str, formats: tuple[str, ...]) -> tuple[str, bytes]:
    """(format, bytes) of one media entry whose format is one of `formats`, checked by its signature."""
    fmt = item.get("format") if isinstance(item, dict) else None
    try:
        data = item["data"] if fmt in formats else b""
        blob = data if isinstance(data, bytes) else base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError, KeyError):
        blob = b""
    if not has_signature(str(fmt), blob):
        raise ProtocolError(f"{where} is not a base64 {' or '.join(f.upper() for f in formats)}")
    return str(fmt), blob


def _decode_media(body: dict[str, Any], batch: int, save_frames: bool) -> dict[str, list[Any]]:
    """The media columns of a reply: ``image`` (PNGs) or ``video`` (MP4s), one format for the batch,
    plus ``frames`` (a PNG per frame) for a video of a `save_frames` request."""
    media = body.get("media")
    if not isinstance(media, list) or len(media) != batch:
        raise ProtocolError(f"media must list {batch} files, one per sample")
    decoded = [_media_blob(item, f"media[{i}]", tuple(FORMAT_COLUMNS)) for i, item in enumerate(media)]
    fmts = sorted({fmt for fmt, _ in decoded})
    if len(fmts) > 1:
        raise ProtocolError(f"media mixes formats {fmts}")
    column = FORMAT_COLUMNS[fmts[0]]
    columns: dict[str, list[Any]] = {column: [blob for _, blob in decoded]}
    if column == "video" and save_frames:
        frames = body.get(FRAMES_COLUMN)
        if (
            not isinstance(frames, list)
            or len(frames) != batch
            or not all(isinstance(f, list) for f in frames)
        ):
            raise ProtocolError(f"{FRAMES_COLUMN} must list {batch} lists of PNG frames (save_frames)")
        columns[FRAMES_COLUMN] = [
            [_media_blob(item, f"{FRAMES_COLUMN}[{i}][{j}]", ("png",))[1] for j, item in enumerate(row)]
            for i, row in enumerate(frames)
        ]
    return columns


def decode_response(body: Any, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(weight version, the `rollout_batch` columns) of a reply to `request` (an `encode_request` body),
    checked: the request id, one PNG or MP4 per sample (and PNG frames where asked), float32 tensors of consistent shapes whose window
    length is the one `request`'s settings place, every value finite. `ProtocolError` otherwise."""
    if not isinstance(body, dict):
        raise ProtocolError("the reply is not a JSON object")
    _check_version(body)
    if body.get("request_id") != request["request_id"]:
        raise ProtocolError(f"reply to request {body.get('request_id')!r}, sent {request['request_id']!r}")
    if body.get("finish_reason") == "abort":
        raise Aborted(f"finish_reason 'abort': the server dropped request {request['request_id']}")
    if body.get("finish_reason") != "stop":
        raise ProtocolError(f"finish_reason {body.get('finish_reason')!r}, not 'stop'")
    version = body.get("weight_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ProtocolError("weight_version must be an integer")
    samples = request["samples"]
    batch = len(samples)
    media = _decode_media(body, batch, bool(request["sampling_params"].get("save_frames")))
    try:
        final = decode_tensor(body.get("final_latent"), "final_latent", dtype="float32")
        if final.ndim < 2 or final.shape[0] != batch:
            raise ProtocolError(f"final_latent has shape {list(final.shape)}, not [{batch}, *latent]")
        latent = list(final.shape[1:])
        cfg = SampleConfig.from_record(request["sampling_params"])
        steps = len(stored_steps(cfg, samples[0]["group"]))
        stored = LATENT_DTYPES[cfg.latent_dtype]  # the server's latents, sent upcast, are exact in it
        columns: dict[str, Any] = {"final_latent": final.to(stored)}
        trajectory = body.get("trajectory")
        if steps == 0:
            if trajectory is not None:
                raise ProtocolError("trajectory must be null: the request stores no steps")
        else:
            if not isinstance(trajectory, dict):
                raise ProtocolError(f"trajectory must hold {steps} stored steps")
            shapes = {
                "latents": [batch, steps + 1, *latent],
                "log_probs": [batch, steps],
                "timesteps": [batch, steps],
                "sigmas": [batch, steps + 1],
            }
            for key in TRAJECTORY:
                shape = shapes[key]
                columns[key] = decode_tensor(
                    trajectory.get(key), f"trajectory.{key}", shape=shape, dtype="float32"
                )
            columns["latents"] = columns["latents"].to(stored)
    except CodecError as exc:
        raise ProtocolError(str(exc)) from None
    columns.update(media)
    return version, columns


def check_weights(expected: dict[str, Any], held: dict[str, Any]) -> str | None:
    """Why the weights a request expects are not the `held` ones, or None when they are.

    A request naming a model digest names the adapter too (null: the base model), unless it leaves the
    key out (any adapter: a run that pushes its own); a null model digest accepts any weights, a null
    version any version.
    """
    keys = []
    if expected.get("model_sha256") is not None:
        keys = ["model_sha256", *(["adapter_sha256"] if "adapter_sha256" in expected else [])]
    if expected.get("version") is not None:
        keys.append("version")
    for key in keys:
        if expected.get(key) != held.get(key):
            return f"{key} {expected.get(key)!r} was asked, the server holds {held.get(key)!r}"
    return None


def refuse_settings(cfg: SampleConfig) -> None:
    """`cfg.validate()` with its refusal as a `ProtocolError` (the client's settings, one line)."""
    try:
        cfg.validate()
    except UserInputError as exc:
        raise ProtocolError(f"sampling_params: {exc}") from None
    if cfg.steps > 1000 or max(cfg.resolution) > 8192 or cfg.frames > 4096:
        raise ProtocolError(
            "sampling_params: steps must be at most 1000, resolution at most 8192 a side and frames at most 4096"
        )
