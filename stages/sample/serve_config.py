"""`serve`'s settings as one typed config; torch-free.

`ServeConfig` is the single declaration of every `omnirl serve` option (help, bounds, panel), from
which the CLI generates its options (`omnirl_cli.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages import knobs
from stages.knobs import SERVER, knob


@dataclass
class ServeConfig:
    """Every setting of the diffusion rollout server (`omnirl serve`)."""

    model: str | None = knobs.model("Diffusers pipeline to serve")
    adapter: str | None = knob(
        None,
        f"Adapter to start with: {knobs.ADAPTER_FROM}. POST /omnirl/v1/weights loads another one later.",
        metavar=knobs.WEIGHTS_METAVAR,
    )
    dtype: str = knobs.dtype(trains=False)
    served_model_name: str | None = knob(None, "The model id of /v1/models (default: the folder name).")
    host: str = knobs.host()
    port: int = knobs.port(18091)
    token_env: str | None = knobs.token_env()
    max_request_mb: int = knobs.max_request_mb(16)
    max_batch: int = knobs.max_batch(64)
    max_weights_mb: int = knob(
        1024,
        "Largest LoRA file a client may push to POST /omnirl/v1/weights, in MiB (413 above).",
        low=1,
        panel=SERVER,
    )
    max_named_weights: int = knob(
        16,
        "Named weights (trainers sharing the server, each up to 2 LoRA versions) held at once; a push of one "
        "more name is 409 until DELETE /omnirl/v1/weights?name=NAME forgets one, or one's lease runs out "
        "(--named-weights-ttl).",
        low=1,
        panel=SERVER,
    )
    named_weights_ttl: int = knob(
        600,
        "Seconds named weights are held without a push, a rollout naming them or a POST "
        "/omnirl/v1/weights/lease (the heartbeat of `omnirl online --engine remote`); then they are "
        "forgotten, so a killed trainer's name frees its place.",
        low=1,
        panel=SERVER,
    )
    max_request_cost: int = knob(
        10_000,
        "Most work one request may ask for, in megapixel-steps: samples × frames × height × width × "
        "denoising steps / 10^6 (413 above, naming both; e.g. 8 samples of 1024x1024 at 40 steps: 335).",
        low=1,
        panel=SERVER,
    )
    weights_root: Path | None = knob(
        None,
        "Folder under which POST /omnirl/v1/weights may load adapter folders by path (symlinks resolved "
        "first; any other path is 403, alike whether it exists). Without it only a server with --token-env "
        "loads folders by path, any folder; pushed LoRA files need neither.",
        panel=SERVER,
    )
    max_connections: int = knobs.max_connections()
    workers: int = knobs.workers()
    request_timeout: float = knobs.request_timeout()
    # under a launcher of exactly this many ranks (one group; `stages.sample.lockstep`)
    sp_degree: int = knobs.sp_degree("server")
    sp_kind: str = knobs.sp_kind()
    tp_degree: int = knobs.tp_degree()
    attention_backend: str | None = knobs.attention_backend()
    compile: bool = knobs.compile()
