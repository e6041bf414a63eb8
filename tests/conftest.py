"""Shared fixtures: tiny offline models and small shard sets, built once per test session."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # as the CLI sets it (quiet_libraries)

from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, SMALL_ONLINE_PRESET, ins, run, sample_args

# Tiny models run several times faster single-threaded on a shared 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _process_attention_backend() -> Iterator[None]:
    """After each test, diffusers' process-wide attention backend as at its import (the environment's,
    native here): `set_attention_backend` (`--attention-backend`, `stages.models.kernels.prepare`) also
    makes its backend every later transformer's in the process, which would move a later test's
    exact-replay numbers in this worker by ~4e-7."""
    yield
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    if dispatch is not None:
        registry = dispatch._AttentionBackendRegistry
        registry.set_active_backend(dispatch.AttentionBackendName(dispatch.DIFFUSERS_ATTN_BACKEND))


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF offline mode, and any attempt to open a network connection fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(self: socket.socket, address: object) -> None:
        raise AssertionError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD3 pipeline folder (seed 0), loadable with `from_pretrained`."""
    from stages.models.factory import init_model

    out = tmp_path_factory.mktemp("models") / "sd3-tiny"
    init_model("sd3", out, size="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def flux_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny FLUX (seed 0), the shared prompts and `SMALL_ONLINE_PRESET`: what the tests of online and
    serve over gloo ranks run (FLUX has diffusers' sequence- and tensor-parallel plans)."""
    from stages.models.factory import init_model

    root = tmp_path_factory.mktemp("tiny-flux")
    init_model("flux", root / "model", size="tiny", seed=0)
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    (root / "preset.yaml").write_text(SMALL_ONLINE_PRESET)
    return {"model": root / "model", "prompts": root / "prompts.txt", "preset": root / "preset.yaml"}


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2.5-VL folder (seed 0) with its processor, loadable with `from_pretrained`."""
    from stages.models.factory import init_model

    out = tmp_path_factory.mktemp("models") / "qwen2_5_vl-tiny"
    init_model("qwen2_5_vl", out, size="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-VL folder (seed 0) with its processor, loadable with `from_pretrained`."""
    from stages.models.factory import init_model

    out = tmp_path_factory.mktemp("models") / "qwen3_vl-tiny"
    init_model("qwen3_vl", out, size="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-VL MoE folder (seed 0) with its processor, loadable with `from_pretrained`."""
    from stages.models.factory import init_model

    out = tmp_path_factory.mktemp("models") / "qwen3_vl_moe-tiny"
    init_model("qwen3_vl_moe", out, size="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-Omni thinker folder (seed 0) with its processor, loadable with `from_pretrained`."""
    from stages.models.factory import init_model

    out = tmp_path_factory.mktemp("models") / "qwen3_omni_thinker-tiny"
    init_model("qwen3_omni_thinker", out, size="tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_shard_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-row, 2-shard Parquet shard set with a tensor, a scalar, strings and JSON."""
    from stages.shards.writer import ShardSetWriter

    out = tmp_path_factory.mktemp("shards") / "set"
    writer = ShardSetWriter(out, num_shards=2, command="test", config={"k": 1}, kinds={"meta": "json"})
    for s in range(2):
        ids = [f"g{s}-{i}" for i in range(3)]
        writer.write_shard(
            s,
            {
                "sample_id": ids,
                "group_id": [f"g{s}"] * 3,
                "reward": torch.arange(3, dtype=torch.float32) + s,
                "latents": torch.ones(3, 2, 4, 4) * s,
                "meta": [{"i": i} for i in range(3)],
            },
        )
    writer.finalize()
    return out


@pytest.fixture(scope="session")
def staged(tiny_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One full iteration: sample → score → logprob → advantage → update, plus a second update."""
    root = tmp_path_factory.mktemp("staged")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    p = {name: root / name for name in ("samples", "rewards", "logprobs", "advantages", "policy1", "policy2")}
    run(*sample_args(tiny_sd3, prompts, p["samples"], "--num-shards", "2"))
    run("score", "--in", str(p["samples"]), "--reward", "jpeg_compressibility", "--out", str(p["rewards"]))
    run("logprob", "--model", str(tiny_sd3), "--in", str(p["samples"]), "--out", str(p["logprobs"]))
    run("advantage", *ins(p["samples"], p["rewards"]), "--out", str(p["advantages"]))
    inputs = [*ins(p["samples"], p["logprobs"]), "--in", str(p["advantages"])]
    run(
        "update",
        "--model",
        str(tiny_sd3),
        *inputs,
        "--lr",
        "1e-3",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--out",
        str(p["policy1"]),
    )
    run(
        "update",
        "--model",
        str(tiny_sd3),
        "--adapter",
        str(p["policy1"]),
        *inputs,
        "--lr",
        "1e-3",
        "--out",
        str(p["policy2"]),
    )
    p["prompts"] = prompts
    p["model"] = tiny_sd3
    return p
