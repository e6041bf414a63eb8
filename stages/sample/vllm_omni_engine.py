"""The ``vllm-omni`` rollout engine: vLLM-Omni samples, in one of two modes.

**Images mode** (``--server-url`` given): a client of an unmodified ``vllm serve MODEL --omni``. Each
sample is one ``POST /v1/images/generations`` (vLLM-Omni 0.30.0 field names: ``prompt``,
``negative_prompt``, ``model``, ``n`` = 1, ``size`` "RxR", ``num_inference_steps``, ``guidance_scale``
(Qwen-Image: ``true_cfg_scale``), ``seed``, ``response_format`` b64_json, ``output_format`` png, and
``lora`` {name, path} for an --adapter), sent ``--batch-size`` at a time; its seed is the sample's, so
a sample does not depend on the batching. A video family's sample is one ``POST /v1/videos/sync``
instead (a ``multipart/form-data`` form: ``prompt``, ``negative_prompt``, ``model``, ``size`` "RxR",
``num_frames``, ``fps``, ``num_inference_steps``, ``guidance_scale``, ``seed``, ``lora`` as JSON),
whose reply is the MP4 itself, checked for its frame count and size, stored as the ``video`` column.
The server returns media only: a sample has its PNG or MP4, no trajectory and no final latent. Such a rollout suits scoring and evaluation, and NFT/AWM/DPO through
``omnirl encode`` (the VAE re-encodes the PNG: an approximate ``final_latent``); the manifest records
``trajectory: absent``, so ``omnirl logprob`` refuses it (`engines.check_replayable`). Only ``--sampler ode``
describes it (the server's own scheduler, deterministic given the seed).

Transport (`stages.web.JsonClient`): ``GET /health`` polled until 200 within
``--server-startup-timeout``; connection errors, timeouts, 502, 503 and 504 retried with backoff and
jitter (a 500 once), a 4xx never (exit 2); both error shapes read (``{"error": {...}}``,
``{"detail": ...}``). A reply with no image is an aborted sample, drawn again with the same seed
(`rollout_protocol.redraw_aborted`); a reply that is not one PNG of the asked size is a one-line
`RuntimeFailure`. A batch that fails writes nothing: a group is never padded, and a re-run resumes.

**RL mode** (no ``--server-url``; needs the ``vllm-omni`` extra and a GPU): vLLM-Omni in this process
(``Omni``) with omnirl's custom pipeline (`stages.sample.vllm_omni_pipeline`), which runs the family
adapter and `samplers.step`; its outputs are converted to rollout protocol v1 (`outputs_to_reply`) and
checked like a remote reply, so ``omnirl logprob`` replays them.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.sample.engines import TRAJECTORY_ABSENT, EngineOptions, RolloutEngine, register_engine
from stages.sample.rollout_protocol import (
    PNG_SIGNATURE,
    Aborted,
    ProtocolError,
    redraw_aborted,
)
from stages.web import JsonClient, encode_form

IMAGES_ROUTE = "/v1/images/generations"
VIDEOS_ROUTE = "/v1/videos/sync"
VLLM_HINT = "start it with `vllm serve MODEL --omni --port P` and pass --server-url http://HOST:P"
MAX_CONCURRENCY = 32  # requests in flight at once (a batch's samples)
# families whose pipeline takes the CFG scale as true_cfg_scale (guidance_scale is distilled guidance)
TRUE_CFG_FAMILIES = frozenset({"qwen_image"})


def model_family(model: Path) -> tuple[Any, str]:
    """The family adapter class of a local pipeline folder (its ``media``) and the name of the family the
    folder is (`FamilyAdapter.variant_name`: a Wan folder's own variant, not its class's first name), from
    its model_index.json (no weights loaded)."""
    from stages.models.families import adapter_class
    from stages.models.folders import pipeline_index

    index = pipeline_index(model)
    family = adapter_class(index["_class_name"], str(model))
    return family, family.variant_name(index)


def images_size(resolution: tuple[int, int]) -> str:
    """The images API's ``size`` of a (height, width): "WxH", width first."""
    height, width = resolution
    return f"{width}x{height}"


def decode_png(item: Any, resolution: tuple[int, int], where: str) -> bytes:
    """The PNG bytes of one ``data[i]`` of an images reply, checked: a base64 PNG of `resolution`
    (height, width)."""
    from PIL import Image, UnidentifiedImageError

    try:
        blob = base64.b64decode(item["b64_json"], validate=True)
    except (binascii.Error, ValueError, TypeError, KeyError):
        raise ProtocolError(f"{where}.b64_json is not base64") from None
    if not blob.startswith(PNG_SIGNATURE):
        raise ProtocolError(f"{where} is not a PNG (ask output_format png)")
    try:
        with Image.open(io.BytesIO(blob)) as image:
            image.load()
            size = image.size
    except (UnidentifiedImageError, OSError, ValueError):
        raise ProtocolError(f"{where} is a PNG that does not decode") from None
    if f"{size[0]}x{size[1]}" != images_size(resolution):
        raise ProtocolError(f"{where} is {size[0]}x{size[1]} (WxH), not the {images_size(resolution)} asked")
    return blob


@register_engine("vllm-omni")
class VllmOmniEngine(RolloutEngine):
    """vLLM-Omni's images API over HTTP (images mode; module docstring); `open` without --server-url
    gives the in-process RL mode instead."""

    def __init__(
        self,
        client: JsonClient,
        family: str,
        served_model: str,
        lora: dict[str, Any] | None,
        media: str = "image",
    ):
        self.client = client
        self.family = family
        self.served_model = served_model
        self.lora = lora
        self.media = media  # "image": /v1/images/generations; "video": /v1/videos/sync

    @classmethod
    def open(cls, options: EngineOptions, device: Any) -> RolloutEngine:
        if not options.server_url:
            return VllmOmniRLEngine.open(options, device)
        family, name = model_family(Path(options.model))
        client = JsonClient(
            options.server_url,
            token=options.token(),
            timeout=options.request_timeout,
            retries=options.retries,
            what="a `vllm serve --omni`",
            noun="vLLM-Omni server",
            hint=VLLM_HINT,
        )
        client.wait_healthy(options.startup_timeout)
        served = cls._served_model(client, options.served_model)
        lora = None
        if options.adapter is not None:  # a path the server reads: the same file system, or a shared one
            adapter = Path(options.adapter).resolve()
            lora = {"name": adapter.name, "path": str(adapter), "scale": 1.0}
        return cls(client, name, served, lora, family.media)

    @classmethod
    def same_samples(cls, options: EngineOptions) -> bool:
        """Images mode samples with the server's own pipeline; RL mode with omnirl's."""
        return not options.server_url

    @staticmethod
    def _served_model(client: JsonClient, wanted: str | None) -> str:
        """The model name to send: --served-model when the server lists it, else the one it serves."""
        reply = client.call("/v1/models")
        data = reply.get("data") if isinstance(reply, dict) else None
        ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if not ids:
            raise UserInputError(
                f"{client.url}/v1/models lists no model; is it a `vllm serve --omni`? {VLLM_HINT}"
            )
        if wanted is not None:
            if wanted not in ids:
                raise UserInputError(
                    f"--served-model {wanted}: {client.url} serves {', '.join(map(str, ids))}"
                )
            return wanted
        if len(ids) > 1:
            raise UserInputError(
                f"{client.url} serves {', '.join(map(str, ids))}; pick one with --served-model"
            )
        return str(ids[0])

    def request_body(self, cfg: Any, prompt: str, negative: str, seed: int) -> dict[str, Any]:
        """The ``/v1/images/generations`` body of one sample."""
        guidance = "true_cfg_scale" if self.family in TRUE_CFG_FAMILIES else "guidance_scale"
        body: dict[str, Any] = {
            "model": self.served_model,
            "prompt": prompt,
            "n": 1,
            "size": images_size(cfg.resolution),
            "num_inference_steps": cfg.steps,
            guidance: cfg.guidance,
            "seed": int(seed),
            "response_format": "b64_json",
            "output_format": "png",
        }
        if negative:
            body["negative_prompt"] = negative
        if self.lora is not None:
            body["lora"] = self.lora
        return body

    def video_form(self, cfg: Any, prompt: str, negative: str, seed: int) -> dict[str, Any]:
        """The ``/v1/videos/sync`` form fields of one sample (its seed; ``fps`` an integer, as the
        server's form takes it)."""
        fields: dict[str, Any] = {
            "model": self.served_model,
            "prompt": prompt,
            "size": images_size(cfg.resolution),
            "num_frames": cfg.frames,
            "fps": int(cfg.fps),
            "num_inference_steps": cfg.steps,
            "guidance_scale": cfg.guidance,
            "seed": int(seed),
        }
        if cfg.guidance_2 is not None:
            fields["guidance_scale_2"] = cfg.guidance_2
        if negative:
            fields["negative_prompt"] = negative
        if self.lora is not None:
            fields["lora"] = json.dumps(self.lora)
        return fields

    def _draw_video(self, fields: dict[str, Any], cfg: Any) -> bytes:
        """One sample's MP4, checked: an MP4 of `cfg.frames` frames of cfg.resolution (`Aborted` when the
        reply is empty)."""
        from stages.media.video import MediaDecodeError, probe_mp4

        blob = self.client.call(VIDEOS_ROUTE, encode_form(fields), accept="video/mp4")
        if not blob:
            raise Aborted("no video in the reply")
        try:
            info = probe_mp4(blob)
        except MediaDecodeError as exc:
            raise ProtocolError(f"the reply is not an MP4 ({exc})") from None
        got = (info.frames, f"{info.width}x{info.height}")
        if got != (cfg.frames, images_size(cfg.resolution)):
            raise ProtocolError(
                f"the MP4 holds {got[0]} frames of {got[1]} (WxH), not the {cfg.frames} of "
                f"{images_size(cfg.resolution)} asked"
            )
        return blob

    def _draw(self, body: dict[str, Any], resolution: tuple[int, int]) -> bytes:
        """One sample's PNG; `Aborted` when the reply holds no image, `ProtocolError` when it is malformed
        (`redraw_aborted` turns either into a one-line failure naming the sample)."""
        reply = self.client.call(IMAGES_ROUTE, body)
        data = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(data, list):
            raise ProtocolError("the reply has no data list")
        if not data:
            raise Aborted("no image in the reply")
        if len(data) != 1:
            raise ProtocolError(f"{len(data)} images for n=1")
        return decode_png(data[0], resolution, "data[0]")

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
        if cfg.sampler != "ode":
            raise UserInputError(
                f"--sampler {cfg.sampler}: --engine vllm-omni with --server-url returns images only, sampled by "
                "the server's scheduler; pass --sampler ode (for scoring, or nft/awm/dpo after `omnirl encode`)"
            )
        if cfg.same_noise:
            raise UserInputError(
                "--same-noise: vLLM-Omni draws a sample's noise from its seed alone; drop --same-noise"
            )
        video = self.media == "video"
        if video and cfg.save_frames:
            raise UserInputError(
                "--save-frames: vLLM-Omni's /v1/videos/sync returns the MP4 only (no lossless frames); "
                "drop --save-frames, or sample with --engine remote"
            )
        if video and cfg.fps != int(cfg.fps):
            raise UserInputError(f"--fps {cfg.fps:g}: vLLM-Omni's videos API takes whole frames per second")
        if cfg.guidance_2 is not None and not video:
            raise UserInputError(
                "--guidance-2: --engine vllm-omni with --server-url asks the images API, which takes one "
                "guidance scale; drop --guidance-2 (or use RL mode)"
            )

        def one(i: int) -> bytes:
            what = f"sample {sample_ids[i]} (seed {seeds[i]})"
            if video:
                fields = self.video_form(cfg, prompts[i], negatives[i], seeds[i])
                return redraw_aborted(
                    lambda: self._draw_video(fields, cfg), f"{self.client.url}{VIDEOS_ROUTE} {what}"
                )
            body = self.request_body(cfg, prompts[i], negatives[i], seeds[i])
            return redraw_aborted(
                lambda: self._draw(body, cfg.resolution), f"{self.client.url}{IMAGES_ROUTE} {what}"
            )

        with ThreadPoolExecutor(max_workers=min(len(prompts), MAX_CONCURRENCY)) as pool:
            media = list(pool.map(one, range(len(prompts))))
        return {self.media: media}

    def latent_shape(self, resolution: Any, frames: int = 1) -> tuple[int, ...]:
        raise UserInputError(
            "--engine vllm-omni with --server-url returns images only (no latents); use RL mode or --engine remote"
        )

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "mode": "images",
            "server_url": self.client.url,
            "served_model": self.served_model,
            "trajectory": TRAJECTORY_ABSENT,
            "final_latent": "absent; `omnirl encode` re-encodes the PNGs with the VAE (approximate)",
        }


# ---------------------------------------------------------------- RL mode

PIPELINE_CLASS = "stages.sample.vllm_omni_pipeline:OmnirlRolloutPipeline"
MAX_PIPELINE_BATCH = 1024  # samples in one request to the custom pipeline
EXTRA_KEY = "omnirl"  # the key of the protocol v1 request in extra_args, and of omnirl's custom_output


def pipeline_fields(policy: Any, body: dict[str, Any], weight_version: int) -> dict[str, Any]:
    """What omnirl's custom pipeline returns for one protocol v1 request `body` (one batch of B samples),
    as the fields of vLLM-Omni's ``DiffusionOutput``: ``output`` (B PIL images; empty for a video
    family), ``trajectory_latents`` [B, K+1, *latent], ``trajectory_log_probs`` [B, K],
    ``trajectory_timesteps`` [B, K] (fp32; None for the ode sampler) and ``custom_output[EXTRA_KEY]``:
    request id, weight version, σ window [B, K+1], final latent [B, *latent] and the encoded media of
    protocol v1 (``media``: PNGs or MP4s, ``frames`` where saved), whatever the family's media column.
    Computed by `rollout_batch` (the family adapter, `samplers.step`)."""
    from PIL import Image

    from stages.sample.rollout import rollout_batch
    from stages.sample.rollout_protocol import decode_request, media_fields, refuse_settings

    request = decode_request(body, max_samples=MAX_PIPELINE_BATCH)
    refuse_settings(request.cfg)
    columns = rollout_batch(
        policy,
        request.cfg,
        request.prompts,
        request.negatives,
        request.seeds,
        request.init_seeds,
        groups=request.groups,
        sample_ids=request.sample_ids,
    )
    return {
        "output": [Image.open(io.BytesIO(png)) for png in columns.get("image", [])],
        "trajectory_latents": columns.get("latents"),
        "trajectory_log_probs": columns.get("log_probs"),
        "trajectory_timesteps": columns.get("timesteps"),
        "custom_output": {
            EXTRA_KEY: {
                "request_id": request.request_id,
                "weight_version": int(weight_version),
                "sigmas": columns.get("sigmas"),
                "final_latent": columns["final_latent"],
                **media_fields(columns),
            }
        },
        "error": None,
    }


def outputs_to_reply(outputs: Sequence[Any], request: dict[str, Any]) -> dict[str, Any]:
    """The protocol v1 reply to `request` (an `encode_request` body) of vLLM-Omni's ``generate`` outputs
    for it (one ``OmniRequestOutput``, duck-typed: ``images``, ``trajectory_*``, ``custom_output``,
    ``error``). The media are the record's encoded ones (PNGs or a video family's MP4s, with saved
    frames), else PNGs of ``images``. An output with an error that names an abort, or without media,
    is ``finish_reason`` "abort"; another error, or no omnirl record, is a `ProtocolError`. Check the
    result with `rollout_protocol.decode_response`."""
    from stages.sample.rollout_protocol import PROTOCOL, VERSION, media_item
    from stages.sample.tensor_codec import encode_tensor
    from stages.tables import png_bytes

    base = {"protocol": PROTOCOL, "version": VERSION, "request_id": request["request_id"]}
    if len(outputs) != 1:
        raise ProtocolError(f"{len(outputs)} outputs for one request")
    out = outputs[0]
    error = getattr(out, "error", None)
    images = list(getattr(out, "images", None) or [])
    record = (getattr(out, "custom_output", None) or {}).get(EXTRA_KEY)
    media = record.get("media") if isinstance(record, dict) else None
    if (error and "abort" in str(error).lower()) or (not error and not images and not media):
        return {**base, "weight_version": 0, "finish_reason": "abort"}
    if error:
        raise ProtocolError(f"vLLM-Omni reports {str(error)[:200]!r}")
    if not isinstance(record, dict) or record.get("request_id") != request["request_id"]:
        raise ProtocolError(
            "the output carries no omnirl record of this request: is the custom pipeline "
            f"{PIPELINE_CLASS} loaded?"
        )

    def tensor(value: Any) -> Any:
        return None if value is None else encode_tensor(value.float())

    latents = getattr(out, "trajectory_latents", None)
    trajectory = None
    if latents is not None:
        trajectory = {
            "latents": tensor(latents),
            "log_probs": tensor(getattr(out, "trajectory_log_probs", None)),
            "timesteps": tensor(getattr(out, "trajectory_timesteps", None)),
            "sigmas": tensor(record.get("sigmas")),
        }
    return {
        **base,
        "weight_version": record.get("weight_version"),
        "finish_reason": "stop",
        "media": media or [media_item(png_bytes(im)) for im in images],
        **({"frames": record["frames"]} if "frames" in record else {}),
        "final_latent": tensor(record.get("final_latent")),
        "trajectory": trajectory,
    }


class VllmOmniRLEngine(RolloutEngine):
    """RL mode: vLLM-Omni in this process with omnirl's custom pipeline (module docstring). A batch is one
    ``generate`` request whose ``extra_args`` carry the protocol v1 request; the pipeline samples it with
    `rollout_batch`, so the samples equal the diffusers engine's on the same device."""

    name = "vllm-omni"

    def __init__(self, omni: Any, params_class: Any, family: str):
        self.omni = omni
        self.params_class = params_class
        self.family = family
        # null digests: the pipeline holds the weights `open` gave it, no others to check against
        self.weights = {"model_sha256": None, "adapter_sha256": None, "version": None}

    @classmethod
    def open(cls, options: EngineOptions, device: Any) -> VllmOmniRLEngine:
        try:
            from vllm_omni import Omni
            from vllm_omni.inputs.data import OmniDiffusionSamplingParams
        except ImportError:
            raise UserInputError(
                "--engine vllm-omni without --server-url runs vLLM-Omni in this process (RL mode): install "
                "it (pip install 'omnirl[vllm-omni]'; GPU only), or pass --server-url of a "
                "`vllm serve --omni` (images only)"
            ) from None
        family = model_family(Path(options.model))[1]
        pipeline_args = {
            "pipeline_class": PIPELINE_CLASS,
            "adapter": None if options.adapter is None else str(Path(options.adapter).resolve()),
            "dtype": options.dtype,
        }
        omni = Omni(
            model=str(Path(options.model).resolve()),
            diffusion_load_format="custom_pipeline",
            custom_pipeline_args=pipeline_args,
        )
        return cls(omni, OmniDiffusionSamplingParams, family)

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
        from stages.sample.rollout_protocol import decode_response, encode_request

        ids = list(sample_ids)
        request_id = f"omnirl-{ids[0]}-{len(ids)}"
        body = encode_request(
            request_id, cfg, prompts, negatives, seeds, init_seeds, list(groups), ids, self.weights
        )
        params = self.params_class(
            height=cfg.resolution[0],
            width=cfg.resolution[1],
            num_inference_steps=cfg.steps,
            guidance_scale=cfg.guidance,
            seed=int(seeds[0]),
            num_outputs_per_prompt=len(ids),
            extra_args={EXTRA_KEY: body},
        )
        what = f"vLLM-Omni samples {ids[0]}..{ids[-1]}"

        def draw() -> tuple[int, dict[str, Any]]:
            outputs = list(self.omni.generate([prompts[0]], [params], use_tqdm=False))
            return decode_response(outputs_to_reply(outputs, body), body)

        _, columns = redraw_aborted(draw, what)
        return columns

    def latent_shape(self, resolution: Any, frames: int = 1) -> tuple[int, ...]:
        raise UserInputError(
            "--engine vllm-omni reports no latent shape outside a rollout; use --engine diffusers or remote"
        )

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "mode": "rl",
            "pipeline": PIPELINE_CLASS,
        }

    def close(self) -> None:
        close = getattr(self.omni, "close", None) or getattr(self.omni, "shutdown", None)
        if close is not None:
            close()
