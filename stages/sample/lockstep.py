"""The pipelines of `omnirl serve`, on one process or on the ranks of a sequence/tensor-parallel group.

A single-process server loads, swaps and runs its pipelines here directly. Under a launcher with
--sp-degree / --tp-degree k over exactly k ranks (one model group, dp = 1), rank 0 (the leader) binds
the HTTP server, checks every request and decides every change of weights, as one process does; each
call it makes on a pipeline here (`open`, `set_lora`, `rollout`, `drop`) it first broadcasts to the
other ranks (the followers, `follow`), which make the same call on their own copy with the same
arguments (the same seeds, so the same noise): the collectives inside the spread transformer (Ulysses
all-to-all, tensor-parallel reductions) then meet, and the leader replies with what its rank computed.

Before each denoising step the leader broadcasts whether the batch stops there (its client hung up), so
every rank stops at the same step. A follower never serves and prints nothing. It leaves when the leader
`close`s the group (the server stopped); signalled itself (torchrun forwards SIGTERM to every rank) it
finishes the call it is making and leaves at the leader's word, or after `GRACE_S` seconds without one.

Messages are the arguments the leader built after checking what it was sent, broadcast between the
launcher's own ranks with torch.distributed's object collectives (as `stages.dist.gather`).
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from stages.dist import device, join, world_and_rank
from stages.errors import UserInputError
from stages.models.kernels import Kernels, prepare
from stages.parallelism import LAUNCH, ModelParallel, layout
from stages.sample.engines import DiffusersEngine
from stages.web import ClientGone

logger = logging.getLogger(__name__)
GRACE_S = 10.0  # seconds a signalled follower waits for the leader's word before it leaves
_POLL_S = 0.02  # how often an idle follower looks for the leader's next call (and for signals)
_STOP, _CALL = 0, 1  # what the leader's header announces


def _option(parallel: ModelParallel) -> str:
    return (
        f"--sp-degree {parallel.sp_degree}" if parallel.sp_degree > 1 else f"--tp-degree {parallel.tp_degree}"
    )


class Pipelines:
    """The pipelines a server holds, each opened, changed and run by every rank of its group together.

    `model`, `dtype`, `device`: what every pipeline loads (a rank's own device); `parallel`: how each is
    spread over the launcher's ranks, which must be exactly `parallel.degree` of them (one group);
    `kernels`: the attention backend and compilation each transformer runs. Every rank builds this; then
    the leader (`leads`) serves and the others `follow`."""

    def __init__(
        self,
        model: Path,
        *,
        dtype: str,
        device: Any,
        parallel: ModelParallel | None = None,
        kernels: Kernels | None = None,
    ):
        self.model, self.dtype, self.device = model, dtype, device
        self.parallel = parallel or ModelParallel()
        self.kernels = kernels or Kernels()
        self.kernels.validate()  # a backend this machine lacks: one line before anything loads
        world, rank = join()
        degree = self.parallel.degree
        if world != degree:
            if degree == 1:
                raise UserInputError(
                    f"omnirl serve under a launcher of {world} ranks: a server is one model group (dp 1); "
                    f"pass --sp-degree {world} to spread its model over them, or start it without a launcher"
                )
            raise UserInputError(
                f"{_option(self.parallel)}: omnirl serve spreads one model over exactly {degree} ranks "
                f"(dp 1), and {world} were launched; launch it with {LAUNCH}, N = {degree}"
            )
        layout(self.parallel)  # checks the settings; the device mesh
        self.leads = rank == 0
        self.followers = world > 1
        self.lock = threading.RLock()  # a call and the collectives it makes, one at a time
        self._ids = itertools.count()
        self._held: dict[int, DiffusersEngine] = {}  # id → pipeline (the leader's ids)

    # ---------------------------------------------------------------- the leader's calls
    def open(self, adapter: str | Path | None) -> DiffusersEngine:
        """A new pipeline of the model with `adapter` (None: the base model), spread over the group."""
        with self.lock:
            key = next(self._ids)
            self._send("open", key, None if adapter is None else str(adapter))
            return self._open(key, adapter)

    def set_lora(self, engine: DiffusersEngine, layers: Any, config: Any) -> str:
        """`FlowPolicy.set_lora` on `engine` (and its copy on every rank); how it was done. Refused
        under tensor parallelism, whose plan shards no LoRA layer."""
        if layers is not None and self.parallel.tp_degree > 1:
            raise UserInputError(
                f"--tp-degree {self.parallel.tp_degree}: diffusers' tensor-parallel plan does not shard LoRA "
                "layers; serve a full fine-tune, or this LoRA with --sp-degree"
            )
        with self.lock:
            self._send("set_lora", self._key(engine), layers, config)
            return engine.policy.set_lora(layers, config)

    def rollout(
        self, engine: DiffusersEngine, *args: Any, on_step: Callable[[int], None], **kwargs: Any
    ) -> dict[str, Any]:
        """`engine.rollout(*args, **kwargs)` on every rank; `on_step(i)` (the leader's) may stop the
        batch before step i, on every rank together."""
        with self.lock:
            self._send("rollout", self._key(engine), args, kwargs)
            return engine.rollout(*args, on_step=self._leader_step(on_step), **kwargs)

    def drop(self, engine: DiffusersEngine) -> None:
        """Forget `engine` (replaced by another) on every rank."""
        with self.lock:
            key = self._key(engine)
            self._send("drop", key)
            del self._held[key]

    def close(self) -> None:
        """The leader's last word: the followers leave `follow`. A follower already gone is no error."""
        if not (self.leads and self.followers):
            return
        with self.lock:
            try:
                self._header(_STOP)
            except RuntimeError as exc:  # a follower that left first (signalled on its own)
                logger.warning("the serve group's followers were gone before it stopped: %s", exc)

    def _key(self, engine: DiffusersEngine) -> int:
        return next(k for k, e in self._held.items() if e is engine)

    def _open(self, key: int, adapter: str | Path | None) -> DiffusersEngine:
        """Load and spread a pipeline; returns once every rank has (so the leader's ready line, and
        its reply to a weights request, mean the whole group's)."""
        from stages.models.diffusion import FlowPolicy

        try:
            policy = FlowPolicy.load(self.model, adapter=adapter, device=self.device, dtype=self.dtype)
            prepare(policy.parts, self.parallel, self.kernels)
        except Exception:
            self._everyone(False)
            raise
        if not self._everyone(True):
            raise UserInputError(
                f"{adapter or self.model}: another rank of the serve group could not load it (its stderr says why)"
            )
        self._held[key] = engine = DiffusersEngine(policy)
        return engine

    def _everyone(self, ok: bool) -> bool:
        """Whether every rank of the group got here `ok`: a barrier."""
        if not self.followers:
            return ok
        flag = torch.tensor([int(ok)], device=device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def _send(self, *call: Any) -> None:
        if self.followers:
            self._header(_CALL)
            torch.distributed.broadcast_object_list([call], src=0)

    def _header(self, what: int) -> None:
        torch.distributed.broadcast(torch.tensor([what], device=device()), src=0)

    def _leader_step(self, on_step: Callable[[int], None]) -> Callable[[int], None]:
        def step(i: int) -> None:
            try:
                on_step(i)
            except ClientGone:
                self._flag(True)
                raise
            self._flag(False)

        return step if self.followers else on_step

    def _flag(self, stop: bool) -> bool:
        """Whether the batch stops at this step: the leader's `stop`, broadcast to every rank."""
        flag = torch.tensor([int(stop)], device=device())
        torch.distributed.broadcast(flag, src=0)
        return bool(flag.item())

    # ---------------------------------------------------------------- the followers
    def follow(self) -> None:
        """Make every call the leader makes, until it closes the group (module docstring)."""
        with _deferred_signals() as signalled:
            for call in self._calls(signalled):
                try:
                    self._make(*call)
                except (UserInputError, ClientGone) as exc:  # the leader's call failed alike
                    logger.debug("rank %d: %s", world_and_rank()[1], exc)

    def _calls(self, signalled: threading.Event) -> Iterator[tuple[Any, ...]]:
        since: float | None = None
        while True:
            header = torch.tensor([0], device=device())
            work = torch.distributed.broadcast(header, src=0, async_op=True)
            while not work.is_completed():
                if signalled.is_set():
                    since = since or time.monotonic()
                    if time.monotonic() - since > GRACE_S:
                        logger.warning(
                            "rank %d: signalled, and no word from rank 0 for %g s; leaving",
                            world_and_rank()[1],
                            GRACE_S,
                        )
                        return
                time.sleep(_POLL_S)
            work.wait()
            if int(header.item()) == _STOP:
                return
            message: list[Any] = [None]
            torch.distributed.broadcast_object_list(message, src=0)
            yield message[0]

    def _make(self, name: str, key: int, *args: Any) -> None:
        if name == "open":
            self._open(key, args[0])
        elif name == "set_lora":
            self._held[key].policy.set_lora(*args)
        elif name == "rollout":
            positional, kwargs = args
            self._held[key].rollout(*positional, on_step=self._follower_step, **kwargs)
        else:  # drop
            del self._held[key]

    def _follower_step(self, i: int) -> None:
        if self._flag(False):
            raise ClientGone(f"the leader's batch stopped before denoising step {i}")


@contextmanager
def _deferred_signals() -> Iterator[threading.Event]:
    """SIGTERM and SIGINT set the event instead of interrupting (a follower ends the call it makes)."""
    signalled = threading.Event()
    handlers = {
        sig: signal.signal(sig, lambda *_: signalled.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield signalled
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
