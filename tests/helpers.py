"""Helpers shared by the CLI-level tests (imported as `helpers`; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from omnirl_cli.app import app

runner = CliRunner()
PROMPTS = ["a red apple", 'a sign that says "hello"', "a blue sky"]


def online_preset(**sample: object) -> str:
    """A small online run's preset for a tiny model: SDE steps at 32 px without CFG, groups of 2, GRPO
    advantages, flow_grpo on a rank-4 LoRA; `sample` changes or adds sample settings."""
    settings = {
        "steps": 3,
        "guidance": 1.0,
        "resolution": 32,
        "sampler": "sde",
        "noise_level": 0.7,
        "group_size": 2,
        "batch_size": 2,
        **sample,
    }
    update = {"algo": "flow_grpo", "lr": "1.0e-3", "clip_range": 0.2, "lora_rank": 4, "lora_alpha": 8}
    sections = {"sample": settings, "advantage": {"estimator": "grpo"}, "update": update}
    return "".join(
        f"{name}:\n" + "".join(f"  {k}: {v}\n" for k, v in values.items())
        for name, values in sections.items()
    )


SMALL_ONLINE_PRESET = online_preset()


def run(*args: str) -> dict:
    """Invoke `omnirl ARGS --json` in-process; assert success and return the JSON result."""
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def cli_process(*args: str) -> dict:
    """`omnirl ARGS --json` in a fresh process (one thread, as the tests): assert success and return the
    JSON result. For comparisons with what a spawned worker computed, which a long-lived test process's
    CPU kernels may round differently."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "omnirl_cli", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def fails(args: list[str], *names: str) -> str:
    """Invoke `omnirl ARGS` in-process; assert exit 2 with one stderr line (no traceback) naming every
    one of `names`, and return that line."""
    result = runner.invoke(app, args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(name in lines[0] for name in names), lines[0]
    return lines[0]


def ins(*paths: Path) -> list[str]:
    """`--in P` for every path, in order (the zipped inputs of a stage command)."""
    return [arg for p in paths for arg in ("--in", str(p))]


def staged_update_args(staged: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """`omnirl update` on the `staged` fixture's samples, logprobs and advantages with its small LoRA
    (rank 4, alpha 8) into `out`, plus `extra`."""
    return [
        "update",
        "--model",
        str(staged["model"]),
        *ins(staged["samples"], staged["logprobs"], staged["advantages"]),
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--out",
        str(out),
        *extra,
    ]


def online_args(preset: Path, staged: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """`omnirl online` with `preset` on the `staged` fixture's model and prompts into `out`, plus `extra`."""
    return [
        "online",
        "--config",
        str(preset),
        "--model",
        str(staged["model"]),
        "--prompts",
        str(staged["prompts"]),
        "--out",
        str(out),
        *extra,
    ]


def sample_args(model: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    """A small `omnirl sample` call: 3 prompts × 2, 4 SDE steps at 32 px, no CFG, batches of 3."""
    return [
        "sample",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "-n",
        "2",
        "--steps",
        "4",
        "--resolution",
        "32",
        "--guidance",
        "1",
        "--batch-size",
        "3",
        "--out",
        str(out),
        *extra,
    ]


def torchrun(
    *args: str,
    ranks: int = 2,
    stderr: list[str] | None = None,
    program: tuple[str, ...] = ("-m", "omnirl_cli"),
    env: dict[str, str] | None = None,
) -> list[dict]:
    """`torchrun --standalone --nproc_per_node RANKS -m omnirl_cli ARGS --json` on gloo (CPU); asserts success
    and returns the JSON objects the ranks printed on stdout, in order (their stderr appended to `stderr`).
    `program`: another script taking omnirl's arguments; `env`: variables added for the ranks."""
    return _launch([*program, *args, "--json"], ranks, stderr, env)


def torchrun_fails(*args: str, ranks: int = 2) -> str:
    """`torchrun` of `omnirl ARGS` that every rank refuses: asserts the launch failed with exit 2 (no
    rank raised) and each rank wrote the same one line; returns that line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(ranks)]
    result = subprocess.run(
        [*cmd, "-m", "omnirl_cli", *args], capture_output=True, text=True, env=env, timeout=600
    )
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr, result.stderr[-3000:]
    assert len(lines) == ranks and len(set(lines)) == 1, result.stderr[-3000:]
    return lines[0]


def torchrun_commands(
    *commands: list[str], ranks: int = 2, stderr: list[str] | None = None, env: dict[str, str] | None = None
) -> list[dict]:
    """`torchrun` (as `torchrun`) of several `omnirl` commands in turn in the same RANKS processes
    (tests/launch_commands.py): one import of torch and diffusers for a whole staged iteration. `env`:
    variables the launch adds (a launcher's settings, e.g. FSDP_STATE_DICT_TYPE)."""
    script = str(Path(__file__).parent / "launch_commands.py")
    return _launch([script, json.dumps([list(c) for c in commands])], ranks, stderr, env)


def _launch(
    target: list[str], ranks: int, stderr: list[str] | None, env: dict[str, str] | None = None
) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(ranks)]
    result = subprocess.run([*cmd, *target], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    if stderr is not None:
        stderr.append(result.stderr)
    decoder, text, objects = json.JSONDecoder(), result.stdout.strip(), []
    while text:
        obj, end = decoder.raw_decode(text)
        objects.append(obj)
        text = text[end:].lstrip()
    return objects
