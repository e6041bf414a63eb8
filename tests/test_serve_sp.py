"""`omnirl serve --sp-degree 2` (and `--tp-degree 2`) under torchrun (2 gloo CPU ranks, tiny FLUX) answers
as one process.

Rank 0 serves and every rank runs each batch and weight change with it (stages/sample/lockstep.py): its
samples equal a one-process server's to 1e-5 (the tolerance of tests/test_parallelism.py), before and
after a LoRA is pushed, also after a batch its client abandoned; stopping rank 0 (SIGTERM, by PID)
stops every rank; only rank 0's ready line reaches stdout.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fails, online_args, run
from test_serve import ENV, Server, _random_lora, _request

from stages.sample.engines import EngineOptions
from stages.sample.remote_engine import RemoteEngine
from stages.sample.rollout import SampleConfig
from stages.sample.rollout_protocol import encode_request
from stages.shards.reader import ShardSet

FLUX = ["--resolution", "32", "--guidance", "3.5"]  # as tests/test_parallelism.py samples the tiny FLUX
COLUMNS = ("latents", "log_probs", "final_latent")


class GroupServer:
    """`torchrun --nproc_per_node 2 -m omnirl_cli serve ARGS --sp-degree 2 --json` (or `degree`
    --tp-degree); `url` and rank 0's `pid` from its ready line."""

    def __init__(self, model: Path, *args: str, degree: str = "--sp-degree"):
        torchrun = str(Path(sys.executable).parent / "torchrun")
        cmd = [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "omnirl_cli", "serve"]
        cmd += ["--model", str(model), *args, degree, "2", "--port", "0", "--json"]
        env = {**ENV, "GLOO_SOCKET_IFNAME": "lo"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, self.proc.stderr.read()  # type: ignore[union-attr]
        self.ready = json.loads(line)
        self.url: str = self.ready["url"]
        self.pid: int = self.ready["pid"]  # rank 0, not torchrun

    def stop(self, pid: int | None = None) -> tuple[int, str, str, float]:
        """SIGTERM to `pid` (default rank 0); torchrun's exit status, the rest of stdout, stderr, and the
        seconds until every rank was gone."""
        t0 = time.monotonic()
        os.kill(pid or self.pid, signal.SIGTERM)
        out, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, out, err, time.monotonic() - t0


@pytest.fixture(scope="module")
def servers(flux_run: dict[str, Path]) -> Iterator[tuple[Server, GroupServer]]:
    one, group = Server(flux_run["model"]), GroupServer(flux_run["model"])
    yield one, group
    code, err = one.stop()
    assert code == 0, err
    if group.proc.poll() is None:
        group.stop()


def _remote_sample(flux_run: dict[str, Path], url: str, out: Path) -> dict[str, torch.Tensor]:
    args = ["sample", "--model", str(flux_run["model"]), "--prompts", str(flux_run["prompts"]), "-n", "2"]
    args += ["--steps", "3", "--batch-size", "3", *FLUX, "--engine", "remote", "--server-url", url]
    result = run(*args, "--out", str(out))
    assert result["rows"] == 6 and result["complete"]
    return ShardSet(out).read_all()


def _close(got: dict[str, Any], want: dict[str, Any]) -> None:
    for column in COLUMNS:
        torch.testing.assert_close(got[column], want[column], rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_an_sp_server_samples_as_one_process_before_and_after_a_push_and_an_abandoned_batch(
    servers: tuple[Server, GroupServer], flux_run: dict[str, Path], tmp_path: Path
) -> None:
    one, group = servers
    # the base model, through `omnirl sample --engine remote`
    base = _remote_sample(flux_run, one.url, tmp_path / "one")
    sp = _remote_sample(flux_run, group.url, tmp_path / "sp")
    assert sp["sample_id"] == base["sample_id"] and torch.equal(sp["seed"], base["seed"])
    _close(sp, base)

    # a LoRA pushed as `online --engine remote` pushes it (named weights), then a batch of it
    lora = _random_lora(flux_run["model"], 1, tmp_path / "lora")
    cfg = SampleConfig(steps=3, guidance=3.5, resolution=32, window=2, max_sequence_length=32)
    batch = (["a red ball", "two cats"], ["", ""], [5, 6], [7, 8])
    kw = {"groups": [0, 1], "sample_ids": ["s0", "s1"]}
    got = {}
    for name, srv in (("one", one), ("sp", group)):
        options = EngineOptions(
            model=flux_run["model"], server_url=srv.url, pushed_weights=True, weights_name="t"
        )
        trainer = RemoteEngine.open(options, "cpu")
        assert trainer.push_weights(lora, 1)["load"]["how"] == "stored"
        got[name] = trainer.rollout(cfg, *batch, **kw)
        assert got[name]["policy_version"].tolist() == [1, 1]
    _close(got["sp"], got["one"])
    plain = RemoteEngine.open(EngineOptions(model=flux_run["model"], server_url=group.url), "cpu")
    unpushed = plain.rollout(cfg, *batch, **kw)  # the unnamed weights again: the base model's samples
    assert (got["sp"]["final_latent"] - unpushed["final_latent"]).abs().max() > 1e-3  # the LoRA counts

    # a 1000-step batch whose client hangs up stops on every rank at the same step: the group still
    # answers, with the same samples
    parts = urllib.parse.urlsplit(group.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    long = SampleConfig(steps=1000, guidance=3.5, resolution=64, max_sequence_length=32)
    body = encode_request("long", long, ["a cat"] * 2, [""] * 2, [0, 1], [0, 1], [0, 0], ["l0", "l1"], {})
    conn.request(
        "POST", "/omnirl/v1/rollout", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    time.sleep(2.0)
    conn.close()
    t0 = time.monotonic()
    again = plain.rollout(cfg, *batch, **kw)
    assert time.monotonic() - t0 < 30  # not after the 1000 steps
    for column in COLUMNS:
        assert torch.equal(again[column], unpushed[column])
    assert _request(group.url, "GET", "/health")[0] == 200


@pytest.mark.distributed
def test_a_tp_server_samples_as_one_process(
    servers: tuple[Server, GroupServer], flux_run: dict[str, Path], tmp_path: Path
) -> None:
    """--tp-degree 2 over 2 gloo CPU ranks (the weights split, stages/parallelism.py): the samples of a
    one-process server to 1e-5."""
    one, _ = servers
    group = GroupServer(flux_run["model"], degree="--tp-degree")
    try:
        base = _remote_sample(flux_run, one.url, tmp_path / "one")
        tp = _remote_sample(flux_run, group.url, tmp_path / "tp")
        assert tp["sample_id"] == base["sample_id"]
        _close(tp, base)
    finally:
        code, _, err, _ = group.stop()
    assert code == 0, err[-3000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_online_samples_with_sp_through_an_sp_server(
    servers: tuple[Server, GroupServer], flux_run: dict[str, Path], tmp_path: Path
) -> None:
    """online's sp route: --engine remote against the group, as against a one-process server (2
    iterations, each update's LoRA pushed to the server): the same samples to 1e-5, no version gap."""
    runs = {}
    for name, srv in zip(("one", "sp"), servers, strict=True):
        args = online_args(flux_run["preset"], flux_run, tmp_path / name, "--reward", "jpeg_compressibility")
        extra = ["--iterations", "2", "--save-trajectories", "--engine", "remote", "--server-url", srv.url]
        runs[name] = run(*args, *extra)["iterations"]
    assert [it["version_gaps"] for it in runs["sp"]] == [[0], [0]]
    assert [it["policy_versions"] for it in runs["sp"]] == [[0], [runs["sp"][0]["step"]]]
    for k in (0, 1):
        one, sp = (ShardSet(tmp_path / name / f"it{k}" / "samples").read_all() for name in ("one", "sp"))
        assert sp["sample_id"] == one["sample_id"]
        _close(sp, one)


@pytest.mark.distributed
def test_stopping_rank_0_stops_every_rank_and_only_its_ready_line_is_on_stdout(
    flux_run: dict[str, Path],
) -> None:
    group = GroupServer(flux_run["model"])
    assert _request(group.url, "GET", "/health")[1]["status"] == "ok"
    code, out, err, seconds = group.stop()
    print(f"\nevery rank gone {seconds:.1f} s after SIGTERM to rank 0")
    assert code == 0 and out == "" and "Traceback" not in err, err[-3000:]
    assert seconds < 30


@pytest.mark.distributed
def test_the_launcher_stopped_stops_every_rank(flux_run: dict[str, Path]) -> None:
    """SIGTERM to torchrun, which forwards it to every rank: the followers wait for rank 0's word."""
    group = GroupServer(flux_run["model"])
    code, out, err, seconds = group.stop(group.proc.pid)
    print(f"\nevery rank gone {seconds:.1f} s after SIGTERM to torchrun (exit {code})")
    # torchrun reports the signal it got (exit 1, its own traceback); no rank failed or hung
    assert code != 0 and out == "" and seconds < 30
    assert "internal error" not in err and "stages/" not in err and "omnirl_cli/" not in err, err[-3000:]


def test_a_degree_the_launch_does_not_match_is_one_line(tiny_sd3: Path) -> None:
    serve = ["serve", "--model", str(tiny_sd3)]
    fails([*serve, "--sp-degree", "2"], "--sp-degree 2: omnirl serve", "exactly 2 ranks", "torchrun")
    fails([*serve, "--tp-degree", "2"], "--tp-degree 2: omnirl serve", "exactly 2 ranks", "torchrun")
