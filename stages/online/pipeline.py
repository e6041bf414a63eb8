"""`omnirl online`: the staged stages fused into one run, without files between them.

Processes: the driver trains (one `Trainer` for the whole run: its optimizer, lr schedule, EMA and
parallel wrapper carry across iterations); a sampler and a scorer worker run in their own spawned
processes (`workers`). After each update the driver copies the trained weights into shared tensors and
bumps a version; the sampler waits until the version is at least k − max_staleness before sampling
iteration k, so with staleness 1 sampling k+1 overlaps training on k, and every sample records the
version that drew it.

Every stage is the same library function the staged commands call (`sample_shard`, `score_shard`,
`compute_advantages`, `Trainer.step`), with the recipe's seeds (iteration k samples and shuffles with
seed k), so with staleness 0 an online iteration reproduces the staged one. The in-process sampler (``--engine diffusers``)
runs on the trainer's device (Accelerate's), so its rollout log-probs are the trainer's (ratio 1
on-policy).

Remote rollout (``--engine remote``): the sampler worker is a client of an `omnirl serve` that holds the
same model and owns its device. Instead of the shared tensors, the driver pushes each new LoRA to the
server (`RolloutEngine.push_weights`, version = optimizer step, under a name of this run's own so that
other runs sharing the server keep theirs) before publishing the version number; the sampler pins each
iteration to the version published when it starts (`RolloutEngine.pin_weights`: the server keeps the
latest two versions of a name, so a push meanwhile does not change it), and every sample records the
version the server used. Staleness is the version gap: iteration k's samples drawn with the weights of
update j have gap k − j, at most max_staleness (the sampler waits as above, and refuses replies from
older weights than were pushed).

Identity. The run directory records what determines its results (`RUN_FILE`: the resolved settings and
content digests of the model, the prompts and file plugins); a re-run with other ones is refused
rather than silently continuing the old run's checkpoints, unless it is told to start over.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from stages.dist import broadcast, world_and_rank
from stages.errors import RuntimeFailure, UserInputError
from stages.media import MEDIA_COLUMNS
from stages.online.config import TENSORS, OnlineConfig, iteration_rows
from stages.online.trajectories import save_trajectories
from stages.online.workers import Workers, trainable_weights
from stages.reporting import step_means
from stages.tracking import Tracking, timing_metrics
from stages.update.losses import get_algorithm

RUN_FILE = "online_run.json"
# the trainer's model parallelism and kernels (online's own options): no part of the run's identity
KERNEL_KNOBS = ("sp_degree", "sp_kind", "tp_degree", "attention_backend", "compile")


def last_checkpoint(out: Path) -> int:
    """The highest k with a complete out/it<k>/policy (0 when none): where a re-run resumes."""
    from stages.models.diffusion import ADAPTER_CONFIG

    done = [int(p.parent.name[2:]) for p in out.glob("it*/policy") if (p / ADAPTER_CONFIG).is_file()]
    return max(done, default=0)


# OnlineConfig fields that never change a run's results: where it is written, how far it goes, how fast.
# The rollout engine neither: remote samples equal in-process ones (tests/test_online_remote.py).
NOT_IDENTITY = (
    "weights_name",
    "model",
    "prompts",
    "out",
    "iterations",
    "save_trajectories",
    "media_every",
    "threads",
    "engine",
    "rollout",
)


def iteration_advantages(
    cfg: OnlineConfig, data: dict[str, Any], rewards: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An iteration's advantages, as the staged `omnirl advantage` computes them from `score`'s columns:
    `rewards` (reward [N], reward.<name> [N], reward_failed [N] under --on-error zero) join `data`, and
    so do advantages [N, K] (train_mask, kl_gate where the estimator writes them). Returns the advantage
    columns (as `omnirl advantage` writes them) and their stats."""
    from stages.advantage.stage import compute_advantages
    from stages.score.scoring import FAILED_COLUMN

    data.update(
        {k: v for k, v in rewards.items() if k == "reward" or k.startswith("reward.") or k == FAILED_COLUMN}
    )
    a = cfg.advantage
    adv, stats = compute_advantages(
        data,
        estimator=a.estimator_name(),
        clip=a.clip,
        drop_zero_std=a.drop_zero_std,
        num_steps=data["log_probs"].shape[1] if "log_probs" in data else 1,
        weights=dict(cfg.rewards) if a.aggregation == "advantage_aggr" else None,
        std_ddof=a.std_ddof,
        features=a.diversity_features,
        gate_rewards=a.gate_reward,
        gate_fraction=a.gate_fraction,
    )
    data.update({key: v for key, v in adv.items() if key != "sample_id"})
    return adv, stats


def run_identity(cfg: OnlineConfig) -> dict[str, Any]:
    """What determines the run's results, as plain JSON: `settings` (the resolved options) and `inputs`
    (content digests of the model folder, of the prompts as read, of file plugins' sources and of the
    files reward arguments name, `registry.reward_files`).

    Not part of it: --iterations (a re-run goes further), --threads, --save-trajectories, --media-every, --out and
    where the sampler runs (--engine, --server-url).
    """
    from stages.models.families import resolution_identity
    from stages.plugins import spec_file
    from stages.score.registry import reward_files
    from stages.shards.digest import content_digest

    settings = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in NOT_IDENTITY}
    settings.update(sample=cfg.sample.record(), update=_update_identity(cfg), advantage=asdict(cfg.advantage))
    settings["sample"]["resolution"] = resolution_identity(cfg.sample.resolution)
    prompts = json.dumps([asdict(p) for p in cfg.prompts], sort_keys=True, default=str)
    inputs = {
        "model": content_digest(cfg.model, "--model"),
        "prompts": hashlib.sha256(prompts.encode()).hexdigest(),
    }
    for name, _ in cfg.rewards:
        source = spec_file(name)
        if source is not None:
            inputs[f"reward {name}"] = content_digest(source, "--reward")
        for key, path in reward_files(name, cfg.reward_args.get(name)).items():
            inputs[f"reward {name}.{key}"] = content_digest(path, f"--reward-arg {name}.{key}")
    return json.loads(json.dumps({"settings": settings, "inputs": inputs}, default=str))


def _update_identity(cfg: OnlineConfig) -> dict[str, Any]:
    """The trainer's settings that determine the run's results: every update setting but how its model
    is spread over ranks and which kernels run it (`KERNEL_KNOBS`: each agrees with one process and
    native attention to rounding), unless the attention backend is quantized (`changes_numbers`)."""
    from stages.models.kernels import active_backend, changes_numbers

    settings = {k: v for k, v in asdict(cfg.update).items() if k not in KERNEL_KNOBS}
    backend = active_backend(cfg.update.attention_backend)
    if changes_numbers(backend):
        settings["attention_backend"] = backend
    return settings


def _first_difference(old: Any, new: Any, path: str = "") -> str | None:
    """The dotted key of the first value that differs between two JSON trees (None when equal). A key
    only `old` has is no difference: an older record's setting that no longer enters the identity."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(new):
            found = _first_difference(old.get(key), new.get(key), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    return None if old == new else path


def _run_dirs(out: Path) -> list[Path]:
    """The it<K> directories an online run wrote under `out`."""
    return sorted(p for p in out.glob("it*") if re.fullmatch(r"it\d+", p.name) and p.is_dir())


def _foreign_run(out: Path, identity: dict[str, Any]) -> str | None:
    """What `out` holds when it holds another run than `identity` (None: nothing, or this run)."""
    record = out / RUN_FILE
    if not record.is_file():
        if _run_dirs(out):
            raise UserInputError(
                f"--out {out}: holds it<K> folders that `omnirl online` did not write (no {RUN_FILE}); "
                "pick another --out"
            )
        return None
    try:
        recorded = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return f"a run with an unreadable {RUN_FILE}"
    key = _first_difference(recorded, identity)
    if key is None:
        return None
    section, _, name = key.partition(".")
    return f"another run ({name}{' content' if section == 'inputs' else ''} differs, see {RUN_FILE})"


def prepare_run(cfg: OnlineConfig, *, overwrite: bool = False) -> int:
    """Check every user input, then claim `cfg.out` for this run; returns the iteration to start at.

    Runs before any worker or display starts, so a bad input costs one line (UserInputError). The run's
    identity (`run_identity`) is recorded in out/RUN_FILE; a directory holding another run is refused,
    or, with `overwrite`, its it<K> directories are removed and the run starts over. The same run
    resumes after its last checkpoint. Under a launcher every rank checks the inputs, rank 0 alone
    claims the directory, and every rank gets its answer (the same refusal, or the same start).
    """
    _check_inputs(cfg)
    identity = run_identity(cfg)
    claimed: int | str = 0
    if world_and_rank()[1] == 0:
        try:
            claimed = _claim(cfg, identity, overwrite)
        except UserInputError as exc:
            claimed = str(exc)
    claimed = broadcast(claimed)
    if isinstance(claimed, str):
        raise UserInputError(claimed)
    return claimed


def _check_inputs(cfg: OnlineConfig) -> None:
    """Refuse in one line (UserInputError) settings and inputs no online run can take."""
    from stages.models.diffusion import DTYPES, check_pipeline_folder
    from stages.sample.engines import engine_class
    from stages.score.registry import reward_kind
    from stages.update.parallel import resolve_strategy

    if cfg.max_staleness not in (0, 1):
        raise UserInputError(f"--max-staleness {cfg.max_staleness}: choose 0 or 1")
    if cfg.media_every < 1:
        raise UserInputError(f"--media-every {cfg.media_every}: must be at least 1")
    if cfg.media_every > 1 and not cfg.save_trajectories:
        raise UserInputError(
            f"--media-every {cfg.media_every}: it thins stored media; add --save-trajectories"
        )
    if not cfg.rewards:
        raise UserInputError("--reward: give at least one reward, e.g. --reward jpeg_compressibility")
    for name, _ in cfg.rewards:
        if reward_kind(name) == "text":
            raise UserInputError(f"--reward {name}: it scores text; omnirl online trains on images or videos")
    if cfg.dtype not in DTYPES:
        raise UserInputError(f"--dtype {cfg.dtype}: choose one of {', '.join(DTYPES)}")
    check_pipeline_folder(cfg.model)
    if not cfg.in_process and not engine_class(cfg.engine).takes_pushed_weights:
        raise UserInputError(
            f"--engine {cfg.engine}: omnirl online pushes each new LoRA to its sampler, and this engine takes "
            f"no pushed weights; sample with --engine remote (an `omnirl serve --model {cfg.model}` at "
            "--server-url) or --engine diffusers"
        )
    if not cfg.in_process and not cfg.engine_options().server_url:
        raise UserInputError(
            f"--engine {cfg.engine} needs --server-url: start `omnirl serve --model {cfg.model} --port P` "
            "and pass --server-url http://HOST:P"
        )
    if not cfg.in_process and cfg.media_every > 1:
        raise UserInputError(
            f"--media-every {cfg.media_every}: iterations without media are decoded later by `omnirl score` "
            f"with the local VAE, not the one --engine {cfg.engine} decoded with; sample in-process "
            "(--engine diffusers) or keep --media-every 1"
        )
    if not cfg.in_process and cfg.update.full:
        raise UserInputError(
            f"--engine {cfg.engine}: the driver pushes LoRA weights to it; full fine-tuning "
            "(update.full) samples with --engine diffusers"
        )
    if not cfg.in_process and resolve_strategy(cfg.update.strategy, world_and_rank()[0]) == "fsdp2":
        raise UserInputError(
            f"--engine {cfg.engine}: FSDP2 shards the LoRA over the ranks and the driver pushes it whole "
            "from rank 0; train with update.strategy ddp"
        )
    cfg.sample.validate()
    cfg.update.validate()
    algo = get_algorithm(cfg.update.algo)
    missing = [column for column in algo.needs if column not in TENSORS]
    if missing:
        raise UserInputError(
            f"update.algo {algo.name}: it trains on the column '{missing[0]}', which omnirl online does not "
            "produce (its samples carry their rollouts' own columns only); run it through the staged commands"
        )
    iteration_rows(cfg, 0)  # group size and prompt count
    if cfg.out.exists() and not cfg.out.is_dir():
        raise UserInputError(f"--out {cfg.out}: is a file; give a run directory")


def _claim(cfg: OnlineConfig, identity: dict[str, Any], overwrite: bool) -> int:
    """Record `identity` in cfg.out (refusing, or with `overwrite` clearing, another run's directory);
    returns the iteration this run starts at (`prepare_run`)."""
    from stages.shards.atomic import atomic_write_bytes

    foreign = _foreign_run(cfg.out, identity) if cfg.out.is_dir() else None
    if foreign and not overwrite:
        raise UserInputError(
            f"--out {cfg.out}: holds {foreign}; pass --overwrite to discard it and start over, or pick another --out"
        )
    try:
        if foreign:
            for path in _run_dirs(cfg.out):
                shutil.rmtree(path)
        cfg.out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cfg.out / RUN_FILE, json.dumps(identity, indent=1, sort_keys=True).encode())
    except OSError as exc:
        raise UserInputError(
            f"--out {cfg.out}: cannot write the run there ({exc.strerror}); pick another --out"
        ) from exc
    return last_checkpoint(cfg.out)


def run_online(
    cfg: OnlineConfig,
    *,
    device: Any = "cpu",
    overwrite: bool = False,
    on_iteration: Callable[[dict[str, Any]], None] | None = None,
    tracking: Tracking | None = None,
) -> list[dict[str, Any]]:
    """Run iterations start..cfg.iterations−1 on `device` (resuming after the last checkpoint of the same
    run, see `prepare_run`); one summary per iteration. `tracking` gets each iteration's reward statistics
    (at the iteration) and actor metrics (at their optimizer steps) once its checkpoint is written.

    Under a launcher (`stages.parallelism.layout` of cfg.update.parallel called first) every rank trains,
    as `omnirl update`'s ranks do (dp × sp or dp × tp, DDP or FSDP2): rank 0 alone runs the workers (its
    device samples) or pushes to the engine, and hands each iteration's training columns to the others
    (`broadcast`); it alone writes trajectories, logs and returns summaries (the others return none).
    """
    from stages.models.condition_images import RECORD as CONDITION_IMAGES
    from stages.models.conditioning import CONDITIONING, from_bytes
    from stages.models.diffusion import FlowPolicy
    from stages.score.stage import check_reward_kinds
    from stages.shards.manifest import config_hash
    from stages.update.trainer import Trainer

    start = prepare_run(cfg, overwrite=overwrite)
    lead = world_and_rank()[1] == 0
    adapter = cfg.out / f"it{start}" / "policy" if start else None
    pusher = None
    # opened first: whether the server returns conditioning decides what loads
    if lead and not cfg.in_process:
        from stages.sample.engines import open_engine

        pusher = open_engine(cfg.engine, cfg.engine_options(), device)
    # the sampler hands over each prompt's conditioning with its trajectories (in process, or a server
    # that returns it), so the trainer loads no text encoder; it never decodes (the sampler and scorer
    # do), so it loads no VAE either
    handed_over = broadcast(pusher is None or pusher.returns_conditioning)
    policy = FlowPolicy.load(
        cfg.model,
        adapter=adapter,
        device=device,
        dtype=cfg.dtype,
        conditioning={} if handed_over else None,
        vae=False,
    )
    policy.conditioning_source = (
        "from the sampler"
        if handed_over
        else f"encoded: --engine {cfg.engine} returns no conditioning (a server of another --dtype or version)"
    )
    check_reward_kinds(cfg.rewards, policy.family.media)
    if not cfg.in_process and len(policy.parts) > 1:
        raise UserInputError(
            f"--engine {cfg.engine}: the driver pushes one LoRA file, and this model trains "
            f"{', '.join(policy.parts)}; train it with --engine diffusers"
        )
    trainable_weights(policy, cfg.update)  # its LoRA on, before the trainer spreads the module
    summaries: list[dict[str, Any]] = []
    if start >= cfg.iterations:
        return summaries
    # built once: its optimizer, scheduler position, EMA and parallel wrapper carry across iterations
    trainer = Trainer.resume(policy, cfg.update, adapter)
    step = trainer.global_step
    published = {step: start}  # optimizer step of each published version → its iteration count
    # the trained weights whole on rank 0 (each rank's shards gathered under FSDP2 or tp: a collective)
    weights = trainer.par.gather(trainer.named) if cfg.in_process else {}
    workers = None
    try:  # a run that fails to start forgets what it pushed, as a run that ends does (below)
        if pusher is not None:  # the server samples iteration `start` with the weights trained so far
            pusher.push_weights(policy.lora_file(), step)
        if lead:
            workers = Workers(
                cfg,
                start,
                adapter,
                weights,
                step,
                policy.latent_shape(cfg.sample.resolution, cfg.sample.frames),
                policy.device,
                config_hash(run_identity(cfg)),
            )
    except BaseException:
        if pusher is not None:
            pusher.close()
        raise
    try:
        for k in range(start, cfg.iterations):
            t0 = time.perf_counter()
            if workers is not None:
                try:
                    data, rewards, sampled_on = workers.receive(k)
                    t_wait = time.perf_counter() - t0
                    handed = {
                        "conditioning": data.pop(CONDITIONING, None),
                        "images": data.pop(CONDITION_IMAGES, {}),
                    }
                    gaps = version_gaps(data["policy_version"], published, k)
                    adv, stats = iteration_advantages(cfg, data, rewards)
                except Exception:
                    broadcast(None)  # the other ranks stop waiting; this rank's error says why
                    raise
                message = {**handed, "data": {c: v for c, v in data.items() if c not in MEDIA_COLUMNS}}
                broadcast(message)
            else:  # another rank trains on rank 0's iteration (None: rank 0 stopped, and says why)
                message = broadcast(None)
                if message is None:
                    return summaries
                data, t_wait = message["data"], time.perf_counter() - t0
            sampled_with = from_bytes(message["conditioning"]) if message["conditioning"] else {}
            if sampled_with:
                policy.add_conditioning(sampled_with)
            policy.group_images.update(message["images"])
            t1 = time.perf_counter()
            policy.forget_prompts()  # its encodings as a resumed run's (`FlowPolicy.forget_prompts`)
            metrics = trainer.step(data, cfg.sampling(k), seed=k)
            t_train = time.perf_counter() - t1
            step = trainer.global_step
            if pusher is not None:
                pusher.push_weights(policy.lora_file(), step)
            if cfg.in_process:
                weights = trainer.par.gather(trainer.named)
            if workers is not None:
                workers.publish(weights, k + 1, step)
            published[step] = k + 1
            t2 = time.perf_counter()
            trainer.save(
                cfg.out / f"it{k + 1}" / "policy",
                metrics,
                extra={"online_iteration": k + 1, "max_staleness": cfg.max_staleness},
            )
            if not lead:
                continue
            if cfg.save_trajectories:
                save_trajectories(
                    cfg, k, data, rewards, adv, stats, policy.family, policy.group_images, sampled_with
                )
            seconds = {
                "gen": t_wait,
                "adv": t1 - t0 - t_wait,
                "update_actor": t_train,
                "update_weights": t2 - t1 - t_train,
                "save_checkpoint": time.perf_counter() - t2,
                "step": time.perf_counter() - t0,
            }
            if tracking:
                tracking.log_rewards(k, rewards, data.get("prompt_meta"))
                tracking.log("rollout", k, {"rollout/version_gap_max": max(gaps)})
                tracking.log("critic", k, {key: v for key, v in stats.items() if key.startswith("critic/")})
                tracking.log("timing", k, timing_metrics(seconds, len(data["sample_id"])))
                tracking.log_update(metrics)
            summary = {
                "iteration": k,
                "samples": len(data["sample_id"]),
                "reward_mean": float(rewards["reward"].mean()),
                "reward_std": float(rewards["reward"].std(unbiased=False)),
                "zero_std_ratio": stats["zero_std_ratio"],
                "policy_versions": sorted({int(v) for v in data["policy_version"]}),
                "version_gaps": sorted(set(gaps)),
                "version_gap_max": max(gaps),
                "device": str(policy.device),
                "sampler_device": sampled_on,
                "loaded_components": policy.loaded_components,  # the trainer's
                "conditioning": policy.conditioning_source,
                "ranks": world_and_rank()[0],
                "step": step,
                "seconds_waiting": t_wait,
                "seconds_training": t_train,
                "seconds": time.perf_counter() - t0,
                **step_means(metrics),  # this iteration's update, as `omnirl report` and `update` show it
            }
            summaries.append(summary)
            if on_iteration:
                on_iteration(summary)
    finally:
        if workers is not None:
            workers.shutdown()
        if pusher is not None:
            pusher.close()
    return summaries


def version_gaps(versions: torch.Tensor, published: dict[int, int], k: int) -> list[int]:
    """Each iteration-k sample's staleness: k − the iteration count of the weights that drew it, from
    its recorded version (an optimizer step) and `published` (step → iteration count)."""
    unknown = sorted({int(v) for v in versions} - set(published))
    if unknown:
        raise RuntimeFailure(
            f"iteration {k} was sampled with weights version {unknown[0]}, which this run never published"
        )
    return [k - published[int(v)] for v in versions]
