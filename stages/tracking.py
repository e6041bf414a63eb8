"""Experiment trackers for a run (`--report-to`), through Accelerate's tracking API.

Any tracker Accelerate has a class for can be named (`accelerate.tracking.LOGGER_TYPE_TO_CLASS`:
tensorboard, wandb, trackio, mlflow, comet_ml, aim, clearml, dvclive, swanlab); one whose package is
not installed is a usage error naming the pip package.

One run, one tracker run. A run's stages are separate processes (sample, score, update ... per
iteration), so every process derives the same identity from the run directory: the folder above the
`it<K>` folder of its output (`runs/x/it3/policy` → `runs/x`), the `online`/`report` directory itself,
or else the folder holding the output. The run's name is that folder's name (`x`) unless --run-name
gives one. `RUN/tracking/run.json` holds a random token written once by the first process that
tracks (first writer wins); the tracker run id is `<name>-<token>`, so every process of the run
resumes one tracker run (W&B `id` + `resume="allow"`, Trackio's run name, the MLflow run id recorded in
`RUN/tracking/mlflow-<id>.json`, TensorBoard's `RUN/tracking/tensorboard/<name>` log dir) while a
new run in a re-created folder starts a new one. Only rank 0 of a launch logs.

Steps. The actor metrics of `update`/`online` are logged at the global optimizer step (metrics.jsonl's
`step`), the reward statistics, image grids and response sheets at the iteration K. A held-out
evaluation's rewards (`RUN/it<K>/eval/rewards`, recipes/eval.mk's layout: `held_out`) are their own
series, `eval`, under their own keys (`eval/reward/mean` ...): they never land on the training curve,
whichever of the two scores of an iteration finishes first. W&B keeps one
monotone step per run, so there each point carries its axis as a value (`step` or `iteration`, set as
the key's `step_metric`) instead of a W&B step; the other trackers take the step itself.

Idempotence. `RUN/tracking/sent.jsonl` records each point sent, as (tracker, run id, series, step).
A point already recorded for that tracker run is never sent again, whoever sent it: `report
--report-to` replays exactly the points the live stages did not send (all of them for a run that was
not tracked), a second `report` sends nothing, and a re-run of a crashed stage does not repeat the
steps it had logged. Deleting `RUN/tracking` starts the tracking of the run over.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stages.errors import UserInputError
from stages.reporting import EVAL_DIR

TRACKING_DIR = "tracking"
RUN_FILE = "run.json"
LEDGER = "sent.jsonl"
# The pip package of each tracker Accelerate knows, where it differs from the tracker's name.
PIP_PACKAGES = {"comet_ml": "comet-ml"}
KNOWN = ("tensorboard", "wandb", "trackio", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab")
# The x axis of each series (W&B's step_metric; the others take it as their step).
AXES = {
    "update": "step",
    "score": "iteration",
    EVAL_DIR: "iteration",
    "grid": "iteration",
    "responses": "iteration",
    "rollout": "iteration",
    "critic": "iteration",
    "timing": "iteration",
}
# The stages whose time `timing_metrics` also states per image (verl-omni's compute stages).
PER_IMAGE_STAGES = ("gen", "ref", "old_log_prob", "adv", "update_actor")
# Trackers whose `log` takes a Markdown string (TensorBoard renders it as text).
TEXT_TRACKERS = ("tensorboard", "wandb")
PROJECT = "omnirl"
_ITER_DIR = re.compile(r"^it(\d+)$")


def timing_metrics(seconds: Mapping[str, float], images: int) -> dict[str, float]:
    """verl-omni's timing names of one iteration: `timing_s/<stage>` for every stage timed (seconds),
    and `timing_per_image_ms/<stage>` (milliseconds ÷ images) for the compute stages `PER_IMAGE_STAGES`."""
    metrics = {f"timing_s/{name}": value for name, value in seconds.items()}
    per_image = {
        f"timing_per_image_ms/{name}": value * 1000 / images
        for name, value in seconds.items()
        if name in PER_IMAGE_STAGES and images
    }
    return {**metrics, **per_image}


def parse_report_to(values: str | Iterable[str] | None) -> list[str]:
    """Tracker names of `--report-to` (repeatable, each comma-separated; `none` for none, `all` for every
    installed one), in order, once each. An unknown or not installed tracker is a UserInputError."""
    items = [values] if isinstance(values, str) else list(values or [])
    names = list(dict.fromkeys(n.strip().lower() for v in items for n in str(v).split(",") if n.strip()))
    names = [n for n in names if n != "none"]
    if not names:
        return []
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    supported = list(LOGGER_TYPE_TO_CLASS)
    if "all" in names:
        return [n for n in supported if installed(n)]
    for name in names:
        if name not in supported:
            raise UserInputError(
                f"--report-to {name}: not a tracker Accelerate supports; choose from {', '.join(supported)}"
            )
        if not installed(name):
            package = PIP_PACKAGES.get(name, name)
            raise UserInputError(
                f"--report-to {name}: the {package} package is not installed; pip install {package}"
            )
    return names


def installed(name: str) -> bool:
    """Whether tracker `name`'s package can be imported here (Accelerate's own availability check)."""
    import accelerate.utils

    check = getattr(accelerate.utils, f"is_{name}_available", None)
    return bool(check()) if check is not None else True


def run_location(path: Path) -> tuple[Path, int | None]:
    """(run directory, iteration K) of an output path: the folder above its `it<K>` folder, else the folder
    holding it (K None)."""
    path = Path(os.path.abspath(path))
    for parent in (path, *path.parents):
        if m := _ITER_DIR.match(parent.name):
            return parent.parent, int(m.group(1))
    return path.parent, None


def held_out(path: Path) -> bool:
    """Whether an output path belongs to a held-out evaluation: `RUN/it<K>/eval/...` (`EVAL_DIR`, the
    layout recipes/eval.mk writes and `report` reads), not to the training rollout of iteration K."""
    path = Path(os.path.abspath(path))
    for child, parent in zip((path, *path.parents), path.parents):
        if _ITER_DIR.match(parent.name):
            return child.name == EVAL_DIR
    return False


def _claim(path: Path, value: dict[str, Any]) -> dict[str, Any]:
    """`path`'s JSON, writing `value` there first if it does not exist yet (the first writer wins)."""
    from stages.shards.atomic import temp_name

    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(path)
        tmp.write_text(json.dumps(value))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return json.loads(path.read_text())


class Tracking:
    """The trackers of one run, started on first use in rank 0 only; a no-op without trackers.

    run: the run directory (its `tracking/` folder holds the run token, the ledger and local logs);
    name: the tracker run's name (default: the run directory's name).
    """

    def __init__(self, trackers: Iterable[str], run: Path, name: str | None = None):
        self.names = list(trackers)
        self.dir = Path(os.path.abspath(run)) / TRACKING_DIR
        self.name = name or Path(os.path.abspath(run)).name
        self._trackers: dict[str, Any] = {}
        self._sent: set[tuple[str, str, str, int]] | None = None
        self._defined: set[tuple[str, str]] = set()
        self._run_id: str | None = None
        self.sent = 0

    def __bool__(self) -> bool:
        return bool(self.names)

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def run_id(self) -> str:
        """`<name>-<token>`: the same in every process of the run (see the module docstring)."""
        if self._run_id is None:
            token = _claim(self.dir / RUN_FILE, {"token": secrets.token_hex(4)})["token"]
            slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", self.name).strip("-") or "run"
            self._run_id = f"{slug}-{token}"
        return self._run_id

    def log_update(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Actor metrics (metrics.jsonl records) at their global optimizer step."""
        for record in records:
            values = {
                k: v
                for k, v in record.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            self.log("update", int(record["step"]), values)

    def log_rewards(
        self,
        iteration: int,
        rewards: Mapping[str, Any],
        meta: Sequence[Any] | None = None,
        messages: Sequence[Any] | None = None,
        *,
        held_out: bool = False,
    ) -> None:
        """Mean and std of each reward column (score's `reward/mean`, `reward.<name>/std` ...) at
        `iteration`, and with the rows' prompt_meta `meta` (and a VLM rollout's chat `messages`) the means
        per tag, data source and media kind (`reward_statistics`: `reward/source/<name>/mean`,
        `reward.accuracy/media/image/mean` ...). A `held_out` evaluation's go to the series `eval`, each
        key prefixed with `eval/`."""
        from stages.reporting import reward_statistics

        stats = reward_statistics(rewards, meta, messages)
        if held_out:
            self.log(EVAL_DIR, iteration, {f"{EVAL_DIR}/{key}": value for key, value in stats.items()})
        else:
            self.log("score", iteration, stats)

    def log_grid(self, iteration: int, png: Path) -> None:
        """An image grid (`report`'s it<K>/grid.png) at `iteration`, to the trackers that take images."""
        self.log("grid", iteration, images={"samples/grid": png})

    def log_responses(self, iteration: int, sheet: Path) -> None:
        """A VLM response sheet (Markdown) at `iteration`, to the trackers that take text."""
        self.log("responses", iteration, text={"samples/responses": sheet.read_text()})

    def log(
        self,
        series: str,
        step: int,
        values: Mapping[str, float] | None = None,
        *,
        images: Mapping[str, Path] | None = None,
        text: Mapping[str, str] | None = None,
    ) -> None:
        """Send one point of `series` at `step` to every tracker that has not got it yet (see the ledger)."""
        from stages.dist import world_and_rank

        if not self.names or world_and_rank()[1] != 0:
            return
        run_id = self.run_id
        sent = self._ledger()
        for name in self.names:
            key = (name, run_id, series, step)
            if key in sent:
                continue
            tracker = self._tracker(name, run_id)
            if values:
                self._send(name, tracker, series, step, dict(values))
            if text and name in TEXT_TRACKERS:
                self._send(name, tracker, series, step, dict(text))
            if images and hasattr(tracker, "log_images"):
                self._send_images(name, tracker, series, step, images)
            with open(self.dir / LEDGER, "a") as fh:
                fh.write(json.dumps({"tracker": name, "run": run_id, "series": series, "step": step}) + "\n")
            sent.add(key)
            self.sent += 1

    def close(self) -> None:
        """Finish the trackers this process started."""
        for tracker in self._trackers.values():
            tracker.finish()
        self._trackers.clear()

    def _ledger(self) -> set[tuple[str, str, str, int]]:
        if self._sent is None:
            self._sent = set()
            path = self.dir / LEDGER
            lines = path.read_text().splitlines() if path.is_file() else []
            for line in lines:
                try:
                    r = json.loads(line)
                    self._sent.add((r["tracker"], r["run"], r["series"], int(r["step"])))
                except (ValueError, KeyError, TypeError):  # a line cut short by a kill: not sent for sure
                    continue
        return self._sent

    def _tracker(self, name: str, run_id: str) -> Any:
        """Tracker `name` of this run, built and started on first use (Accelerate's classes)."""
        if name in self._trackers:
            return self._trackers[name]
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        cls = LOGGER_TYPE_TO_CLASS[name]
        mlflow_file = self.dir / f"mlflow-{run_id}.json"
        if name == "tensorboard":
            tracker = cls(self.name, str(self.dir / "tensorboard"))
        elif name == "wandb":
            self.dir.mkdir(parents=True, exist_ok=True)
            project = os.environ.get("WANDB_PROJECT", PROJECT)
            tracker = cls(project, name=self.name, id=run_id, resume="allow", dir=str(self.dir))
        elif name == "trackio":
            tracker = cls(os.environ.get("TRACKIO_PROJECT", PROJECT), name=run_id, resume="allow")
        elif name == "mlflow":
            recorded = json.loads(mlflow_file.read_text())["run_id"] if mlflow_file.is_file() else None
            tracker = cls(experiment_name=PROJECT, run_id=recorded, run_name=self.name)
        elif cls.requires_logging_directory:
            tracker = cls(self.name, str(self.dir / name))
        else:
            tracker = cls(self.name)
        tracker.start()
        if name == "mlflow":
            _claim(mlflow_file, {"run_id": tracker.tracker.info.run_id})
        self._trackers[name] = tracker
        return tracker

    def _send(self, name: str, tracker: Any, series: str, step: int, values: dict[str, Any]) -> None:
        if name != "wandb":
            tracker.log(values, step=step)
            return
        axis = AXES[series]
        for key in values:
            if (key, axis) not in self._defined:
                tracker.tracker.define_metric(key, step_metric=axis)
                self._defined.add((key, axis))
        tracker.log({**values, axis: step})

    def _send_images(
        self, name: str, tracker: Any, series: str, step: int, images: Mapping[str, Path]
    ) -> None:
        import numpy as np
        from PIL import Image

        arrays = {k: np.asarray(Image.open(p).convert("RGB"))[None] for k, p in images.items()}
        if name == "tensorboard":
            tracker.log_images(arrays, step=step, dataformats="NHWC")
        elif name == "wandb":
            import wandb

            self._send(name, tracker, series, step, {k: [wandb.Image(a[0])] for k, a in arrays.items()})
        else:
            tracker.log_images(arrays, step=step)


def open_tracking(report_to: str | Iterable[str] | None, out: Path, run_name: str | None = None) -> Tracking:
    """The trackers of `--report-to` for a stage writing `out` (the run directory is `run_location`'s).
    Checks the names and packages now, so a bad --report-to fails before any work."""
    return Tracking(parse_report_to(report_to), run_location(out)[0], run_name)


def replay(tracking: Tracking, run: Path, sheets: Iterable[tuple[int, Path]] = ()) -> int:
    """Send a finished run's reward statistics (it<K>/rewards, and the held-out evaluation's
    it<K>/eval/rewards as `eval`), actor metrics (it<K>/policy/metrics.jsonl) and the report's `sheets`
    (grid PNGs, response Markdown) of iteration K to `tracking`; points already sent are skipped (the
    ledger). Returns the points sent now."""
    from stages.reporting import iterations
    from stages.shards.manifest import MANIFEST_NAME
    from stages.shards.reader import ShardSet
    from stages.update.checkpoint import METRICS

    before = tracking.sent
    for k, it in iterations(run):
        for where, evaluation in ((it, False), (it / EVAL_DIR, True)):
            if not (where / "rewards" / MANIFEST_NAME).is_file():
                continue
            prompts: dict = {}
            samples = where / "samples"
            if (samples / MANIFEST_NAME).is_file():
                held = ShardSet(samples)
                prompts = held.read_all([c for c in ("prompt_meta", "messages") if c in held.columns])
            rewards = ShardSet(where / "rewards").read_all()
            tracking.log_rewards(
                k, rewards, prompts.get("prompt_meta"), prompts.get("messages"), held_out=evaluation
            )
        metrics = it / "policy" / METRICS
        if metrics.is_file():
            tracking.log_update(json.loads(line) for line in metrics.read_text().splitlines() if line.strip())
    for k, path in sheets:
        if path.suffix == ".png":
            tracking.log_grid(k, path)
        else:
            tracking.log_responses(k, path)
    return tracking.sent - before
