"""Resumable pretraining: the step loop of every phase, with checkpoints a re-run continues from.

`omnirl pretrain` runs up to three phases (pixel VAE decoder, its encoder, the transformer), each a loop
of optimizer steps over batches drawn from one seeded generator. `TrainingRun.phase` runs them all: it
reports each step and, every `Checkpoints.every` steps and at the end of a phase, saves what the next
steps depend on to a checkpoint folder (the hidden sibling `.OUT.checkpoint` of the output):

- state.safetensors: the weights of the trained modules, the optimizer's moments and step counts, the
  EMA, the generator's, torch's and the data order's state (the unused rest of the current permutation);
- state.json: the phase, the step, every loss so far, Python's and NumPy's random states, the journal
  of text-encoder batches (`TrainingRun.phase`'s `journal`) and the run's `identity`.

Nothing is unpickled. A save writes a temp folder, fsyncs its files and swaps it into place
(`replace_dir`), so the folder under its name is always a whole checkpoint and a kill at any moment
leaves the previous one. A re-run with the same identity (settings and the content of model and data)
skips the phases the checkpoint finished and restores the one it stopped in, so its output is byte for
byte the output of a run that was never interrupted (same machine and thread count); a re-run with
another identity is refused, naming the first option that differs.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from stages.errors import UserInputError
from stages.shards.atomic import atomic_write_bytes, recover_dir, replace_dir, temp_name

STATE_JSON = "state.json"
STATE_TENSORS = "state.safetensors"
FORMAT = 1

# phase name, step (1-based), loss of that step
OnStep = Callable[[str, int, float], None]


class IndexStream:
    """Batches of row indices: consecutive random permutations of range(n) cut into `batch_size`.

    `pool` holds the indices drawn but not used yet, the data order's state a checkpoint keeps."""

    def __init__(self, n: int, batch_size: int, generator: torch.Generator) -> None:
        self.n, self.batch_size, self.generator = n, batch_size, generator
        self.pool = torch.empty(0, dtype=torch.long)

    def __iter__(self) -> IndexStream:
        return self

    def __next__(self) -> torch.Tensor:
        while self.pool.numel() < self.batch_size:
            self.pool = torch.cat([self.pool, torch.randperm(self.n, generator=self.generator)])
        batch, self.pool = self.pool[: self.batch_size], self.pool[self.batch_size :]
        return batch


class Journal(Protocol):
    """State of a phase kept as JSON: what `state` returns, `restore` rebuilds in a resumed run."""

    def state(self) -> Any: ...

    def restore(self, state: Any) -> None: ...


@dataclass
class Snapshot:
    """One checkpoint: `info` (state.json) and `tensors` (state.safetensors)."""

    info: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def phase(self) -> str:
        return str(self.info["phase"])

    @property
    def step(self) -> int:
        return int(self.info["step"])

    def steps_done(self, phases: Sequence[tuple[str, int]]) -> list[int]:
        """Steps of each (phase, steps) of a run that this checkpoint holds done."""
        names = [name for name, _ in phases]
        at = names.index(self.phase)
        return [steps if i < at else self.step if i == at else 0 for i, (_, steps) in enumerate(phases)]


class Checkpoints:
    """The latest checkpoint of the run writing `out`, in `folder` (.OUT.checkpoint beside `out`), saved
    every `every` steps of each phase and at its end (0: never). `identity` (JSON: `settings` by option
    name, content digests of `inputs` by option name) is what a checkpoint must match to be resumed."""

    def __init__(self, out: str | Path, identity: dict[str, dict[str, Any]], every: int) -> None:
        self.out = Path(out)
        self.folder = self.out.parent / f".{self.out.name}.checkpoint"
        self.identity = json.loads(json.dumps(identity))
        self.every = every
        self.resume: Snapshot | None = None

    def prepare(self, *, overwrite: bool = False) -> Snapshot | None:
        """Clean up after a killed save, then read the checkpoint a re-run continues from (also kept as
        `resume`); None when there is none. One of another run is refused in one line naming the first
        differing option, or with `overwrite` removed (the run starts over)."""
        from safetensors.torch import load_file

        recover_dir(self.folder)
        if not self.folder.exists():
            return None
        try:
            info = json.loads((self.folder / STATE_JSON).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            info = None
        other = self._other_run(info)
        if other is None:
            self.resume = Snapshot(info, load_file(self.folder / STATE_TENSORS))
            return self.resume
        if not overwrite:
            raise UserInputError(
                f"--out {self.out}: its checkpoint {self.folder} {other}; re-run with the options it was "
                "written with to resume, or pass --overwrite to discard it and start over"
            )
        shutil.rmtree(self.folder)
        return None

    def _other_run(self, info: Any) -> str | None:
        """What makes a checkpoint whose state.json holds `info` (None: unreadable) another run's; None
        when it is this run's."""
        if not isinstance(info, dict):
            return f"has no readable {STATE_JSON}"
        recorded = info.get("identity") if info.get("format") == FORMAT else None
        if not isinstance(recorded, dict):
            return "was written by another version of omnirl"
        for section, now in self.identity.items():
            then = recorded.get(section) or {}
            for key in sorted(set(then) | set(now)):
                if then.get(key) != now.get(key):
                    option = f"--{key.replace('_', '-')}"
                    if section == "settings":
                        return f"was written with {option} {then.get(key)}, not {now.get(key)}"
                    return f"was written for another {option} (its files' content differs)"
        return None

    def save(self, snapshot: Snapshot) -> None:
        """Write `snapshot` (with the identity) as the checkpoint, atomically: a complete temp folder
        swapped into place."""
        from safetensors.torch import save

        tmp = temp_name(self.folder)
        tmp.mkdir(parents=True)
        try:
            info = {"format": FORMAT, "identity": self.identity, **snapshot.info}
            tensors = {key: value.detach().cpu().contiguous() for key, value in snapshot.tensors.items()}
            atomic_write_bytes(tmp / STATE_TENSORS, save(tensors))
            atomic_write_bytes(tmp / STATE_JSON, json.dumps(info).encode())
            replace_dir(tmp, self.folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def remove(self) -> None:
        """Delete the checkpoint once the run's output is saved."""
        shutil.rmtree(self.folder, ignore_errors=True)


def _random_state(generator: torch.Generator) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Every random state a step may draw from: the run's generator and torch's (tensors), Python's
    and NumPy's (JSON)."""
    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    info = {"python": [version, list(words), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached]}
    return info, {"random.generator": generator.get_state(), "random.torch": torch.get_rng_state()}


def _restore_random_state(generator: torch.Generator, snapshot: Snapshot) -> None:
    version, words, gauss = snapshot.info["random"]["python"]
    random.setstate((version, tuple(words), gauss))
    name, keys, pos, has_gauss, cached = snapshot.info["random"]["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    generator.set_state(snapshot.tensors["random.generator"])
    torch.set_rng_state(snapshot.tensors["random.torch"])


class TrainingRun:
    """Runs pretraining's phases (`cfg.phases()` names, in order) with one generator, reporting each
    step to `on_step` and checkpointing to `checkpoints` (None: no checkpoints) the weights of `modules`
    (name → module) with the phase's state. With `checkpoints.resume` the modules' weights are restored
    here, the phases it finished are skipped and the one it stopped in continues from its step."""

    def __init__(
        self,
        generator: torch.Generator,
        on_step: OnStep | None = None,
        *,
        phases: Sequence[str] = (),
        modules: dict[str, torch.nn.Module] | None = None,
        checkpoints: Checkpoints | None = None,
    ) -> None:
        self.generator = generator
        self.on_step = on_step
        self.phases = list(phases)
        self.modules = modules or {}
        self.checkpoints = checkpoints
        self.resume = checkpoints.resume if checkpoints else None
        self.losses: dict[str, list[float]] = {}
        if self.resume is not None:
            self.losses = {name: list(losses) for name, losses in self.resume.info["losses"].items()}
            for name, module in self.modules.items():
                prefix = f"module.{name}."
                module.load_state_dict(
                    {
                        k.removeprefix(prefix): v
                        for k, v in self.resume.tensors.items()
                        if k.startswith(prefix)
                    }
                )

    def phase(
        self,
        name: str,
        steps: int,
        optimizer: torch.optim.Optimizer,
        batches: IndexStream,
        take_step: Callable[[int, torch.Tensor], float],
        *,
        ema: list[torch.Tensor] | None = None,
        journal: Journal | None = None,
    ) -> list[float]:
        """Run steps 1..`steps` of phase `name`: `take_step(step, indices)` takes one optimizer step on
        the next batch of `batches` and returns its loss. Returns the phase's losses (restored ones too).
        `ema` (tensors the steps update) and `journal` are the phase's further state."""
        losses = self.losses.setdefault(name, [])
        start = 0
        if self.resume is not None:
            if self.phases.index(name) < self.phases.index(self.resume.phase):
                return losses
            start = self._restore(optimizer, batches, ema, journal)
        every = self.checkpoints.every if self.checkpoints else 0
        for step in range(start + 1, steps + 1):
            losses.append(take_step(step, next(batches)))
            if self.on_step is not None:
                self.on_step(name, step, losses[-1])
            if every and (step % every == 0 or step == steps):
                self._save(name, step, optimizer, batches, ema, journal)
        return losses

    def _restore(
        self,
        optimizer: torch.optim.Optimizer,
        batches: IndexStream,
        ema: list[torch.Tensor] | None,
        journal: Journal | None,
    ) -> int:
        """Put the phase the checkpoint stopped in back as it was; its step. Runs once per run."""
        snapshot, self.resume = self.resume, None
        assert snapshot is not None
        tensors = snapshot.tensors
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("optimizer."):
                _, index, field = key.split(".", 2)
                state.setdefault(int(index), {})[field] = value
        optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
        batches.pool = tensors["batches.pool"]
        with torch.no_grad():
            for i, average in enumerate(ema or []):
                average.copy_(tensors[f"ema.{i}"])
        if journal is not None:
            journal.restore(snapshot.info["journal"])  # before the random states: it may draw
        _restore_random_state(self.generator, snapshot)
        return snapshot.step

    def _save(
        self,
        name: str,
        step: int,
        optimizer: torch.optim.Optimizer,
        batches: IndexStream,
        ema: list[torch.Tensor] | None,
        journal: Journal | None,
    ) -> None:
        assert self.checkpoints is not None
        random_info, tensors = _random_state(self.generator)
        for module_name, module in self.modules.items():
            tensors.update({f"module.{module_name}.{k}": v for k, v in module.state_dict().items()})
        for index, state in optimizer.state_dict()["state"].items():
            tensors.update({f"optimizer.{index}.{field}": value for field, value in state.items()})
        tensors.update({f"ema.{i}": average for i, average in enumerate(ema or [])})
        tensors["batches.pool"] = batches.pool
        info = {
            "phase": name,
            "step": step,
            "losses": self.losses,
            "random": random_info,
            "journal": journal.state() if journal is not None else None,
        }
        self.checkpoints.save(Snapshot(info, tensors))
