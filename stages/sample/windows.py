"""Which denoising steps are stochastic and stored (hence trained): SDE windows.

Steps outside the window are deterministic Euler (noise level 0) and are not stored. Strategies:

- `all`: every step is SDE and stored (original Flow-GRPO and DanceGRPO; their training then picks a
  subset, e.g. Flow-GRPO trains the first int(N·timestep_fraction) steps — the update stage's business).
- `random`: Flow-GRPO-Fast; a window of `window` steps starting uniformly in [lo, hi − window], drawn
  from a generator seeded by (seed, iteration), so each prompt group can get its own reproducible window
  (the rollout passes a seed derived from the run seed and the group, never from a batch or shard).
- `progressive`: MixGRPO's sliding window; it starts at lo (0) and moves by `stride` every
  `iters_per_group` iterations; steps at or past hi (default N − 2, MixGRPO's `max_timesteps`) are never
  in the window, so the window shrinks near the end; once no step is left it rolls back to its first
  start (or, without `roll_back`, stays on the last step).
- `fixed`: always the window at `start` (default lo).

Step indices are 0-based: step i goes from sigmas[i] to sigmas[i + 1].
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stages.errors import UserInputError
from stages.knobs import WINDOW_STRATEGIES

STRATEGIES = ("all", *WINDOW_STRATEGIES)  # all: every step stochastic (--sde-window 0)


def _window_range(num_steps: int, window_range: tuple[int, int] | None, default_hi: int) -> tuple[int, int]:
    lo, hi = (0, default_hi) if window_range is None else (int(window_range[0]), int(window_range[1]))
    if not 0 <= lo < hi <= num_steps:
        raise UserInputError(
            f"--sde-window-range {lo} {hi} is not within the {num_steps} sampling steps: "
            f"give 0 <= lo < hi <= {num_steps}"
        )
    return lo, hi


def window_steps(
    num_steps: int, *, window: int, window_range: tuple[int, int] | None = None, start: int | None = None
) -> list[int]:
    """The step indices of the window [start, start + window) inside window_range (default (0, N)).

    `start` defaults to the range's low end. window 0 is Flow-GRPO-Fast's no-window setting: every step
    but the last one, 0..N−2.
    """
    if num_steps < 1:
        raise UserInputError(f"num_steps={num_steps}: the number of sampling steps must be at least 1")
    if window == 0:
        return list(range(num_steps - 1))
    lo, hi = _window_range(num_steps, window_range, num_steps)
    if not 1 <= window <= hi - lo:
        raise UserInputError(
            f"--sde-window {window} does not fit in --sde-window-range {lo} {hi}: give 0 <= window <= {hi - lo}"
        )
    start = lo if start is None else int(start)
    if not lo <= start <= hi - window:
        raise UserInputError(f"window start {start} is outside [{lo}, {hi - window}] for window {window}")
    return list(range(start, start + window))


class WindowSchedule:
    """Per-iteration choice of the stochastic, stored steps (see the module docstring for strategies).

    The schedule walks forward through iterations; `to_state()` / `from_state()` save and restore it as a
    small JSON-able dict, so a resumed run continues exactly where it stopped.
    """

    def __init__(
        self,
        num_steps: int,
        strategy: str = "all",
        *,
        window: int = 0,
        window_range: tuple[int, int] | None = None,
        start: int | None = None,
        iters_per_group: int = 25,
        stride: int = 1,
        roll_back: bool = True,
    ) -> None:
        if strategy not in STRATEGIES:
            raise UserInputError(
                f"unknown window strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}"
            )
        if num_steps < 1:
            raise UserInputError(f"num_steps={num_steps}: the number of sampling steps must be at least 1")
        self.num_steps = num_steps
        self.strategy = strategy
        self.window = window
        self.window_range = None if window_range is None else (int(window_range[0]), int(window_range[1]))
        self.start = start
        self.iters_per_group = iters_per_group
        self.stride = stride
        self.roll_back = roll_back
        if strategy == "all" and window != 0:
            raise UserInputError(
                f"--sde-window {window} with strategy 'all': 'all' makes every step stochastic; "
                "use strategy random, progressive or fixed for a window"
            )
        if strategy in ("random", "fixed"):
            window_steps(num_steps, window=window, window_range=window_range, start=start)
        if strategy == "progressive":
            self._lo, self._hi = _window_range(num_steps, window_range, max(num_steps - 2, 1))
            if window < 1:
                raise UserInputError(f"--sde-window {window}: a progressive window needs at least 1 step")
            if iters_per_group < 1 or stride < 0:
                raise UserInputError(
                    f"iters_per_group={iters_per_group}, stride={stride}: give iters_per_group >= 1, stride >= 0"
                )
            self._first = self._lo if start is None else int(start)
            if not self._lo <= self._first < self._hi:
                raise UserInputError(f"window start {self._first} is outside [{self._lo}, {self._hi})")
        self.iteration = 0
        self.current_start = self._first if strategy == "progressive" else None
        self.iter_in_group = 0

    def _advance(self) -> None:
        self.iteration += 1
        if self.strategy != "progressive":
            return
        self.iter_in_group += 1
        if self.iter_in_group < self.iters_per_group:
            return
        self.iter_in_group = 0
        self.current_start += self.stride
        if self.current_start >= self._hi:
            self.current_start = self._first if self.roll_back else self._hi - 1

    def steps_for_iteration(self, iteration: int, seed: int = 0) -> list[int]:
        """Sorted step indices that are stochastic and stored at `iteration` (≥ the last one asked).

        `seed` (non-negative) only matters for `random`: the window start is drawn from a generator
        seeded by (seed, iteration), e.g. a seed derived from the run seed and the prompt group.
        """
        if iteration < self.iteration:
            raise ValueError(
                f"window schedule is at iteration {self.iteration}; it cannot go back to {iteration} "
                "(restore an earlier to_state() instead)"
            )
        if self.strategy != "progressive":
            self.iteration = iteration  # only the progressive window has a state to walk through
        while self.iteration < iteration:
            self._advance()
        if self.strategy == "all":
            return list(range(self.num_steps))
        if self.strategy == "fixed":
            return window_steps(
                self.num_steps, window=self.window, window_range=self.window_range, start=self.start
            )
        if self.strategy == "random":
            if self.window == 0:
                return window_steps(self.num_steps, window=0)
            lo, hi = _window_range(self.num_steps, self.window_range, self.num_steps)
            start = int(np.random.default_rng([seed, iteration]).integers(lo, hi - self.window + 1))
            return window_steps(self.num_steps, window=self.window, window_range=(lo, hi), start=start)
        return list(range(self.current_start, min(self.current_start + self.window, self._hi)))

    def to_state(self) -> dict[str, Any]:
        """Configuration and position as a JSON-able dict."""
        return {
            "num_steps": self.num_steps,
            "strategy": self.strategy,
            "window": self.window,
            "window_range": None if self.window_range is None else list(self.window_range),
            "start": self.start,
            "iters_per_group": self.iters_per_group,
            "stride": self.stride,
            "roll_back": self.roll_back,
            "iteration": self.iteration,
            "current_start": self.current_start,
            "iter_in_group": self.iter_in_group,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> WindowSchedule:
        """Rebuild a schedule saved by `to_state()`, positioned where it was."""
        try:
            schedule = cls(
                int(state["num_steps"]),
                str(state["strategy"]),
                window=int(state["window"]),
                window_range=None if state["window_range"] is None else tuple(state["window_range"]),
                start=None if state["start"] is None else int(state["start"]),
                iters_per_group=int(state["iters_per_group"]),
                stride=int(state["stride"]),
                roll_back=bool(state["roll_back"]),
            )
            schedule.iteration = int(state["iteration"])
            schedule.current_start = None if state["current_start"] is None else int(state["current_start"])
            schedule.iter_in_group = int(state["iter_in_group"])
        except (KeyError, TypeError, ValueError) as err:
            raise UserInputError(
                f"window schedule state is incomplete or malformed ({err!r}): re-create it"
            ) from err
        return schedule
