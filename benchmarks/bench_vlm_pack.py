"""VLM packed sequences and token-balanced micro-batches: what they save.

Model: the tiny Qwen3-VL (`init_model("qwen3_vl", size="tiny", seed=0)`, random weights, LoRA r 8
on the language model) built in a temp dir, or `--model` (a Qwen2.5-VL or Qwen3-VL folder). Rows: a
seeded mix of the input modes a multimodal rollout has (text only, one image of 56 to 112 px, two
images, a video of 4 to 8 frames), each with a response of 8 to `--max-new-tokens` random tokens, so
prompt and response lengths vary as they do in a VLM rollout.

1. Packing. The same micro-batches (`--micro-batch` rows) run padded (`--packing off`: B × longest
   prompt + longest response) and packed (`--packing on`: the real tokens only), as `logprob` runs
   them (no-grad forward) and as `update` does (forward, GRPO token loss, backward). Tokens per second
   counts the real tokens both ways, over the process's CPU seconds (one thread by default: on a
   shared machine the work done, not the time spent waiting); `packed ÷ padded` is the speed-up, best
   of `--repeats` alternating calls. `padding share` is the share of the padded forward's positions that are padding; the
   attention pairs (query-key scores) of the packed row ÷ the padded batch's show why the kernel
   decides: under a dense mask (sdpa, eager: the CPU here) packing scores N² pairs, more than the
   padded B·L²; a variable-length kernel (flash attention) scores Σ lᵢ², less.
2. Balancing. One optimizer step of `--step-rows` rows (prompt lengths of the mix above, responses
   long-tailed up to `--max-response` tokens: log-normal, median 256) over 2, 4 and 8 ranks (2
   micro-batches each): each rank's tokens as `update` deals them (`TokenPolicyGradient.epoch`), with
   --micro-batch rows each (shuffled) and with --balance-tokens. `slowest ÷ mean` is the largest
   rank's (micro-batch's) tokens over the mean (1 = even): how long every rank waits for the slowest
   at the step's gradient reduction.
3. Token budget. The same step under a cap of `--budget` tokens per micro-batch (verl's default
   ppo_max_token_len_per_gpu, 16384): with fixed row counts, --micro-batch set to the most rows whose
   micro-batches all fit (what a memory cap forces), against --micro-batch-tokens: micro-batches per
   rank (forwards and backwards), the largest one's tokens ÷ the cap (the memory peak) and the padded
   batches' padding share.

    python benchmarks/bench_vlm_pack.py [--rows 32] [--micro-batch 8] [--max-new-tokens 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import parse_args, record

RANKS = (2, 4, 8)
ACCUM = 2


def picture(rng: random.Random) -> Any:
    """A random RGB image of 56 to 112 px a side."""
    import numpy as np
    from PIL import Image

    size = rng.choice((56, 84, 112))
    return Image.fromarray(
        np.random.default_rng(rng.randrange(2**31)).integers(0, 256, (size, size, 3), dtype=np.uint8)
    )


def make_rows(count: int, max_new: int, seed: int) -> list[dict]:
    """`count` rows of a mixed-mode rollout: processor inputs of one prompt each and a response."""
    rng = random.Random(seed)
    rows = []
    for k in range(count):
        mode = ("text", "image", "images", "video")[k % 4]
        images = [picture(rng) for _ in range({"image": 1, "images": 2}.get(mode, 0))]
        video = [[picture(rng).resize((56, 56))] * rng.randint(4, 8)] if mode == "video" else []
        parts = [{"type": "image"} for _ in images] + [{"type": "video", "fps": 2.0} for _ in video]
        text = "Describe it. " * rng.randint(1, 12)
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
        length = rng.randint(8, max_new)
        rows.append({"messages": messages, "images": images, "videos": video, "length": length})
    return rows


def batch(policy: Any, rows: list[dict], seed: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Left-padded prompt inputs of `rows`, right-padded random responses [B, T] and their mask."""
    prompt = policy.chat_inputs(
        [r["messages"] for r in rows], [r["images"] for r in rows], videos=[r["videos"] for r in rows]
    )
    lengths = torch.tensor([r["length"] for r in rows])
    mask = torch.arange(int(lengths.max()))[None] < lengths[:, None]
    ids = torch.randint(10, 1000, mask.shape, generator=torch.Generator().manual_seed(seed))
    return prompt, ids.masked_fill(~mask, policy.pad_id), mask


def tokens_of(prompt: dict, mask: torch.Tensor) -> dict[str, int]:
    """One micro-batch's real tokens, padded positions, and the query-key pairs attention scores padded
    (B·L²), packed under a dense mask (N², sdpa / eager) and packed under a variable-length kernel
    (Σ lᵢ², flash attention)."""
    lengths = prompt["attention_mask"].sum(-1) + mask.sum(-1)
    width = prompt["attention_mask"].shape[1] + mask.shape[1]
    real = int(lengths.sum())
    return {
        "real": real,
        "padded": width * len(lengths),
        "pairs_padded": len(lengths) * width**2,
        "pairs_dense": real**2,
        "pairs_varlen": int((lengths**2).sum()),
    }


def timed(fn: Any) -> float:
    """CPU seconds of this process spent in `fn`: on a shared machine the work done, not the wait."""
    import time

    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def packing(
    policy: Any, micro: list[tuple[dict, torch.Tensor, torch.Tensor]], repeats: int
) -> dict[str, Any]:
    """Best seconds of each side for the logprob and update passes over every micro-batch."""
    from stages.update.token_losses import grpo_loss

    def replay() -> None:
        with torch.no_grad():
            for prompt, ids, mask in micro:
                policy.response_log_probs(prompt, ids, mask)

    def train() -> None:
        for prompt, ids, mask in micro:
            logp = policy.response_log_probs(prompt, ids, mask)
            adv = torch.linspace(-1, 1, ids.shape[0])
            loss, _ = grpo_loss(logp, logp.detach(), adv, mask)
            loss.backward()

    best: dict[str, float] = {}
    for r in range(repeats + 1):  # the first round warms up
        for mode in ("off", "on") if r % 2 else ("on", "off"):
            policy.use_packing(mode)
            for stage, fn in (("logprob", replay), ("update", train)):
                seconds = timed(fn)
                if r:
                    best[f"{stage}_{mode}"] = min(best.get(f"{stage}_{mode}", float("inf")), seconds)
    return best


def long_tailed_step(prompts: list[int], step_rows: int, max_response: int, rng: random.Random) -> dict:
    """The prompt and response masks of one optimizer step of `step_rows` rows: a prompt length drawn
    from `prompts` plus a long-tailed response length (log-normal, median 256 tokens, at most
    `max_response`), as a reasoning rollout's responses are."""
    import math

    responses = [
        min(max_response, max(1, round(math.exp(rng.gauss(math.log(256), 0.9))))) for _ in range(step_rows)
    ]
    picked = [rng.choice(prompts) for _ in range(step_rows)]
    return {
        "prompt_mask": torch.arange(max(picked))[None] < torch.tensor(picked)[:, None],
        "response_mask": torch.arange(max_response)[None] < torch.tensor(responses)[:, None],
    }


def _padded(data: dict, chunk: list[int]) -> int:
    """Positions of a padded micro-batch: rows × (longest prompt + longest response)."""
    return len(chunk) * (
        int(data["prompt_mask"][chunk].sum(-1).max()) + int(data["response_mask"][chunk].sum(-1).max())
    )


def budget(
    prompts: list[int], step_rows: int, max_response: int, cap: int, seed: int
) -> list[dict[str, Any]]:
    """The step of `balance` (grad_accum ACCUM of --micro-batch rows per rank, over each number of
    ranks) under a memory cap of `cap` tokens per micro-batch: with fixed row counts, the most rows per
    micro-batch that keep every one of this step under the cap (how --micro-batch must be set), and with
    --micro-batch-tokens `cap` (the objective's own `epoch`). Per way: micro-batches per rank (the
    forwards and backwards each rank runs), the largest one's tokens ÷ cap and the padded batches'
    padding share."""
    from unittest.mock import patch

    from stages.update.token_objective import TokenPolicyGradient
    from stages.update.trainer import UpdateConfig

    rng = random.Random(seed)
    data = long_tailed_step(prompts, step_rows, max_response, rng)
    tokens = (data["prompt_mask"].sum(-1) + data["response_mask"].sum(-1)).tolist()
    out = []
    for ranks in RANKS:
        per_rank = step_rows // ranks
        order = list(range(step_rows))
        rng.shuffle(order)
        micro = max(
            (
                k
                for k in range(1, per_rank + 1)
                if all(sum(tokens[i] for i in order[j : j + k]) <= cap for j in range(0, step_rows, k))
            ),
            default=1,
        )
        row: dict[str, Any] = {"ranks": ranks, "rows per rank": per_rank, "fixed micro-batch": micro}
        for name, limit in (("fixed", None), ("budget", cap)):
            objective = TokenPolicyGradient.__new__(TokenPolicyGradient)  # `epoch` reads data and cfg
            objective.data, objective.counts = data, {}
            accum = -(-step_rows // (micro * ranks)) if limit is None else ACCUM
            size = micro if limit is None else per_rank // ACCUM
            objective.cfg = UpdateConfig(algo="grpo", grad_accum=accum, micro_batch_tokens=limit)
            with patch("stages.dist.data_parallel", return_value=(ranks, 0)):  # the plan every rank makes
                chunks = objective.epoch(order, size, rng)
            row[f"per rank {name}"] = max(len(mine) for mine in objective.plan[0])
            row[f"peak {name}"] = max(sum(tokens[i] for i in c) for c in chunks) / cap
            row[f"padding {name}"] = 1 - sum(tokens) / sum(_padded(data, c) for c in chunks)
        out.append(row)
    return out


def balance(prompts: list[int], step_rows: int, max_response: int, seed: int) -> list[dict[str, Any]]:
    """The slowest rank's and the slowest micro-batch's tokens ÷ the mean for one step of `step_rows`
    rows dealt without and with --balance-tokens over each number of ranks (the objective's own
    `epoch`); the step's rows are `long_tailed_step`'s."""
    from unittest.mock import patch

    from stages.update.balance import imbalance
    from stages.update.token_objective import TokenPolicyGradient
    from stages.update.trainer import UpdateConfig

    rng = random.Random(seed)
    data = long_tailed_step(prompts, step_rows, max_response, rng)
    tokens = (data["prompt_mask"].sum(-1) + data["response_mask"].sum(-1)).tolist()
    rows_out = []
    for ranks in RANKS:
        micro = step_rows // (ranks * ACCUM)
        out: dict[str, Any] = {"ranks": ranks, "micro-batch": micro}
        order = list(range(step_rows))
        rng.shuffle(order)
        for on in (False, True):
            objective = TokenPolicyGradient.__new__(TokenPolicyGradient)  # `epoch` reads data and cfg
            objective.data, objective.counts = data, {}
            objective.cfg = UpdateConfig(algo="grpo", grad_accum=ACCUM, balance_tokens=on)
            with patch("stages.dist.data_parallel", return_value=(ranks, 0)):  # the plan every rank makes
                chunks = objective.epoch(order, micro, rng)
            shares = [[i for c in chunks[r * ACCUM : (r + 1) * ACCUM] for i in c] for r in range(ranks)]
            side = "balanced" if on else "rows"
            out[f"rank {side}"] = imbalance(tokens, shares)
            out[f"micro-batch {side}"] = imbalance(tokens, chunks)
        rows_out.append(out)
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a Qwen2.5-VL or Qwen3-VL folder (default: the tiny Qwen3-VL)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--step-rows", type=int, default=640)
    ap.add_argument("--max-response", type=int, default=2048, help="longest response of the balancing step")
    ap.add_argument(
        "--budget", type=int, default=16384, help="tokens per micro-batch (verl's ppo_max_token_len_per_gpu)"
    )
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = parse_args(
        ap,
        {
            "rows": 4,
            "micro_batch": 2,
            "max_new_tokens": 12,
            "repeats": 1,
            "step_rows": 32,
            "max_response": 64,
            "budget": 512,
        },
    )
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    from stages.models.factory import init_model
    from stages.models.vlm import VLMPolicy

    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if model is None:
            model = Path(scratch) / "qwen3_vl-tiny"
            init_model("qwen3_vl", model, size="tiny", seed=0)
        policy = VLMPolicy.load(model)
        policy.add_lora(rank=8, seed=0)
        policy.trainable_parameters()
        rows = make_rows(args.rows, args.max_new_tokens, args.seed)
        micro = [
            batch(policy, rows[i : i + args.micro_batch], args.seed + i)
            for i in range(0, len(rows), args.micro_batch)
        ]
        counts = {k: sum(tokens_of(p, m)[k] for p, _, m in micro) for k in tokens_of(*micro[0][::2])}
        real, padded = counts["real"], counts["padded"]
        best = packing(policy, micro, args.repeats)
        prompts = [int(n) for p, _, _ in micro for n in p["attention_mask"].sum(-1)]
        per_row = [
            int(p["attention_mask"][k].sum() + m[k].sum()) for p, _, m in micro for k in range(m.shape[0])
        ]
    table = [
        {
            "stage": stage,
            "padded tokens/s": real / best[f"{stage}_off"],
            "packed tokens/s": real / best[f"{stage}_on"],
            "packed ÷ padded": best[f"{stage}_off"] / best[f"{stage}_on"],
            "padding share": 1 - real / padded,
            "attention pairs ÷ padded, dense": counts["pairs_dense"] / counts["pairs_padded"],
            "attention pairs ÷ padded, varlen": counts["pairs_varlen"] / counts["pairs_padded"],
        }
        for stage in ("logprob", "update")
    ]
    balanced = balance(prompts, args.step_rows, args.max_response, args.seed)
    for row in balanced:
        table.append(
            {
                "stage": f"step over {row['ranks']} ranks × {ACCUM} micro-batches of {row['micro-batch']}",
                "slowest rank ÷ mean, by rows": row["rank rows"],
                "slowest rank ÷ mean, balanced": row["rank balanced"],
                "slowest micro-batch ÷ mean, by rows": row["micro-batch rows"],
                "slowest micro-batch ÷ mean, balanced": row["micro-batch balanced"],
            }
        )
    budgeted = budget(prompts, args.step_rows, args.max_response, args.budget, args.seed)
    for row in budgeted:
        table.append(
            {
                "stage": f"step over {row['ranks']} ranks of {row['rows per rank']} rows, at most "
                f"{args.budget} tokens per micro-batch",
                "fixed rows: --micro-batch": row["fixed micro-batch"],
                "micro-batches per rank, fixed rows": row["per rank fixed"],
                "micro-batches per rank, --micro-batch-tokens": row["per rank budget"],
                "largest ÷ budget, fixed rows": row["peak fixed"],
                "largest ÷ budget, --micro-batch-tokens": row["peak budget"],
                "padding share, fixed rows": row["padding fixed"],
                "padding share, --micro-batch-tokens": row["padding budget"],
            }
        )
    for row in table:
        print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    metrics = {
        "rows": args.rows,
        "micro_batch": args.micro_batch,
        "max_new_tokens": args.max_new_tokens,
        "step_rows": args.step_rows,
        "budget": args.budget,
        "threads": args.threads,
        "repeats": args.repeats,
        "load_average_before": load,
        "token_counts": counts,
        "row_tokens_min_max": [min(per_row), max(per_row)],
        "best_seconds": best,
        "balance": balanced,
        "token_budget": budgeted,
    }
    if not args.no_record:
        path = record(
            "vlm_packing",
            metrics,
            table,
            description=(
                f"VLM packed sequences ÷ padded, tiny Qwen3-VL with LoRA r8, {args.rows} mixed-mode rows "
                f"(text, images, video; {min(per_row)}-{max(per_row)} tokens) in micro-batches of {args.micro_batch}, "
                f"tokens per second of the logprob forward and the update forward + backward (best of "
                f"{args.repeats} alternating calls, CPU seconds of {args.threads} thread(s), load average {load:.1f}); and the slowest rank's tokens ÷ the mean for one "
                f"step of {args.step_rows} rows (responses log-normal, median 256, at most {args.max_response} "
                f"tokens) over 2/4/8 ranks × {ACCUM} micro-batches, dealt by rows and with --balance-tokens; "
                f"and at most {args.budget} tokens per micro-batch, by fixed row counts (the most rows that "
                "fit) and with --micro-batch-tokens: micro-batches per rank, the largest ÷ the budget, the "
                "padding share."
            ),
        )
        print(f"recorded {path}")


if __name__ == "__main__":
    main()
