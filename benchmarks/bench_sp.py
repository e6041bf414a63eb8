"""Sequence parallelism on gloo CPU ranks: the training step (forward + backward through the LoRA) of a
FLUX transformer at a long sequence with Ulysses `--sp-degree 2` on 2 ranks ÷ one process, for the record.

The ratio that matters is the accelerator one (NVLink all-to-alls against long attention); on a CPU the
all-to-alls go through gloo and the 2 ranks share the machine's cores, one torch thread each, against one
process with one thread. Model: the tiny FLUX build with a LoRA (rank 16); one sample at `--side` pixels
(`(side / (2·f))²` image tokens for the VAE's downscale f and FLUX's 2 × 2 patches, + 128 text tokens:
4224 at 512 px with the tiny build's 4× VAE). Time: the fastest of `--repeats` steps after a warm-up,
rank 0's clock (the ranks wait for each other in every attention layer).

    python benchmarks/bench_sp.py [--side 512] [--repeats 3] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import best_of, parse_args, record


def _step_time(model: str, side: int, sp: int, repeats: int) -> float:
    """Seconds of one forward + backward on this process's policy (spread over the launch when sp > 1)."""
    import torch

    from stages.dist import device
    from stages.models.diffusion import FlowPolicy
    from stages.parallelism import ModelParallel, parallelize

    policy = FlowPolicy.load(model, device=device())
    policy.add_lora(rank=16, alpha=16, seed=0)
    params = policy.trainable_parameters()
    parallelize(policy.parts, ModelParallel(sp_degree=sp))
    x = policy.initial_noise([0], str(side))
    sigma = policy.sigmas(4, str(side))[1]
    cond = policy.encode(["a long benchmark prompt"], None, False)

    def step() -> None:
        loss = policy.velocity(x, sigma, cond, 3.5).square().mean()
        torch.autograd.grad(loss, params)

    step()  # warm-up
    return best_of(step, repeats)


def measure(model: Path, side: int, sp: int, repeats: int, out: Path) -> float:
    """Seconds of one training step of `model` at `side` pixels with sp ranks (sp 1: one process): this
    script run as a worker (under torchrun for sp > 1), rank 0's time read back from `out`. On the
    machine's accelerators when it has them (one per rank), else on gloo CPU ranks (the GPU suite,
    tests/gpu/test_gpu_parallelism.py, calls it there)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    worker = [__file__, "--worker", str(model), str(side), str(sp), str(repeats), str(out)]
    launch = [sys.executable]
    if sp > 1:
        launch = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(sp)]
    subprocess.run([*launch, *worker], check=True, env=env, stdout=subprocess.DEVNULL)
    return float(json.loads(out.read_text())["step_s"])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        model, side, sp, repeats, out = sys.argv[2:7]
        seconds = _step_time(model, int(side), int(sp), int(repeats))
        from stages.dist import world_and_rank

        if world_and_rank()[1] == 0:
            Path(out).write_text(json.dumps({"step_s": seconds}))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", type=int, default=512, help="image side in pixels (a multiple of 32)")
    ap.add_argument("--repeats", type=int, default=3)
    args = parse_args(ap, smoke={"side": 64, "repeats": 1})
    from stages.models.factory import init_model

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        init_model("flux", model, size="tiny", seed=0)
        times = {sp: measure(model, args.side, sp, args.repeats, Path(tmp) / f"sp{sp}.json") for sp in (1, 2)}
        vae = json.loads((model / "vae" / "config.json").read_text())
    downscale = 2 ** (len(vae["block_out_channels"]) - 1)
    tokens = (args.side // downscale // 2) ** 2 + 128
    rows = [
        {"run": "1 process", "tokens": tokens, "step_s": times[1], "ratio": 1.0},
        {
            "run": "sp 2 (Ulysses), 2 gloo ranks",
            "tokens": tokens,
            "step_s": times[2],
            "ratio": times[2] / times[1],
        },
    ]
    for row in rows:
        print(row)
    if not args.no_record:
        metrics = {"sp2_over_sp1_step_time": times[2] / times[1], "tokens": tokens}
        record("sp", metrics, rows, description=(__doc__ or "").split("\n\n")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
