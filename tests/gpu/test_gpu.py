"""The GPU suite (`make test-gpu`): the small SD3 on the machine's accelerator (CUDA, NPU, ...) in bf16.

Skipped without an accelerator. `OMNIRL_GPU_SUITE_ON_CPU=1` runs the same checks on the CPU in fp32 (a
rehearsal of the suite's plumbing where no accelerator is lent). Throughput lines are printed for the
record (`make test-gpu` runs pytest with -s).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import ins, run, torchrun

from stages.shards.reader import ShardSet

ACCELERATOR = torch.accelerator.is_available()
ON = ACCELERATOR or os.environ.get("OMNIRL_GPU_SUITE_ON_CPU") == "1"
# A CPU rehearsal runs fp32 (CPUs without bf16 matmul units emulate it) at a size a CPU finishes in minutes.
DTYPE = "bf16" if ACCELERATOR else "fp32"
RESOLUTION, STEPS = ("256", "12") if ACCELERATOR else ("64", "4")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON, reason="no accelerator (set OMNIRL_GPU_SUITE_ON_CPU=1 to rehearse)"),
]

PROMPTS = ["a red circle", "two blue squares", "a sign that says omnirl", "a cat on a mat"]


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The small SD3, a rollout of 4 prompts × 4 (12 SDE steps at 256 px, CFG 4.5, bf16), rewards,
    replayed log-probs and advantages."""
    root = tmp_path_factory.mktemp("gpu")
    p = {k: root / k for k in ("model", "samples", "rewards", "logprobs", "advantages")}
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    run("init-model", "--family", "sd3", "--size", "small", "--seed", "0", str(p["model"]))
    t0 = time.perf_counter()
    result = run(
        "sample", "--model", str(p["model"]), "--prompts", str(root / "prompts.txt"), "-n", "4",
        "--steps", STEPS, "--resolution", RESOLUTION, "--guidance", "4.5", "--dtype", DTYPE, "--batch-size", "8",
        "--out", str(p["samples"]),
    )  # fmt: skip
    elapsed = time.perf_counter() - t0
    print(
        f"\n[gpu] sample: {result['rows'] / elapsed:.2f} images/s (small SD3, {DTYPE}, {RESOLUTION} px, {STEPS} steps, CFG)"
    )
    run("score", "--in", str(p["samples"]), "--reward", "jpeg_compressibility", "--out", str(p["rewards"]))
    run(
        "logprob",
        "--model",
        str(p["model"]),
        "--dtype",
        DTYPE,
        "--in",
        str(p["samples"]),
        "--out",
        str(p["logprobs"]),
    )
    run("advantage", *ins(p["samples"], p["rewards"]), "--out", str(p["advantages"]))
    return p


def test_replay_on_the_same_device_gives_ratio_one(rollout: dict[str, Path]) -> None:
    rolled = ShardSet(rollout["samples"]).read_all(columns=["log_probs"])["log_probs"]
    replayed = ShardSet(rollout["logprobs"]).read_all()["old_log_probs"]
    ratio = torch.exp(replayed.double() - rolled.double())
    assert torch.isfinite(ratio).all()
    assert float((ratio - 1).abs().max()) <= 1e-3, float((ratio - 1).abs().max())


@pytest.mark.parametrize("strategy", ["auto", "fsdp2"])
def test_bf16_update_trains_and_reports_throughput(
    rollout: dict[str, Path], tmp_path: Path, strategy: str
) -> None:
    args = [
        "update", "--model", str(rollout["model"]), *ins(rollout["samples"], rollout["logprobs"], rollout["advantages"]),
        "--dtype", DTYPE, "--mixed-precision", "bf16" if ACCELERATOR else "no", "--lr", "1e-4", "--micro-batch", "4",
        "--strategy", strategy, "--out", str(tmp_path / "policy"),
    ]  # fmt: skip
    result = torchrun(*args, ranks=1)[0] if strategy == "fsdp2" else run(*args)  # FSDP2 needs a launcher
    metrics = [json.loads(x) for x in (tmp_path / "policy" / "metrics.jsonl").read_text().splitlines()]
    assert result["optimizer_steps"] == len(metrics) >= 1
    assert all(torch.isfinite(torch.tensor(m["actor/grad_norm"])) for m in metrics)
    assert abs(metrics[0]["actor/ratio_mean"] - 1) <= 1e-3  # the first step replays the rollout's weights
    rate = sum(m["perf/sample_steps_per_s"] for m in metrics) / len(metrics)
    print(f"\n[gpu] update ({strategy}): {rate:.2f} sample-steps/s (small SD3, {DTYPE}, LoRA 32)")


def test_fsdp2_sharded_trainer_state_resumes_on_the_device(
    rollout: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FSDP_STATE_DICT_TYPE=SHARDED_STATE_DICT on the accelerator's process group: the trainer state is
    written by torch.distributed.checkpoint and read back by FSDP2 and by a plain process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def args(out: Path, *extra: str) -> list[str]:
        return [
            "update", "--model", str(rollout["model"]), *ins(rollout["samples"], rollout["logprobs"], rollout["advantages"]),
            "--dtype", DTYPE, "--mixed-precision", "bf16" if ACCELERATOR else "no", "--lr", "1e-4", "--micro-batch", "4",
            "--out", str(out), *extra,
        ]  # fmt: skip

    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
    first = torchrun(*args(tmp_path / "it1", "--strategy", "fsdp2"), ranks=1)[0]
    assert (tmp_path / "it1" / "trainer_state" / "sharded" / ".metadata").is_file()
    second = torchrun(
        *args(tmp_path / "it2", "--strategy", "fsdp2", "--adapter", str(tmp_path / "it1")), ranks=1
    )[0]
    monkeypatch.delenv("FSDP_STATE_DICT_TYPE")
    plain = run(*args(tmp_path / "plain", "--adapter", str(tmp_path / "it1")))
    steps = 2 * first["optimizer_steps"]
    assert second["step"] == plain["step"] == steps
    # AdamW's step counters went on from the shards (a fresh optimizer would count from 0)
    dcp_to_torch_save(tmp_path / "it2" / "trainer_state" / "sharded", tmp_path / "it2.pt")
    resumed = torch.load(tmp_path / "it2.pt", weights_only=True)["optimizer"]["state"]
    assert resumed and {float(s["step"]) for s in resumed.values()} == {float(steps)}
    whole = torch.load(tmp_path / "plain" / "trainer_state" / "optimizer.pt", weights_only=True)["state"]
    assert whole and {float(s["step"]) for s in whole.values()} == {float(steps)}
