"""The sampler and scorer workers of `omnirl online`, and the driver's handle on them (`Workers`).

Each runs in its own spawned process and loads its model once. Trajectories travel sampler → driver
through a preallocated shared-memory ring (`ring.Ring`, two slots: bounded memory and backpressure);
media go to the scorer, rewards come back on small queues; the trained weights reach an in-process
sampler through shared tensors under a version number (`Workers.publish`).

Lifetimes. Workers end with the driver however it ends: each watches the pipe that `multiprocessing`
keeps open to its parent (EOF = the driver died, even by SIGKILL) and exits; they start with SIGINT
ignored, so Ctrl-C in a terminal reaches only the driver, which stops them (no worker tracebacks).
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stages.errors import RuntimeFailure
from stages.media import MEDIA_COLUMNS, output_modality
from stages.online.config import TENSORS, OnlineConfig, iteration_rows, stores_media
from stages.sample.rollout import LATENT_DTYPES
from stages.update.config import UpdateConfig

POLL = 0.5  # seconds between checks that the awaited worker is still alive


def trainable_weights(policy: Any, cfg: UpdateConfig) -> dict[str, torch.Tensor]:
    """The trained parameters of `policy`'s transformer by name, a LoRA added first unless it has one or
    `cfg.full`: the driver publishes them, the in-process sampler copies them in under the same names."""
    if not policy.lora and not cfg.full:
        policy.add_lora(rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed)
    policy.trainable_parameters(full=cfg.full)
    return {n: p for n, p in policy.transformer.named_parameters() if p.requires_grad}


def sampler_policy(
    cfg: OnlineConfig, adapter: Path | None, device: Any
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The in-process sampler's policy (`FlowPolicy`, `adapter` on) and its trained parameters by name,
    which it copies the published weights into: the trainer's LoRA layout (`trainable_weights`) and
    kernels (online's --attention-backend, --compile); one process, so no model parallelism."""
    from stages.models.diffusion import FlowPolicy
    from stages.models.kernels import prepare
    from stages.parallelism import ModelParallel

    policy = FlowPolicy.load(cfg.model, adapter=adapter, device=device, dtype=cfg.dtype)
    params = trainable_weights(policy, cfg.update)
    prepare(policy.parts, ModelParallel(), cfg.update.kernels)
    return policy, params


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
    run: str,
) -> None:
    """Worker: sample iterations start..iterations−1, each with weights no staler than max_staleness:
    in-process on `device` (the trainer's) with the weights of the shared tensors, or on the engine
    the driver pushes them to (module docstring).

    `version` counts published updates (iterations); `step` is their optimizer step, recorded per sample.
    Every batch names where it was sampled, so the driver can report it; `run` (the digest of the run's
    identity) with the iteration makes each iteration's rollout id.
    """
    from stages.models.condition_images import RECORD as CONDITION_IMAGES
    from stages.models.condition_images import images_digest
    from stages.models.conditioning import CONDITIONING, to_bytes
    from stages.online.ring import RingClosed
    from stages.sample.engines import DiffusersEngine, open_engine
    from stages.sample.stage import in_rollout, sample_shard
    from stages.shards.manifest import config_hash

    _exit_with_parent()
    torch.set_num_threads(cfg.threads)
    params: dict[str, torch.Tensor] = {}
    if cfg.in_process:
        policy, params = sampler_policy(cfg, adapter, device)
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
                keys = {
                    (r.prompt.text, r.prompt.negative, length, images_digest(r.prompt.images))
                    for r in iteration_rows(cfg, k)
                }
                entries = engine.conditioning(sorted(keys)) or {}
                if len(entries) != len(keys):  # a server whose weights changed a text encoder meanwhile
                    raise RuntimeFailure(
                        f"--engine {cfg.engine}: it returned the prompt conditioning of {len(entries)} of "
                        f"iteration {k}'s {len(keys)} prompts; restart the server without a text-encoder LoRA"
                    )
                meta[CONDITIONING] = to_bytes(entries)
            groups = dict(zip(cols["group_id"], (r.prompt.images for r in iteration_rows(cfg, k))))
            sources = {}
            if any(groups.values()):  # the prompts' condition images, once per group (`images_of`)
                meta[CONDITION_IMAGES] = groups
                sources = {"group_id": cols["group_id"], CONDITION_IMAGES: groups}  # for edit rewards
            media = {name: cols[name] for name in MEDIA_COLUMNS if name in cols}
            to_scorer.put(
                {
                    "k": k,
                    "sample_id": cols["sample_id"],
                    "prompt": cols["prompt"],
                    "prompt_meta": cols["prompt_meta"],
                    **sources,
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
    from stages.models.condition_images import RECORD as CONDITION_IMAGES
    from stages.score.stage import score_shard

    _exit_with_parent()
    torch.set_num_threads(cfg.threads)
    while True:
        job = inbox.get()
        if job is None:
            return
        try:
            sources = job.pop(CONDITION_IMAGES, None)
            modality = output_modality(list(job))
            scored = score_shard(
                job,
                cfg.rewards,
                modality=modality,
                reward_args=cfg.reward_args,
                batch_size=cfg.score_batch_size,
                on_error=cfg.on_error,
                mixed_precision=cfg.sample.mixed_precision,
                condition_images=sources,
            )
            outbox.put({"k": job["k"], **scored})
        except Exception as exc:  # reported by the driver with the worker's name
            outbox.put({"k": job["k"], "error": f"{type(exc).__name__}: {exc}"})


class Workers:
    """The spawned sampler and scorer, and the channels between them and the driver.

    The sampler starts at iteration `start` with `weights` (shared, published to after each update; none
    when the driver pushes them to a remote engine) at optimizer step `step`; `run` names the run in its
    rollout ids (`_sampler_main`).
    """

    def __init__(
        self,
        cfg: OnlineConfig,
        start: int,
        adapter: Path | None,
        weights: dict[str, torch.Tensor],
        step: int,
        latent: tuple[int, ...],
        device: Any,
        run: str,
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
                    run,
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
