"""Remote rollout: `omnirl serve` on loopback ÷ in-process, for sampling and for online training, and a
LoRA swap ÷ the full pipeline reload it replaced.

- sampling: `sample_shard` (the `sample` stage's batches: SDE steps with log-probs, stored latents,
  PNGs) of B prompts on the `small` SD3 (`--size`) in this process (`--engine diffusers`) and through an `omnirl
  serve` subprocess of the same model on 127.0.0.1 (`--engine remote`: JSON request, float32 tensors
  as base64, PNGs, the client's checks); every process runs `--threads` torch threads. The two sides'
  samples are checked equal first; then they run interleaved, best of `--repeats`. Target <= 1.10.
- online: `omnirl online` (bench_online's preset and settings, at most --steps and --batch) with the
  sampler in-process and with `--engine remote` against a server of the same model (the driver pushes
  every update's LoRA),
  staleness 0, alternating launches, best of `--online-repeats`: wall per iteration, with start-up and
  steady (iterations 1..N−1). The version gaps are recorded (all 0 at staleness 0).
- weights: what `POST /omnirl/v1/weights` costs now, `FlowPolicy.set_lora` of a LoRA onto the pipeline
  it holds (same config: copied in place), against what it did before, `FlowPolicy.load(model,
  adapter=...)` of a second pipeline beside the first; seconds (best of `--repeats`) and the growth of
  resident memory while the new weights are held; also a push through HTTP end to end
  (`RemoteEngine.push_weights`: the LoRA file's bytes, its SHA-256 checked, swapped in place).
- concurrency: `omnirl serve-reward --reward jpeg_compressibility` (a cheap reward, so the HTTP layer
  is what is measured) on 127.0.0.1, hit by 1, 4, 16 and 32 client threads at once, each posting
  `--concurrency-requests` one-image requests on a fresh connection per request (as the remote reward
  client does): requests/s (best of `--concurrency-repeats` sweeps, alternately in reverse order), ÷
  the 1-client and ÷ the 4-client figure, connection errors (no reply: refused, reset, timed out) and
  503s over all sweeps. Target: at 16 and 32 clients, no connection error and
  requests/s ≥ the 4-client figure. `--concurrency-only` runs just this (recorded as
  `remote_concurrency`, without the SD3 model).

    python benchmarks/bench_remote.py [--batch 8] [--steps 8] [--resolution 64] [--repeats 3]
        [--iterations 3] [--online-repeats 1] [--clients 1,4,16,32] [--concurrency-requests 40]
        [--concurrency-repeats 3] [--concurrency-only]
"""

from __future__ import annotations

import argparse
import base64
import gc
import http.client
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import bench_online
from benchmarks.bench_sample import add_size_option, small_model
from benchmarks.common import parse_args, record

TARGET = 1.10


def rss() -> int:
    """Resident memory of this process, in bytes."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Server:
    """`omnirl COMMAND ARGS --port 0 --json` (serve or serve-reward) in a subprocess, stopped by its PID."""

    def __init__(self, omnirl: str, args: list[str], env: dict[str, str]):
        cmd = [omnirl, *args, "--port", "0", "--json"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            sys.exit(f"omnirl {args[0]} did not start: {self.proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
        self.url = json.loads(line)["url"]

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)
        self.proc.communicate(timeout=60)


def sampling(args: argparse.Namespace, model: Path, url: str) -> dict[str, Any]:
    """In-process ÷ remote `sample_shard` of the same rows (module docstring)."""
    from stages.sample.engines import EngineOptions, open_engine
    from stages.sample.prompts import Prompt
    from stages.sample.rollout import SampleConfig
    from stages.sample.stage import plan_rows, sample_shard

    cfg = SampleConfig(
        steps=args.steps,
        guidance=1.0,
        resolution=args.resolution,
        sampler="sde",
        noise_level=0.7,
        batch_size=args.batch,
        max_sequence_length=32,
    )
    prompts = [(i, Prompt(text=f"a photo of object number {i}")) for i in range(args.batch // 2)]
    rows = plan_rows(prompts, 2, cfg)
    local = open_engine("diffusers", EngineOptions(model=model), torch.device("cpu"))
    remote = open_engine("remote", EngineOptions(model=model, server_url=url), torch.device("cpu"))
    a, b = sample_shard(local, cfg, rows, 0), sample_shard(remote, cfg, rows, 0)
    for key in ("latents", "log_probs", "final_latent"):
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)  # the same samples, then time them
    assert a["image"] == b["image"]
    times = {"in_process": float("inf"), "remote": float("inf")}
    for r in range(args.repeats):
        for name, engine in (("in_process", local), ("remote", remote))[:: 1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            sample_shard(engine, cfg, rows, 0)
            times[name] = min(times[name], time.perf_counter() - t0)
    latent_bytes = a["latents"].numel() * 4 + a["final_latent"].numel() * 4
    return {
        "samples": len(rows),
        "in_process_s": times["in_process"],
        "remote_s": times["remote"],
        "ratio_remote_vs_in_process": times["remote"] / times["in_process"],
        "trajectory_bytes": latent_bytes,
    }


def weights(args: argparse.Namespace, model: Path, url: str, scratch: Path) -> dict[str, Any]:
    """A LoRA swapped in place ÷ the second pipeline loaded beside (module docstring)."""
    from stages.models.diffusion import FlowPolicy
    from stages.models.lora_weights import read_lora_file
    from stages.sample.engines import EngineOptions, open_engine

    policy = FlowPolicy.load(model)
    policy.add_lora(rank=args.lora_rank, alpha=2 * args.lora_rank)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.01)
    folder = scratch / "adapter"
    policy.save_adapter(folder, kind="lora", extra={"step": 1})
    raw = policy.lora_file()
    layers, config = read_lora_file(raw, policy.family.trained_module)
    pipeline_bytes = sum(
        p.numel() * p.element_size()
        for m in policy.pipe.components.values()
        if isinstance(m, torch.nn.Module)
        for p in m.parameters()
    )
    swap_s, reload_s, swap_rss, reload_rss = float("inf"), float("inf"), 0, 0
    for _ in range(args.repeats):
        gc.collect()
        before = rss()
        t0 = time.perf_counter()
        how = policy.set_lora(layers, config)
        swap_s = min(swap_s, time.perf_counter() - t0)
        swap_rss = max(swap_rss, rss() - before)
        assert how == "copied", how
        gc.collect()
        before = rss()
        t0 = time.perf_counter()
        beside = FlowPolicy.load(model, adapter=folder)
        reload_s = min(reload_s, time.perf_counter() - t0)
        reload_rss = max(reload_rss, rss() - before)
        del beside
    pusher = open_engine(
        "remote", EngineOptions(model=model, server_url=url, pushed_weights=True), torch.device("cpu")
    )
    pusher.push_weights(raw, 1)  # the first push adds the LoRA layers ("replaced")
    push_s = float("inf")
    for version in range(2, 2 + args.repeats):
        t0 = time.perf_counter()
        reply = pusher.push_weights(raw, version)
        push_s = min(push_s, time.perf_counter() - t0)
        assert reply["load"]["how"] == "copied", reply["load"]
    return {
        "lora_file_bytes": len(raw),
        "pipeline_parameter_bytes": pipeline_bytes,
        "swap_s": swap_s,
        "reload_s": reload_s,
        "ratio_swap_vs_reload": swap_s / reload_s,
        "swap_rss_growth_bytes": swap_rss,
        "reload_rss_growth_bytes": reload_rss,
        "push_http_s": push_s,
    }


def online(args: argparse.Namespace, model: Path, url: str, scratch: Path, env: dict[str, str]) -> dict:
    """`omnirl online` in-process ÷ --engine remote (module docstring)."""
    omnirl = str(Path(sys.executable).with_name("omnirl"))
    # bench_online's preset (4 steps, 64 px, 2 prompts × 4 in one batch of 8), no larger than --steps, --batch
    group, batch = min(4, args.batch), min(8, args.batch)
    ns = argparse.Namespace(
        steps=min(4, args.steps),
        resolution=64,
        group=group,
        num_prompts=batch // group,
        batch=batch,
        lora_rank=args.lora_rank,
    )
    files = {"model": model, "config": scratch / "preset.yaml", "prompts": scratch / "prompts.txt"}
    files["config"].write_text(bench_online.preset_yaml(ns))
    files["prompts"].write_text("\n".join(bench_online.PROMPTS) + "\n")
    remote = ("--engine", "remote", "--server-url", url)
    runs: dict[str, list[dict[str, Any]]] = {"in_process": [], "remote": []}
    n = args.iterations
    for r in range(args.online_repeats):
        for name in ("in_process", "remote")[:: 1 if r % 2 == 0 else -1]:
            extra = remote if name == "remote" else ()
            out = scratch / f"online-{name}"
            runs[name].append(bench_online.online(omnirl, files, out, n, 0, args.threads, env, extra))
            shutil.rmtree(out, ignore_errors=True)
            o = runs[name][-1]
            print(
                f"online {name}: {o['per_iteration']:.1f} s/iteration (steady {o['steady']:.1f})", flush=True
            )
    best = {name: bench_online.best(rs) for name, rs in runs.items()}
    return {
        "iterations": n,
        "in_process": best["in_process"],
        "remote": best["remote"],
        "ratio_remote_vs_in_process": best["remote"]["per_iteration"] / best["in_process"]["per_iteration"],
        "ratio_remote_vs_in_process_steady": best["remote"]["steady"] / best["in_process"]["steady"],
    }


def _post(url: str, body: bytes) -> str:
    """One reward request on a fresh connection: "ok", "503" or "error" (no reply)."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
        return "ok"
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except (urllib.error.URLError, http.client.HTTPException, OSError):
        return "error"


def _level(url: str, body: bytes, n: int, requests: int) -> dict[str, Any]:
    """`n` client threads, started together, each posting `body` to `url` `requests` times."""
    outcomes: list[str] = []
    slowest = 0.0
    lock = threading.Lock()
    barrier = threading.Barrier(n + 1)

    def client() -> None:
        nonlocal slowest
        barrier.wait()
        for _ in range(requests):
            t0 = time.perf_counter()
            outcome = _post(url, body)
            took = time.perf_counter() - t0
            with lock:
                outcomes.append(outcome)
                slowest = max(slowest, took)

    threads = [threading.Thread(target=client) for _ in range(n)]
    for thread in threads:
        thread.start()
    barrier.wait()
    t0 = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    return {
        "clients": n,
        "requests": len(outcomes),
        "ok": outcomes.count("ok"),
        "http_503": outcomes.count("503"),
        "connection_errors": outcomes.count("error"),
        "requests_per_s": outcomes.count("ok") / wall,
        "slowest_request_s": slowest,
    }


def concurrency(args: argparse.Namespace, omnirl: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """Requests/s of N concurrent clients of one `serve-reward` (module docstring), each N in
    `args.clients`: best of `args.concurrency_repeats` sweeps (every other one in reverse order), the
    errors and 503s of all of them."""
    from PIL import Image

    server = Server(omnirl, ["serve-reward", "--reward", "jpeg_compressibility"], env)
    png = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 40)).save(png, format="PNG")
    body = json.dumps({"images": [base64.b64encode(png.getvalue()).decode()], "prompts": ["red"]}).encode()
    url = f"{server.url}/jpeg_compressibility"
    best: dict[int, dict[str, Any]] = {}
    try:
        for _ in range(20):  # warm up: the first requests import and build what the reward uses
            assert _post(url, body) == "ok"
        for r in range(args.concurrency_repeats):
            for n in args.clients[:: 1 if r % 2 == 0 else -1]:
                level = _level(url, body, n, args.concurrency_requests)
                print(f"concurrency {n} clients: {level}", flush=True)
                kept = best.setdefault(n, level)
                for key in ("requests", "ok", "http_503", "connection_errors"):
                    if kept is not level:
                        kept[key] += level[key]
                kept["requests_per_s"] = max(kept["requests_per_s"], level["requests_per_s"])
                kept["slowest_request_s"] = max(kept["slowest_request_s"], level["slowest_request_s"])
    finally:
        server.stop()
    rows = [best[n] for n in args.clients]
    base = {row["clients"]: row["requests_per_s"] for row in rows}
    for row in rows:
        row["ratio_vs_1_client"] = row["requests_per_s"] / base[1] if base.get(1) else None
        row["ratio_vs_4_clients"] = row["requests_per_s"] / base[4] if base.get(4) else None
    return rows


def concurrency_rows(sweep: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table rows of a concurrency sweep."""
    return [
        {
            "measure": f"serve-reward, {row['clients']} concurrent clients: requests/s ÷ 4 clients",
            "s": row["slowest_request_s"],
            "baseline s": "",
            "ratio": row["ratio_vs_4_clients"],
            "notes": f"{row['requests_per_s']:.0f} requests/s (÷ 1 client {row['ratio_vs_1_client']:.2f}); "
            f"{row['connection_errors']} connection errors, {row['http_503']} 503s of {row['requests']}; "
            "s: slowest request; target at 16 and 32 ≥ 1, no error",
        }
        for row in sweep
    ]


def record_concurrency(args: argparse.Namespace, sweep: list[dict], load_before: float) -> None:
    """Record the serve-reward concurrency sweep (`remote_concurrency`)."""
    path = record(
        "remote_concurrency",
        {
            "clients": args.clients,
            "requests_per_client": args.concurrency_requests,
            "repeats": args.concurrency_repeats,
            "sweep": sweep,
        },
        concurrency_rows(sweep),
        description=(
            "`omnirl serve-reward --reward jpeg_compressibility` on 127.0.0.1, N client threads at once, "
            f"{args.concurrency_requests} one-image requests each on a fresh connection per request, best "
            f"of {args.concurrency_repeats} sweeps; ratio: requests/s ÷ the 4-client figure. Load average "
            f"{load_before:.1f} on {os.cpu_count()} CPUs."
        ),
    )
    print("recorded", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="SD3 pipeline folder (default: build `--size` in a temp dir)"
    )
    ap.add_argument("--batch", type=int, default=8, help="samples per request / forward (even)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=3, help="online iterations per launch")
    ap.add_argument("--online-repeats", type=int, default=1, help="launches of each online side (0: skip)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    ap.add_argument(
        "--clients",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 4, 16, 32],
        help="concurrent serve-reward clients to sweep, comma-separated",
    )
    ap.add_argument("--concurrency-requests", type=int, default=40, help="requests per client per level")
    ap.add_argument("--concurrency-repeats", type=int, default=3, help="sweeps; each level's best is kept")
    ap.add_argument("--concurrency-only", action="store_true", help="run only the serve-reward sweep")
    add_size_option(ap)
    args = parse_args(
        ap,
        smoke={
            "batch": 2,
            "steps": 2,
            "repeats": 1,
            "lora_rank": 2,
            "iterations": 1,
            "clients": [1, 4],
            "concurrency_requests": 5,
            "concurrency_repeats": 1,
            "size": "tiny",
        },
    )
    torch.set_num_threads(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    omnirl = str(Path(sys.executable).with_name("omnirl"))
    load_before = os.getloadavg()[0]
    sweep = concurrency(args, omnirl, env)
    for row in concurrency_rows(sweep):
        print(row)
    if not args.no_record:
        record_concurrency(args, sweep, load_before)
    if args.concurrency_only:
        return
    with tempfile.TemporaryDirectory(prefix="omnirl-bench-remote-") as tmp_name:
        scratch = Path(tmp_name)
        model = small_model(args.model, scratch, size=args.size).resolve()
        server = Server(omnirl, ["serve", "--model", str(model)], env)
        try:
            sample = sampling(args, model, server.url)
            print(f"sampling remote ÷ in-process = {sample['ratio_remote_vs_in_process']:.3f}", flush=True)
            swap = weights(args, model, server.url, scratch)
            print(f"LoRA swap ÷ full reload = {swap['ratio_swap_vs_reload']:.4f}", flush=True)
            on = online(args, model, server.url, scratch, env) if args.online_repeats else None
        finally:
            server.stop()
    metrics: dict[str, Any] = {
        "batch": args.batch,
        "steps": args.steps,
        "resolution": args.resolution,
        "threads": args.threads,
        "repeats": args.repeats,
        "sampling": sample,
        "weights": swap,
        "online": on,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
    }
    rows = [
        {
            "measure": f"sampling, {sample['samples']} samples, {args.steps} SDE steps, {args.resolution} px: "
            "remote ÷ in-process",
            "s": sample["remote_s"],
            "baseline s": sample["in_process_s"],
            "ratio": sample["ratio_remote_vs_in_process"],
            "notes": f"target ≤ {TARGET}; {sample['trajectory_bytes'] / 2**20:.1f} MiB of float32 latents",
        },
        {
            "measure": f"LoRA r{args.lora_rank} swapped in place ÷ a second pipeline loaded beside",
            "s": swap["swap_s"],
            "baseline s": swap["reload_s"],
            "ratio": swap["ratio_swap_vs_reload"],
            "notes": f"RSS growth {swap['swap_rss_growth_bytes'] / 2**20:.1f} vs "
            f"{swap['reload_rss_growth_bytes'] / 2**20:.1f} MiB (pipeline parameters "
            f"{swap['pipeline_parameter_bytes'] / 2**20:.1f} MiB, LoRA file {swap['lora_file_bytes'] / 2**10:.0f} "
            f"KiB); pushed over HTTP end to end {swap['push_http_s']:.3f} s",
        },
    ]
    if on:
        rows.append(
            {
                "measure": f"online, {on['iterations']} iterations, staleness 0, s/iteration: remote ÷ in-process",
                "s": on["remote"]["per_iteration"],
                "baseline s": on["in_process"]["per_iteration"],
                "ratio": on["ratio_remote_vs_in_process"],
                "notes": f"steady {on['ratio_remote_vs_in_process_steady']:.3f}; version gaps "
                f"{on['remote']['version_gaps']}",
            }
        )
    for row in rows:
        print(row)
    if args.no_record:
        return
    path = record(
        "remote",
        metrics,
        rows,
        description=(
            f"Remote rollout through `omnirl serve` on 127.0.0.1 ÷ in-process, `{args.size}` SD3, {args.threads} torch "
            f"thread(s) per process, best of {args.repeats} interleaved repeats (online: best of "
            f"{args.online_repeats} alternating launches, bench_online's preset); and a pushed LoRA swapped onto "
            f"the held pipeline ÷ the second pipeline the weights route used to load. Load average "
            f"{load_before:.1f} on {os.cpu_count()} CPUs."
        ),
    )
    print("recorded", path)


if __name__ == "__main__":
    main()
