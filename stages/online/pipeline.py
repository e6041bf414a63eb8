"""`omnirl online`: the staged stages fused into one run, without files between them.

Processes: the driver trains (it owns the optimizer); a sampler worker and a scorer worker run in
their own spawned processes, each loading its model once. Trajectories of an iteration travel
sampler → driver through a preallocated shared-memory ring (`ring.Ring`, two slots: bounded memory
and backpressure); images go to the scorer, rewards come back on small queues. After each update the
driver copies the trained weights into shared tensors and bumps a version; the sampler waits until
the version is at least k − max_staleness before sampling iteration k, so with staleness 1 sampling
k+1 overlaps training on k, and every sample records the version that drew it.

Every stage is the same library function the staged commands call (`sample_shard`, `score_shard`,
`compute_advantages`, `train`), with the recipe's seeds (iteration k samples and shuffles with seed k), so with
staleness 0 an online iteration reproduces the staged one.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from stages.errors import RuntimeFailure, UserInputError
from stages.sample.prompts import Prompt
from stages.sample.rollout import SampleConfig
from stages.update.trainer import UpdateConfig

TENSORS = ("latents", "log_probs", "sigmas", "timesteps", "final_latent", "seed", "policy_version")
POLL = 0.5


@dataclass
class OnlineConfig:
    """Everything one online run needs; `sample` and `update` are the staged commands' configs."""

    model: str
    prompts: list[Prompt]
    out: Path
    iterations: int
    sample: SampleConfig
    update: UpdateConfig
    group_size: int = 4
    num_prompts: int | None = None
    rewards: list[tuple[str, float]] = field(default_factory=list)
    estimator: str = "grpo"
    adv_clip: float | None = None
    drop_zero_std: bool = False
    max_staleness: int = 0
    save_trajectories: bool = False
    dtype: str = "fp32"
    threads: int = 1
    seed: int | None = None

    def sampling(self, k: int) -> SampleConfig:
        """Iteration k's sampling settings: seed k (or the fixed --seed) and window position k."""
        return replace(self.sample, seed=k if self.seed is None else self.seed, iteration=k)


def iteration_rows(cfg: OnlineConfig, k: int) -> list[Any]:
    """The rows iteration k samples: the staged `sample --seed k --iteration k` plan (seed: --seed if fixed)."""
    from stages.sample.prompts import pick_prompts
    from stages.sample.stage import plan_rows

    scfg = cfg.sampling(k)
    return plan_rows(pick_prompts(cfg.prompts, cfg.num_prompts, scfg.seed), cfg.group_size, scfg)


def _trainable(policy: Any, cfg: UpdateConfig) -> dict[str, torch.Tensor]:
    from stages.models.diffusion import SD3_LORA_TARGETS

    if not policy.lora and not cfg.full:
        policy.add_lora(rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=SD3_LORA_TARGETS, seed=cfg.seed)
    policy.trainable_parameters(full=cfg.full)
    return {n: p for n, p in policy.transformer.named_parameters() if p.requires_grad}


def _sampler_main(
    cfg: OnlineConfig,
    start: int,
    adapter: Path | None,
    weights: dict[str, torch.Tensor],
    version: Any,
    step: Any,
    lock: Any,
    ring: Any,
    to_scorer: Any,
) -> None:
    """Worker: sample iterations start..iterations−1, each with weights no staler than max_staleness.

    `version` counts published updates (iterations); `step` is their optimizer step, recorded per sample.
    """
    from stages.models.diffusion import FlowPolicy
    from stages.online.ring import RingClosed
    from stages.sample.stage import sample_shard

    torch.set_num_threads(cfg.threads)
    policy = FlowPolicy.load(cfg.model, adapter=adapter, dtype=cfg.dtype)
    params = _trainable(policy, cfg.update)
    for k in range(start, cfg.iterations):
        while version.value < k - cfg.max_staleness:
            time.sleep(0.01)
        with lock, torch.no_grad():
            for name, p in params.items():
                p.copy_(weights[name])
            drawn_with = step.value
        rows = iteration_rows(cfg, k)
        scfg = cfg.sampling(k)
        cols = sample_shard(policy, scfg, rows, 0, drawn_with)
        meta = {
            key: cols[key] for key in ("sample_id", "group_id", "prompt", "negative_prompt", "prompt_meta")
        }
        to_scorer.put(
            {
                "k": k,
                "sample_id": cols["sample_id"],
                "prompt": cols["prompt"],
                "prompt_meta": cols["prompt_meta"],
                "image": cols["image"],
            }
        )
        try:
            ring.put(
                {name: cols[name] for name in TENSORS if name in cols},
                {"k": k, **meta, "image": cols["image"]},
            )
        except RingClosed:  # the driver is shutting down
            return


def _scorer_main(cfg: OnlineConfig, inbox: Any, outbox: Any) -> None:
    """Worker: score every iteration's images; a failure is sent back, never turned into 0."""
    from stages.score.stage import score_shard

    torch.set_num_threads(cfg.threads)
    while True:
        job = inbox.get()
        if job is None:
            return
        try:
            outbox.put({"k": job["k"], **score_shard(job, cfg.rewards)})
        except Exception as exc:  # reported by the driver with the worker's name
            outbox.put({"k": job["k"], "error": f"{type(exc).__name__}: {exc}"})


class Workers:
    """The spawned sampler and scorer, and the channels between them and the driver."""

    def __init__(
        self,
        cfg: OnlineConfig,
        start: int,
        adapter: Path | None,
        weights: dict[str, torch.Tensor],
        step: int,
        latent: tuple[int, ...],
    ):
        import torch.multiprocessing as mp

        from stages.online.ring import Ring

        ctx = mp.get_context("spawn")
        self.weights = {k: v.detach().clone().share_memory_() for k, v in weights.items()}
        self.version = ctx.Value("i", start)
        self.step = ctx.Value("q", step)
        self.lock = ctx.Lock()
        rows = len(iteration_rows(cfg, start))
        self.ring = Ring(self._fields(cfg, start, latent), slots=2, rows=rows, ctx=ctx)
        self.to_scorer, self.from_scorer = ctx.Queue(), ctx.Queue()
        self.procs = {
            "sampler": ctx.Process(
                target=_sampler_main,
                name="omnirl-sampler",
                daemon=True,
                args=(
                    cfg,
                    start,
                    adapter,
                    self.weights,
                    self.version,
                    self.step,
                    self.lock,
                    self.ring,
                    self.to_scorer,
                ),
            ),
            "scorer": ctx.Process(
                target=_scorer_main,
                name="omnirl-scorer",
                daemon=True,
                args=(cfg, self.to_scorer, self.from_scorer),
            ),
        }
        for proc in self.procs.values():
            proc.start()

    @staticmethod
    def _fields(cfg: OnlineConfig, k: int, latent: tuple[int, ...]) -> list[Any]:
        """Ring fields from the shapes one sampled row will have; `latent` is one latent's [C, h, w]."""
        from stages.online.ring import Field
        from stages.sample.rollout import stored_steps

        stored = len(stored_steps(cfg.sampling(k), (0, 0)))
        fields = [
            Field("final_latent", latent, torch.float32),
            Field("seed", (), torch.int64),
            Field("policy_version", (), torch.int64),
        ]
        if stored:
            fields += [
                Field("latents", (stored + 1, *latent), torch.float32),
                Field("log_probs", (stored,), torch.float32),
                Field("sigmas", (stored + 1,), torch.float32),
                Field("timesteps", (stored,), torch.float32),
            ]
        return fields

    def check(self, awaited: str, k: int) -> None:
        """Fail fast, naming the worker, when one crashed or when the one we wait on has stopped."""
        for name, proc in self.procs.items():
            if not proc.is_alive() and (proc.exitcode != 0 or name == awaited):
                raise RuntimeFailure(
                    f"the {name} worker exited with code {proc.exitcode} before sending iteration {k}; see its output above"
                )

    def receive(self, k: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Iteration k's trajectories (from the ring) and rewards (from the scorer), waiting on live workers."""
        from stages.online.ring import RingClosed

        while True:
            try:
                tensors, meta = self.ring.get(timeout=POLL)
                break
            except TimeoutError:
                self.check("sampler", k)
            except RingClosed:
                raise RuntimeFailure("the trajectory ring was closed while waiting for the sampler") from None
        while True:
            try:
                rewards = self.from_scorer.get(timeout=POLL)
                break
            except queue.Empty:
                self.check("scorer", k)
        if "error" in rewards:
            raise RuntimeFailure(f"the scorer worker failed on iteration {k}: {rewards['error']}")
        if meta["k"] != k or rewards["k"] != k:
            raise RuntimeFailure(
                f"iteration mismatch: expected {k}, got trajectories {meta['k']}, rewards {rewards['k']}"
            )
        return {**tensors, **{key: v for key, v in meta.items() if key != "k"}}, rewards

    def publish(self, params: dict[str, torch.Tensor], version: int, step: int) -> None:
        """Hand the trained weights to the sampler as update number `version` (optimizer step `step`)."""
        with self.lock, torch.no_grad():
            for name, p in params.items():
                self.weights[name].copy_(p.detach())
            self.step.value = step
            self.version.value = version

    def shutdown(self) -> None:
        """Stop both workers and release the ring; safe to call twice and after a failure."""
        self.to_scorer.put(None)
        self.ring.close()
        for proc in self.procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


def last_checkpoint(out: Path) -> int:
    """The highest k with a complete out/it<k>/policy (0 when none): where a re-run resumes."""
    from stages.models.diffusion import ADAPTER_CONFIG

    done = [int(p.parent.name[2:]) for p in out.glob("it*/policy") if (p / ADAPTER_CONFIG).is_file()]
    return max(done, default=0)


def run_online(
    cfg: OnlineConfig, *, device: Any = "cpu", on_iteration: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Run iterations start..cfg.iterations−1 (resuming after the last checkpoint); one summary per iteration."""
    from stages.advantage.stage import compute_advantages
    from stages.models.diffusion import FlowPolicy
    from stages.update.stage import save_policy
    from stages.update.trainer import load_state, train

    if cfg.max_staleness not in (0, 1):
        raise UserInputError(f"--max-staleness {cfg.max_staleness}: choose 0 or 1")
    if not cfg.rewards:
        raise UserInputError("--reward: give at least one reward, e.g. --reward jpeg_compressibility")
    cfg.sample.validate()
    cfg.update.validate()
    start = last_checkpoint(cfg.out)
    adapter = cfg.out / f"it{start}" / "policy" if start else None
    policy = FlowPolicy.load(cfg.model, adapter=adapter, device=device, dtype=cfg.dtype)
    params = _trainable(policy, cfg.update)
    state, step = load_state(adapter)
    summaries: list[dict[str, Any]] = []
    if start >= cfg.iterations:
        return summaries
    workers = Workers(cfg, start, adapter, params, step, policy.latent_shape(cfg.sample.resolution))
    try:
        for k in range(start, cfg.iterations):
            t0 = time.perf_counter()
            data, rewards = workers.receive(k)
            t_wait = time.perf_counter() - t0
            data["reward"] = rewards["reward"]
            adv, stats = compute_advantages(
                data,
                estimator=cfg.estimator,
                clip=cfg.adv_clip,
                drop_zero_std=cfg.drop_zero_std,
                num_steps=data["log_probs"].shape[1] if "log_probs" in data else 1,
            )
            data.update({key: v for key, v in adv.items() if key != "sample_id"})
            t1 = time.perf_counter()
            optimizer, ema, old_weights, metrics = train(
                policy, data, cfg.sampling(k), replace(cfg.update, seed=k), state=state, start_step=step
            )
            t_train = time.perf_counter() - t1
            step = metrics[-1]["step"] if metrics else step
            state = {
                "optimizer": optimizer.state_dict(),
                "old_weights": old_weights,
                "ema": {"shadow": ema.shadow, "updates": ema.updates} if ema else None,
            }
            workers.publish(params, k + 1, step)
            save_policy(
                policy,
                cfg.out / f"it{k + 1}" / "policy",
                optimizer,
                ema,
                old_weights,
                metrics,
                step,
                cfg.update,
                extra={"online_iteration": k + 1, "max_staleness": cfg.max_staleness},
            )
            if cfg.save_trajectories:
                _save_trajectories(cfg, k, data, rewards, adv, stats)
            summary = {
                "iteration": k,
                "samples": len(data["sample_id"]),
                "reward_mean": float(rewards["reward"].mean()),
                "reward_std": float(rewards["reward"].std(unbiased=False)),
                "zero_std_ratio": stats["zero_std_ratio"],
                "policy_versions": sorted({int(v) for v in data["policy_version"]}),
                "step": step,
                "seconds_waiting": t_wait,
                "seconds_training": t_train,
                "seconds": time.perf_counter() - t0,
                **{
                    key: metrics[-1][key]
                    for key in ("actor/pg_loss", "actor/ratio_mean")
                    if metrics and key in metrics[-1]
                },
            }
            summaries.append(summary)
            if on_iteration:
                on_iteration(summary)
    finally:
        workers.shutdown()
    return summaries


def _save_trajectories(
    cfg: OnlineConfig,
    k: int,
    data: dict[str, Any],
    rewards: dict[str, Any],
    adv: dict[str, Any],
    stats: dict[str, Any],
) -> None:
    """The shard sets the staged commands would have written for iteration k."""
    from stages.sample.stage import KINDS
    from stages.shards.writer import ShardSetWriter

    it = cfg.out / f"it{k}"
    columns = ("sample_id", "group_id", "prompt", "negative_prompt", "prompt_meta", "image", *TENSORS)
    parts = {
        "samples": ({c: data[c] for c in columns if c in data}, {"sample_config": asdict(cfg.sampling(k))}),
        "rewards": ({key: v for key, v in rewards.items() if key != "k"}, {}),
        "advantages": (adv, {"stats": stats}),
    }
    parents: list[Path] = []
    for name, (batch, extra) in parts.items():
        writer = ShardSetWriter(
            it / name,
            num_shards=1,
            command=f"online:{name}",
            config={"iteration": k},
            parents=parents,
            kinds=KINDS if name == "samples" else None,
            overwrite=True,
        )
        if not writer.complete:
            writer.write_shard(0, batch)
            writer.finalize(extra=extra)
        parents = [it / "samples"]
