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
staleness 0 an online iteration reproduces the staged one. The in-process sampler (``--engine diffusers``)
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

Lifetimes. Workers end with the driver however it ends: each watches the pipe that `multiprocessing`
keeps open to its parent (EOF = the driver died, even by SIGKILL) and exits; they start with SIGINT
ignored, so Ctrl-C in a terminal reaches only the driver, which stops them (no worker tracebacks).

Identity. The run directory records what determines its results (`RUN_FILE`: the resolved settings and
content digests of the model, the prompts and file plugins); a re-run with other ones is refused
rather than silently continuing the old run's checkpoints, unless it is told to start over.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import queue
import re
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from stages.errors import RuntimeFailure, UserInputError
from stages.media import MEDIA_COLUMNS, output_modality
from stages.reporting import step_means
from stages.sample.engines import DEFAULT_ENGINE, EngineOptions
from stages.sample.prompts import Prompt
from stages.sample.rollout import LATENT_DTYPES, SampleConfig
from stages.tracking import Tracking
from stages.update.losses import get_algorithm
from stages.update.trainer import UpdateConfig

TENSORS = ("latents", "log_probs", "sigmas", "timesteps", "final_latent", "seed", "policy_version")
POLL = 0.5
RUN_FILE = "online_run.json"


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
    reward_args: dict[str, dict[str, Any]] = field(default_factory=dict)
    estimator: str = "grpo"
    adv_clip: float | None = None
    drop_zero_std: bool = False
    max_staleness: int = 0
    save_trajectories: bool = False
    # with save_trajectories: media columns only every N-th iteration and the last (the others keep final
    # latents, `stages.media.deferred`); every iteration is still decoded in memory and scored
    media_every: int = 1
    dtype: str = "fp32"
    threads: int = 1
    seed: int | None = None
    engine: str = DEFAULT_ENGINE  # the sampler's rollout engine: diffusers (in-process) or one taking pushes
    rollout: EngineOptions | None = None  # how to reach a remote engine (server URL, token, timeouts)
    # this driver's own name for the weights it pushes to a shared server: random, so two runs never
    # share one (the same --out on two machines did); a resumed run pushes again before sampling
    weights_name: str = field(default_factory=lambda: "online-" + secrets.token_hex(8))

    def engine_options(self) -> EngineOptions:
        """The sampler engine's options: this run's model, and weights the driver pushes under a name of
        this driver's own (`weights_name`), so other runs sharing the server keep theirs."""
        base = self.rollout or EngineOptions(model=Path(self.model))
        return replace(
            base,
            model=Path(self.model),
            adapter=None,
            dtype=self.dtype,
            pushed_weights=True,
            weights_name=self.weights_name,
        )

    @property
    def in_process(self) -> bool:
        """Whether the sampler runs the pipeline itself (weights through shared memory, not pushed)."""
        return self.engine == DEFAULT_ENGINE

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

    if not policy.lora and not cfg.full:
        policy.add_lora(rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed)
    policy.trainable_parameters(full=cfg.full)
    return {n: p for n, p in policy.transformer.named_parameters() if p.requires_grad}


def _exit_with_parent() -> None:
    """In a worker: end this process as soon as the driver that spawned it has died.

    A daemon thread waits on the parent sentinel `multiprocessing` gives every spawned child (the read
    end of a pipe whose write end only the parent holds: EOF when it dies, however it dies; a process
    handle on Windows), so a SIGKILLed driver leaves no worker behind.
    """
    import multiprocessing
    import os

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="omnirl-parent-watch", daemon=True).start()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Processes started inside inherit SIGINT ignored (Python keeps an inherited SIG_IGN), so a
    terminal's Ctrl-C interrupts only the driver, which then stops them cleanly. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _sampler_main(
    cfg: OnlineConfig,
    start: int,
    adapter: Path | None,
    device: Any,
    weights: dict[str, torch.Tensor],
    version: Any,
    step: Any,
    lock: Any,
    ring: Any,
    to_scorer: Any,
) -> None:
    """Worker: sample iterations start..iterations−1, each with weights no staler than max_staleness:
    in-process on `device` (the trainer's) with the weights of the shared tensors, or on the engine
    the driver pushes them to (module docstring).

    `version` counts published updates (iterations); `step` is their optimizer step, recorded per sample.
    Every batch names where it was sampled, so the driver can report it.
    """
    from stages.models.conditioning import CONDITIONING, to_bytes
    from stages.models.diffusion import FlowPolicy
    from stages.online.ring import RingClosed
    from stages.sample.engines import DiffusersEngine, open_engine
    from stages.sample.stage import in_rollout, sample_shard
    from stages.shards.manifest import config_hash

    _exit_with_parent()
    run = config_hash(run_identity(cfg))  # with the iteration, the rollout id of each iteration's ids
    torch.set_num_threads(cfg.threads)
    params: dict[str, torch.Tensor] = {}
    if cfg.in_process:
        policy = FlowPolicy.load(cfg.model, adapter=adapter, device=device, dtype=cfg.dtype)
        params = _trainable(policy, cfg.update)
        engine: Any = DiffusersEngine(policy)
        where = str(policy.device)
    else:
        engine = open_engine(cfg.engine, cfg.engine_options(), device)
        where = f"{cfg.engine} {engine.describe().get('server_url', '')}".strip()

    def stop_if_closed(_: int) -> None:  # between batches: the driver may have stopped meanwhile
        if ring.closed:
            raise RingClosed("the driver is shutting down")

    try:
        for k in range(start, cfg.iterations):
            while version.value < k - cfg.max_staleness:
                stop_if_closed(0)
                time.sleep(0.01)
            with lock, torch.no_grad():
                for name, p in params.items():
                    p.copy_(weights[name])
                drawn_with = step.value  # pushed engines: the server holds this version or a newer one
            if cfg.in_process:
                policy.forget_prompts()  # its encodings as a resumed run's (`FlowPolicy.forget_prompts`)
            if not cfg.in_process:
                engine.pin_weights(drawn_with)  # the whole iteration with one version
            cols = in_rollout(
                sample_shard(
                    engine, cfg.sampling(k), iteration_rows(cfg, k), drawn_with, on_batch=stop_if_closed
                ),
                config_hash({"run": run, "iteration": k})[:8],
            )
            used = int(cols["policy_version"].min())
            if used < drawn_with:
                raise RuntimeFailure(
                    f"--engine {cfg.engine}: sampled iteration {k} with weights version {used}, older than "
                    f"the {drawn_with} this run pushed; another client changed the server's weights"
                )
            meta = {
                key: cols[key]
                for key in ("sample_id", "group_id", "prompt", "negative_prompt", "prompt_meta")
            }
            if engine.returns_conditioning:  # the prompts' conditioning: the trainer loads no text encoder
                # sent every iteration, as encoded for it: the in-process sampler forgets its encodings
                # between iterations (`forget_prompts`), and the trainer must train on the very ones
                # sampled with (a server's, those it returned)
                length = cfg.sampling(k).max_sequence_length
                keys = {(r.prompt.text, r.prompt.negative, length) for r in iteration_rows(cfg, k)}
                entries = engine.conditioning(sorted(keys)) or {}
                if len(entries) != len(keys):  # a server whose weights changed a text encoder meanwhile
                    raise RuntimeFailure(
                        f"--engine {cfg.engine}: it returned the prompt conditioning of {len(entries)} of "
                        f"iteration {k}'s {len(keys)} prompts; restart the server without a text-encoder LoRA"
                    )
                meta[CONDITIONING] = to_bytes(entries)
            media = {name: cols[name] for name in MEDIA_COLUMNS if name in cols}
            to_scorer.put(
                {
                    "k": k,
                    "sample_id": cols["sample_id"],
                    "prompt": cols["prompt"],
                    "prompt_meta": cols["prompt_meta"],
                    **media,
                }
            )
            kept = media if cfg.save_trajectories and stores_media(cfg, k) else {}  # the driver only saves it
            ring.put(
                {name: cols[name] for name in TENSORS if name in cols},
                {"k": k, **meta, **kept, "device": where},
            )
    except RingClosed:  # the driver is shutting down: what the scorer has not read is moot
        to_scorer.cancel_join_thread()
    finally:
        engine.close()


def _scorer_main(cfg: OnlineConfig, inbox: Any, outbox: Any) -> None:
    """Worker: score every iteration's images or videos; a failure is sent back, never turned into 0."""
    from stages.score.stage import score_shard

    _exit_with_parent()
    torch.set_num_threads(cfg.threads)
    while True:
        job = inbox.get()
        if job is None:
            return
        try:
            modality = output_modality(list(job))
            scored = score_shard(
                job,
                cfg.rewards,
                modality=modality,
                reward_args=cfg.reward_args,
                mixed_precision=cfg.sample.mixed_precision,
            )
            outbox.put({"k": job["k"], **scored})
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
        device: Any,
    ):
        import torch.multiprocessing as mp

        from stages.online.ring import Ring

        ctx = mp.get_context("spawn")
        self.weights = {k: v.detach().clone().share_memory_() for k, v in weights.items()}
        self.version = ctx.Value("i", start)
        self.step = ctx.Value("q", step)
        self.lock = ctx.Lock()
        rows = len(iteration_rows(cfg, start))
        self.ring = Ring(self._fields(cfg, latent), slots=2, rows=rows, ctx=ctx)
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
                    device,
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
        with _sigint_ignored():
            for proc in self.procs.values():
                proc.start()

    @staticmethod
    def _fields(cfg: OnlineConfig, latent: tuple[int, ...]) -> list[Any]:
        """Ring fields for the rows of any iteration; `latent` is one latent's shape ([C, h, w], or
        [C, F, h, w] for video).

        The stored-step count K may change between iterations (a MixGRPO window shrinks near the end
        of its range), so the K dimensions are ragged, sized for the most any iteration stores: an SDE
        window holds at most `window` steps; without one every step is stored (`stored_steps`).
        """
        from stages.online.ring import Field

        scfg = cfg.sample
        most = 0 if scfg.sampler == "ode" else (scfg.window or scfg.steps)
        stored = LATENT_DTYPES[scfg.latent_dtype]
        fields = [
            Field("final_latent", latent, stored),
            Field("seed", (), torch.int64),
            Field("policy_version", (), torch.int64),
        ]
        if most:
            fields += [
                Field("latents", (most + 1, *latent), stored, ragged=(0,)),
                Field("log_probs", (most,), torch.float32, ragged=(0,)),
                Field("sigmas", (most + 1,), torch.float32, ragged=(0,)),
                Field("timesteps", (most,), torch.float32, ragged=(0,)),
            ]
        return fields

    def check(self, awaited: str, k: int) -> None:
        """Fail fast, naming the worker, when one crashed or when the one we wait on has stopped."""
        for name, proc in self.procs.items():
            if not proc.is_alive() and (proc.exitcode != 0 or name == awaited):
                raise RuntimeFailure(
                    f"the {name} worker exited with code {proc.exitcode} before sending iteration {k}; see its output above"
                )

    def receive(self, k: int) -> tuple[dict[str, Any], dict[str, Any], str]:
        """Iteration k's trajectories (from the ring), rewards (from the scorer) and the device they
        were sampled on, waiting on live workers."""
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
        sampled_on = meta.pop("device")
        return {**tensors, **{key: v for key, v in meta.items() if key != "k"}}, rewards, sampled_on

    def publish(self, params: dict[str, torch.Tensor], version: int, step: int) -> None:
        """Hand the trained weights to the sampler as update number `version` (optimizer step `step`)."""
        with self.lock, torch.no_grad():
            for name, shared in self.weights.items():  # none when the driver pushes them to the engine
                shared.copy_(params[name].detach())
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
        # the workers are gone: what this process still has to write to them (the stop messages, queued
        # behind a pipe nobody reads any more) must not hold its exit
        self.to_scorer.cancel_join_thread()
        self.ring.abandon()


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
    settings.update(sample=asdict(cfg.sample), update=asdict(cfg.update))
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


def _first_difference(old: Any, new: Any, path: str = "") -> str | None:
    """The dotted key of the first value that differs between two JSON trees (None when equal)."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
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
    resumes after its last checkpoint.
    """
    from stages.models.diffusion import DTYPES, check_pipeline_folder
    from stages.sample.engines import engine_class
    from stages.score.registry import reward_kind
    from stages.shards.atomic import atomic_write_bytes

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
    identity = run_identity(cfg)
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
    (at the iteration) and actor metrics (at their optimizer steps) once its checkpoint is written."""
    from stages.advantage.stage import compute_advantages
    from stages.models.conditioning import CONDITIONING, from_bytes
    from stages.models.diffusion import FlowPolicy
    from stages.score.stage import check_reward_kinds
    from stages.update.trainer import Trainer

    start = prepare_run(cfg, overwrite=overwrite)
    adapter = cfg.out / f"it{start}" / "policy" if start else None
    pusher = None
    if not cfg.in_process:  # opened first: whether the server returns conditioning decides what loads
        from stages.sample.engines import open_engine

        pusher = open_engine(cfg.engine, cfg.engine_options(), device)
    # the sampler hands over each prompt's conditioning with its trajectories (in process, or a server
    # that returns it), so the trainer loads no text encoder; it never decodes (the sampler and scorer
    # do), so it loads no VAE either
    policy = FlowPolicy.load(
        cfg.model,
        adapter=adapter,
        device=device,
        dtype=cfg.dtype,
        conditioning={} if pusher is None or pusher.returns_conditioning else None,
        vae=False,
    )
    policy.conditioning_source = (
        "from the sampler"
        if pusher is None or pusher.returns_conditioning
        else f"encoded: --engine {cfg.engine} returns no conditioning (a server of another --dtype or version)"
    )
    check_reward_kinds(cfg.rewards, policy.family.media)
    if not cfg.in_process and len(policy.parts) > 1:
        raise UserInputError(
            f"--engine {cfg.engine}: the driver pushes one LoRA file, and this model trains "
            f"{', '.join(policy.parts)}; train it with --engine diffusers"
        )
    params = _trainable(policy, cfg.update)
    summaries: list[dict[str, Any]] = []
    if start >= cfg.iterations:
        return summaries
    # built once: its optimizer, scheduler position, EMA and parallel wrapper carry across iterations
    trainer = Trainer.resume(policy, cfg.update, adapter)
    step = trainer.global_step
    published = {step: start}  # optimizer step of each published version → its iteration count
    try:  # a run that fails to start forgets what it pushed, as a run that ends does (below)
        if pusher is not None:  # the server samples iteration `start` with the weights trained so far
            pusher.push_weights(policy.lora_file(), step)
        workers = Workers(
            cfg,
            start,
            adapter,
            params if cfg.in_process else {},
            step,
            policy.latent_shape(cfg.sample.resolution, cfg.sample.frames),
            policy.device,
        )
    except BaseException:
        if pusher is not None:
            pusher.close()
        raise
    try:
        for k in range(start, cfg.iterations):
            t0 = time.perf_counter()
            data, rewards, sampled_on = workers.receive(k)
            t_wait = time.perf_counter() - t0
            if CONDITIONING in data:
                policy.add_conditioning(from_bytes(data.pop(CONDITIONING)))
            gaps = version_gaps(data["policy_version"], published, k)
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
            policy.forget_prompts()  # its encodings as a resumed run's (`FlowPolicy.forget_prompts`)
            metrics = trainer.step(data, cfg.sampling(k), seed=k)
            t_train = time.perf_counter() - t1
            step = trainer.global_step
            if pusher is not None:
                pusher.push_weights(policy.lora_file(), step)
            workers.publish(params, k + 1, step)
            published[step] = k + 1
            trainer.save(
                cfg.out / f"it{k + 1}" / "policy",
                metrics,
                extra={"online_iteration": k + 1, "max_staleness": cfg.max_staleness},
            )
            if cfg.save_trajectories:
                _save_trajectories(cfg, k, data, rewards, adv, stats, policy.family)
            if tracking:
                tracking.log_rewards(k, rewards, data.get("prompt_meta"))
                tracking.log("rollout", k, {"rollout/version_gap_max": max(gaps)})
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


def stores_media(cfg: OnlineConfig, k: int) -> bool:
    """Whether iteration k's saved samples hold their media: every `media_every`-th iteration (0, N,
    2N, ...) and the run's last."""
    return k % cfg.media_every == 0 or k == cfg.iterations - 1


def _save_trajectories(
    cfg: OnlineConfig,
    k: int,
    data: dict[str, Any],
    rewards: dict[str, Any],
    adv: dict[str, Any],
    stats: dict[str, Any],
    family: Any,
) -> None:
    """The shard sets the staged commands would have written for iteration k (`family`: the policy's
    `FamilyAdapter`); its samples hold media only when `stores_media(cfg, k)` (the sampler sends it to the
    driver only then), else the manifest records it as deferred (`stages.media.deferred`)."""
    from stages.media.deferred import deferred_record
    from stages.sample.stage import KINDS
    from stages.shards.writer import ShardSetWriter

    it = cfg.out / f"it{k}"
    columns = ("sample_id", "group_id", "prompt", "negative_prompt", "prompt_meta", *MEDIA_COLUMNS, *TENSORS)
    deferred = {} if stores_media(cfg, k) else deferred_record(cfg.model, cfg.dtype)
    parts = {
        "samples": (
            {c: data[c] for c in columns if c in data},
            {
                "sample_config": asdict(cfg.sampling(k)),
                "family": family.name,
                "modality": family.media,
                **deferred,
            },
        ),
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
