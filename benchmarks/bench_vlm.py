"""VLM stage overheads: omnirl's sample, logprob and update ÷ plain transformers + torch doing the same work.

Model: the tiny Qwen2.5-VL (`init_model("qwen2_5_vl", size="tiny", seed=0)`, random weights) built
in a temp dir; prompts: `recipes/tasks/visual_count.py` (P prompts, one 56-px image each) read with
`read_vlm_prompts`; n responses per prompt, `--max-new-tokens`, `--batch-size` rows per generate
call (so batch_size // n prompts per call), fp32, a fixed number of torch threads. The sides share
one loaded model per stage and run the same batches:

1. sample. omnirl: a `ShardSetWriter`, `run_vlm_sample` (processor, each prompt's inputs repeated n
   times, `generate` with logits, sampled-token log-probs, stop mask, decoding, one fsync'd Parquet
   shard) and `finalize`. bare: per call, the chat template, `processor(...)`, `model.generate(...,
   num_return_sequences=n, output_logits=True)`, a log-softmax gather of the sampled tokens and
   `batch_decode`. Both seed each call alike, so they draw the same tokens (checked: `same_tokens`).
2. logprob. omnirl: `replay_token_shard` on the shard that `sample` wrote, read back. bare: per
   sampling batch, the processor on the batch's rows, one no-grad forward over prompt + response
   (cut to the batch's longest response) and a log-softmax gather (checked: `logprob_max_abs_diff`).
3. update (LoRA r = `--lora-rank` on the language model, and full: everything but the vision
   tower). omnirl: a fresh `Trainer`'s `step` with `--algo grpo` (one epoch, micro-batch = the sampling batch,
   shuffled). bare: the same shuffled micro-batches, each the processor on its rows, a forward, a
   log-softmax gather, `token_losses.grpo_loss`, backward and an AdamW step (no clipping). Both
   create their AdamW per call, as each `omnirl update` does.

Each ratio is best omnirl time ÷ best bare time over `--repeats` calls of each, alternating (order
flipped every repeat) after one warm-up call of each on the first batch (targets: sample <= 1.10,
update <= 1.25). `pooled` is the load-robust ratio of `bench_sample.pooled_ratio` (the shared
region is the model's forward, plus backward for update). A breakdown of each best call times the
processor, the model forward (hooks; in `generate` every decoding step), backward, the log-prob
gather, the entropy, the loss, grad clipping, the optimizer step and the shard write; "other" is the
rest (for `generate`: sampling, logits processors and cache bookkeeping). `÷ bare fwd` divides by the
bare time without its processor calls, for a bare loop that had its inputs built beforehand.

    python benchmarks/bench_vlm.py [--prompts 64] [-n 8] [--max-new-tokens 32] [--repeats 3] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.bench_sample import Probes, pooled_ratio
from benchmarks.common import parse_args, record

if TYPE_CHECKING:
    from stages.models.vlm import VLMPolicy
    from stages.sample.vlm_data import VLMPrompt
    from stages.sample.vlm_stage import VLMSampleConfig

ROOT = Path(__file__).resolve().parents[1]
REGIONS = (
    "processor",
    "forward",
    "backward",
    "log_probs",
    "entropy",
    "loss",
    "clip_grad",
    "optimizer",
    "shard_io",
)
SHARED = {"sample": ("forward",), "logprob": ("forward",), "update": ("forward", "backward")}


def gather_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """The bare sides' log π(tokens) [B, T] from aligned logits [B, T, V]."""
    return (
        torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    )


def bare_inputs(processor: Any, questions: list[str], images: list[bytes]) -> dict[str, torch.Tensor]:
    """Left-padded processor inputs, one user turn (the image, then the question) per row."""
    import io

    from PIL import Image

    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for q in questions
    ]
    pics = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return dict(processor(text=texts, images=pics, return_tensors="pt", padding=True, padding_side="left"))


def bare_forward_inputs(
    prompt: dict[str, torch.Tensor], tokens: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Prompt + response as one sequence; response tokens are text (mm_token_type_ids 0)."""
    return {
        "input_ids": torch.cat([prompt["input_ids"], tokens], dim=1),
        "attention_mask": torch.cat([prompt["attention_mask"], mask.long()], dim=1),
        "mm_token_type_ids": torch.cat([prompt["mm_token_type_ids"], torch.zeros_like(tokens)], dim=1),
        "pixel_values": prompt["pixel_values"],
        "image_grid_thw": prompt["image_grid_thw"],
    }


def cut_responses(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Response ids/mask [B, T] cut to the longest response of the batch."""
    length = max(1, int(mask.sum(-1).max()))
    return ids[:, :length], mask[:, :length].bool()


def bare_sample(
    policy: VLMPolicy, cfg: VLMSampleConfig, prompts: list[tuple[int, VLMPrompt]], n: int
) -> torch.Tensor:
    """processor + generate + sampled-token log-probs + decoding per call; the response ids [P·n, T]."""
    from stages.sample.vlm_stage import prompt_seed

    processor, model = policy.processor, policy.model
    per_call = cfg.prompts_per_call(n)
    responses = []
    for start in range(0, len(prompts), per_call):
        chunk = prompts[start : start + per_call]
        inputs = bare_inputs(processor, [p.question for _, p in chunk], [p.images[0] for _, p in chunk])
        torch.manual_seed(prompt_seed(cfg, chunk[0][0]))
        with torch.no_grad():
            out = model.generate(
                **inputs,
                do_sample=True,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens,
                num_return_sequences=n,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=processor.tokenizer.pad_token_id,
            )
        response = out.sequences[:, inputs["input_ids"].shape[1] :]
        gather_log_probs(torch.stack(out.logits, dim=1), response, cfg.temperature)
        processor.tokenizer.batch_decode(response, skip_special_tokens=True)
        responses.append(response)
    width = max(r.shape[1] for r in responses)
    pad = processor.tokenizer.pad_token_id
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=pad) for r in responses])


def bare_replay(
    policy: VLMPolicy, cfg: VLMSampleConfig, shard: dict[str, Any], images: list[bytes], n: int
) -> torch.Tensor:
    """One no-grad forward per sampling batch; float32 log-probs [N, T] (0 off the response mask)."""
    rows = cfg.prompts_per_call(n) * n
    width = shard["response_ids"].shape[1]
    parts = []
    for start in range(0, len(images), rows):
        stop = min(len(images), start + rows)
        prompt = bare_inputs(policy.processor, list(shard["prompt"][start:stop]), images[start:stop])
        tokens, mask = cut_responses(shard["response_ids"][start:stop], shard["response_mask"][start:stop])
        with torch.no_grad():
            logits = policy.model(**bare_forward_inputs(prompt, tokens, mask)).logits
            length, t = logits.shape[1], tokens.shape[1]
            logp = gather_log_probs(logits[:, length - t - 1 : length - 1], tokens, cfg.temperature)
        logp = torch.where(mask, logp, torch.zeros(()))
        parts.append(torch.nn.functional.pad(logp, (0, width - t)))
    return torch.cat(parts)


def micro_batches(num_rows: int, micro: int, seed: int) -> list[list[int]]:
    """The micro-batches of `train`'s first epoch: rows shuffled by random.Random(seed), then chunked."""
    order = list(range(num_rows))
    random.Random(seed).shuffle(order)
    return [order[i : i + micro] for i in range(0, num_rows, micro)]


def bare_update(
    policy: VLMPolicy,
    cfg: Any,
    temperature: float,
    data: dict[str, Any],
    images: list[bytes],
    chunks: list[list[int]],
) -> None:
    """Per micro-batch: processor, forward, gather, grpo_loss, backward, AdamW step (no clipping)."""
    from stages.update import token_losses

    params = policy.trainable_parameters(full=cfg.full)
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.adam_eps
    )
    low, high = cfg.clip_bounds()
    bound = cfg.advantage_clip()
    for idx in chunks:
        index = torch.tensor(idx)
        prompt = bare_inputs(policy.processor, [data["prompt"][i] for i in idx], [images[i] for i in idx])
        tokens, mask = cut_responses(data["response_ids"][index], data["response_mask"][index])
        logits = policy.model(**bare_forward_inputs(prompt, tokens, mask)).logits
        length, t = logits.shape[1], tokens.shape[1]
        logp = gather_log_probs(logits[:, length - t - 1 : length - 1], tokens, temperature)
        loss, _ = token_losses.grpo_loss(
            logp,
            data["old_log_probs"][index, :t],
            data["advantages"][index, 0]
            if bound is None
            else data["advantages"][index, 0].clamp(-bound, bound),
            mask,
            clip_low=low,
            clip_high=high,
            dual_clip_c=cfg.dual_clip_c(),
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def build_inputs(scratch: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The tiny Qwen2.5-VL folder and the visual-counting prompt file, both under `scratch`."""
    from stages.models.factory import init_model

    model = scratch / "qwen2_5_vl-tiny"
    init_model("qwen2_5_vl", model, size="tiny", seed=0)
    prompts = scratch / "prompts.parquet"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "tasks" / "visual_count.py"),
            *("--out", str(prompts), "--num-prompts", str(args.prompts), "--seed", "0"),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return model, prompts


def measure(
    stage: str,
    sides: dict[str, Callable[[bool], Any]],
    probes: Probes,
    repeats: int,
    profile: bool,
) -> dict[str, list[dict[str, float]]]:
    """Warm each side up on a small call (`fn(True)`), then time `repeats` full calls of each, alternating."""
    for fn in sides.values():
        fn(True)
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    for r in range(repeats):
        for side in list(sides) if r % 2 == 0 else list(reversed(sides)):
            probes.seconds.clear()
            t0 = time.perf_counter()
            sides[side](False)
            total = time.perf_counter() - t0
            regions = {k: probes.seconds.get(k, 0.0) for k in REGIONS}
            runs[side].append({"total": total, **regions, "other": total - sum(regions.values())})
            print(stage, side, {k: round(v, 3) for k, v in runs[side][-1].items() if v}, flush=True)
    if profile:
        prof = cProfile.Profile()
        prof.runcall(sides["omnirl"], False)
        print(f"== cProfile of omnirl {stage}", flush=True)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64, help="P prompts (visual counting, one image each)")
    ap.add_argument("-n", "--group-size", type=int, default=8, help="responses per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16, help="rows per generate call and per micro-batch")
    ap.add_argument("--lora-rank", type=int, default=32, help="LoRA rank r (alpha = 2r, the default 32/64)")
    ap.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both sides")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--profile", action="store_true", help="also print a cProfile of one omnirl call per stage"
    )
    ap.add_argument("--tmp", default=None, help="scratch directory (default: system temp)")
    args = parse_args(
        ap,
        smoke={
            "prompts": 2,
            "group_size": 2,
            "max_new_tokens": 4,
            "batch_size": 2,
            "lora_rank": 2,
            "repeats": 1,
        },
    )
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as transformers_logging

    from stages.advantage.stage import compute_advantages
    from stages.logprob.replay import replay_token_shard
    from stages.models import vlm
    from stages.models.vlm import VLMPolicy
    from stages.sample.vlm_data import IMAGE, read_vlm_prompts
    from stages.sample.vlm_stage import KINDS, VLMSampleConfig, row_media, run_vlm_sample
    from stages.shards.reader import ShardSet, slice_batch
    from stages.shards.writer import ShardSetWriter
    from stages.update import token_losses, token_objective
    from stages.update.config import UpdateConfig
    from stages.update.trainer import Trainer

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    n = args.group_size
    cfg = VLMSampleConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=0)
    cfg.validate()
    first = cfg.prompts_per_call(n)  # the warm-up calls' prompts: one generate call's worth
    metrics: dict[str, Any] = {
        "prompts": args.prompts,
        "group_size": n,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "prompts_per_call": first,
        "lora_rank": args.lora_rank,
        "threads": args.threads,
        "repeats": args.repeats,
        "load_average_before": os.getloadavg()[0],
    }
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    this = sys.modules[__name__]
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="omnirl-bench-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        model_dir, prompt_file = build_inputs(tmp, args)
        prompts = list(enumerate(read_vlm_prompts(prompt_file)))
        policy = VLMPolicy.load(model_dir)
        metrics["parameters"] = sum(p.numel() for p in policy.model.parameters())
        probes = Probes()
        processor_cls = type(policy.processor)
        stack.enter_context(probes.patch(processor_cls, "__call__", "processor"))
        for owner, attr, name in (
            (vlm, "token_log_probs", "log_probs"),
            (this, "gather_log_probs", "log_probs"),
            (vlm, "token_entropy", "entropy"),
            (token_objective, "grpo_loss", "loss"),
            (token_losses, "grpo_loss", "loss"),
            (torch.Tensor, "backward", "backward"),
            (torch.nn.utils, "clip_grad_norm_", "clip_grad"),
            (torch.optim.AdamW, "step", "optimizer"),
            (ShardSetWriter, "write_shard", "shard_io"),
            (ShardSetWriter, "finalize", "shard_io"),
        ):
            stack.enter_context(probes.patch(owner, attr, name))

        # 1. sample
        samples = tmp / "samples"

        def omnirl_sample(warm: bool) -> None:
            shutil.rmtree(samples, ignore_errors=True)
            writer = ShardSetWriter(samples, num_shards=1, command="sample", config=cfg.record(), kinds=KINDS)
            run_vlm_sample(
                policy, cfg, prompts[:first] if warm else prompts, n, writer, num_shards=1, shard_indices=[0]
            )
            writer.finalize(extra={"vlm_sample_config": cfg.record()})

        bare_ids: list[torch.Tensor] = []

        def bare_sample_call(warm: bool) -> None:
            bare_ids[:] = [bare_sample(policy, cfg, prompts[:first] if warm else prompts, n)]

        with probes.module(policy.model, "forward"):
            results["sample"] = measure(
                "sample",
                {"omnirl": omnirl_sample, "bare": bare_sample_call},
                probes,
                args.repeats,
                args.profile,
            )
            shard = ShardSet(samples).read_shard(0)
            stored = shard["response_ids"][:, : bare_ids[0].shape[1]]
            metrics["same_tokens"] = bool(torch.equal(stored, bare_ids[0]))
            metrics["generated_tokens"] = int(shard["response_length"].sum())

            # 2. logprob
            images = [row[IMAGE.column][0] for row in row_media(shard, "samples")]
            rows = first * n
            replayed: dict[str, torch.Tensor] = {}

            def omnirl_replay(warm: bool) -> None:
                part = slice_batch(shard, 0, rows) if warm else shard
                replayed["omnirl"] = replay_token_shard(policy, cfg, part)[0]["old_log_probs"]

            def bare_replay_call(warm: bool) -> None:
                part = slice_batch(shard, 0, rows) if warm else shard
                replayed["bare"] = bare_replay(policy, cfg, part, images[: rows if warm else None], n)

            results["logprob"] = measure(
                "logprob",
                {"omnirl": omnirl_replay, "bare": bare_replay_call},
                probes,
                args.repeats,
                args.profile,
            )
            metrics["logprob_max_abs_diff"] = float((replayed["omnirl"] - replayed["bare"]).abs().max())
            metrics["logprob_rollout_max_abs_diff"] = float(
                (replayed["omnirl"] - shard["log_probs"]).abs().max()
            )

        # 3. update
        rewards = torch.rand(len(images), generator=torch.Generator().manual_seed(0))
        advantages = compute_advantages(
            {"sample_id": shard["sample_id"], "group_id": shard["group_id"], "reward": rewards},
            estimator="grpo_verl",
        )[0]["advantages"]
        data = {**shard, "old_log_probs": replayed["omnirl"], "advantages": advantages}
        warm_data = slice_batch(data, 0, rows)
        for mode in args.modes:
            ucfg = UpdateConfig(
                algo="grpo", full=mode == "full", lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank
            )
            trained = VLMPolicy.load(model_dir)
            if mode == "lora":
                trained.add_lora(rank=ucfg.lora_rank, alpha=ucfg.lora_alpha, seed=ucfg.seed)
            chunks = micro_batches(len(images), ucfg.micro_batch or cfg.batch_size, ucfg.seed)

            def omnirl_update(warm: bool, trained: VLMPolicy = trained, ucfg: UpdateConfig = ucfg) -> None:
                Trainer(trained, ucfg, {}).step(warm_data if warm else data, cfg)

            def bare_update_call(
                warm: bool,
                trained: VLMPolicy = trained,
                ucfg: UpdateConfig = ucfg,
                chunks: list[list[int]] = chunks,
            ) -> None:
                todo = [list(range(rows))] if warm else chunks
                bare_update(trained, ucfg, cfg.temperature, data, images, todo)

            with probes.module(trained.model, "forward"):
                results[f"update {mode}"] = measure(
                    f"update {mode}",
                    {"omnirl": omnirl_update, "bare": bare_update_call},
                    probes,
                    args.repeats,
                    args.profile,
                )
            metrics[f"update {mode} trained_parameters"] = sum(
                p.numel() for p in trained.model.parameters() if p.requires_grad
            )

    rows_out = []
    for stage, runs in results.items():
        best = {side: min(rs, key=lambda b: b["total"]) for side, rs in runs.items()}
        shared = SHARED[stage.split()[0]]
        ratio = best["omnirl"]["total"] / best["bare"]["total"]
        pooled = pooled_ratio(runs, "omnirl", "bare", shared)
        bare_fwd = min(b["total"] - b["processor"] for b in runs["bare"])
        metrics[stage] = {"ratio": ratio, "ratio_pooled": pooled, "best": best, "runs": runs}
        metrics[stage]["ratio_vs_bare_without_processor"] = best["omnirl"]["total"] / bare_fwd
        for side, b in best.items():
            rows_out.append(
                {
                    "stage": stage,
                    "side": side,
                    "seconds": b["total"],
                    "÷ bare": b["total"] / best["bare"]["total"],
                    "pooled ÷ bare": pooled if side == "omnirl" else 1.0,
                    "÷ bare fwd": b["total"] / bare_fwd,
                    **{k: b[k] for k in (*REGIONS, "other")},
                }
            )
    metrics["load_average_after"] = os.getloadavg()[0]
    targets = {"sample": 1.10, "update lora": 1.25, "update full": 1.25}
    for stage in results:
        m = metrics[stage]
        goal = f"; target <= {targets[stage]:.2f}" if stage in targets else ""
        print(
            f"{stage}: omnirl / bare = {m['ratio']:.3f} (pooled {m['ratio_pooled']:.3f}; "
            f"÷ bare without processor {m['ratio_vs_bare_without_processor']:.3f}{goal})",
            flush=True,
        )
    print(
        f"same tokens sampled: {metrics['same_tokens']}; replay |Δ| omnirl vs bare "
        f"{metrics['logprob_max_abs_diff']:.2e}, vs rollout {metrics['logprob_rollout_max_abs_diff']:.2e}",
        flush=True,
    )
    if not args.no_record:
        path = record(
            "vlm",
            metrics,
            rows_out,
            description=(
                f"omnirl's VLM stages ÷ plain transformers/torch doing the same work, tiny Qwen2.5-VL "
                f"({metrics['parameters']} parameters, random weights), {args.prompts} visual-counting prompts "
                f"× {n} responses, {args.max_new_tokens} new tokens, {args.batch_size} rows per generate call "
                f"and per micro-batch, {args.threads} threads: sample (writer + run_vlm_sample + finalize ÷ "
                "processor + generate + log-probs + decode), logprob (replay_token_shard ÷ processor + "
                "forward + gather), update (train, grpo, LoRA r"
                f"{args.lora_rank} and full ÷ processor + forward + grpo_loss + backward + AdamW); best of "
                f"{args.repeats} alternating calls (load average {metrics['load_average_before']:.1f} on "
                f"{os.cpu_count()} CPUs). Targets: sample <= 1.10, update <= 1.25. `÷ bare fwd` divides by the "
                "bare time without its processor calls. Region columns: seconds of the best call; other = the rest."
            ),
        )
        print("recorded", path)


if __name__ == "__main__":
    main()
