"""How a stage command makes its output shard set: its inputs (--in), its identity (the options that
determine it, and the content digests of the weights), the policy it records, the resumable mapping of
input shards to output shards over a launcher's ranks, and the manifest written once every shard exists."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.errors import UserInputError


def policy_version(adapter: Path | None) -> int:
    """The optimizer step of the adapter that samples (0 for the base model)."""
    if adapter is None:
        return 0
    from stages.models.folders import read_adapter_config

    return int(read_adapter_config(adapter).get("step", 0))


def policy_info(model: Path, adapter: Path | None) -> dict[str, Any]:
    """The policy an output records in its manifest: the model, the adapter and its version."""
    return {
        "model": str(model),
        "adapter": str(adapter) if adapter else None,
        "version": policy_version(adapter),
    }


def open_inputs(paths: list[Path] | None) -> Any:
    """Zip the --in shard sets of one rollout row by row."""
    if not paths:
        raise UserInputError("--in: at least one input shard set is required")
    from stages.shards.reader import open_inputs as open_zipped

    return open_zipped(paths)


def map_shards(
    src: Any,
    writer: Any,
    label: str,
    columns: list[str],
    fn: Callable[..., dict[str, Any]],
    *,
    display: Any,
    before_write: Callable[[int, dict[str, Any]], None] | None = None,
) -> list[int]:
    """Write fn(input shard, advance) as output shard i for this process's input shards i not already
    done, advancing `display` (a progress display: `add_task(label, total=, rate=)` and `advance(task,
    rows)`, as `omnirl_cli.console.progress` yields) by the rows of each; returns the shards made here,
    in order. `before_write(i, input shard)` runs before shard i is written: a file beside the shard
    that must exist whenever the shard does (`encode`'s prompt conditioning).

    Shards finished by an earlier (crashed) run are skipped, so every per-shard stage resumes. Under a
    launcher (torchrun, `accelerate launch`) rank r takes the shards s with s % world == r and every rank
    waits for the others at the end, even one without a shard, so `finalize` then sees every shard.
    A row that `fn` cannot decode (`CorruptRowError`) is reported with the input file that holds it.
    """
    from stages.dist import barrier, rank_shards, writes_outputs
    from stages.errors import CorruptRowError, CorruptShardError

    sizes = [info.rows for info in src.manifests[0].shards]
    mine = rank_shards(range(src.num_shards), f"input shards of {label}")
    written = []
    task = display.add_task(label, total=sum(sizes[s] for s in mine), rate="")
    for s in mine:
        if writer.shard_done(s):
            display.advance(task, sizes[s])
            continue
        shard = src.read_shard(s, columns=columns)
        try:
            out = fn(shard, lambda n: display.advance(task, n))
        except CorruptRowError as exc:
            raise CorruptShardError(f"{src.shard_path(s, exc.column)}: {exc}") from exc
        if writes_outputs():  # one rank of a model-parallel group writes what the group computed
            if before_write:
                before_write(s, shard)
            writer.write_shard(s, out)
        written.append(s)
    barrier()
    return written


def loaded(policy: Any) -> dict[str, Any]:
    """What a stage's --json says about the diffusion policy it loaded: `loaded_components` (the pipeline
    components instantiated; none when the output was already complete) and `conditioning` (where its
    prompt conditioning came from: "stored" in the rollout, or why it encodes). A VLM policy adds nothing."""
    if policy is None:
        return {"loaded_components": []}
    if not hasattr(policy, "loaded_components"):
        return {}
    return {"loaded_components": policy.loaded_components, "conditioning": policy.conditioning_source}


def finalize(writer: Any, extra: dict[str, Any] | None = None) -> bool:
    """Write the manifest once every rank's shards exist (after `map_shards`); only rank 0 writes it, and
    every rank returns once it is written, so a command run next in the same processes (a chained
    launch) reads a finished output.

    Returns whether this process reports the result: rank 0 does, the other ranks of a launch return
    quietly (one JSON object on stdout). A complete `writer` is left as it is.
    """
    from stages.dist import barrier, join

    lead = join()[1] == 0
    if lead:
        writer.finalize(extra=extra)
    barrier()
    return lead


def resolve_num_shards(c: dict[str, Any], groups: int, group_rows: int) -> int:
    """Set and return c["num_shards"]: --num-shards, else about --shard-rows rows per shard, rounded up
    to a multiple of the launcher's data-parallel size so that every rank samples (and every later stage,
    which splits by shard, works on every rank).

    A shard holds whole groups (`groups` of `group_rows` rows), so there are at most `groups` shards.
    """
    from stages.dist import data_parallel, join

    if c["num_shards"] is None:
        rows = groups * group_rows
        join()
        world = data_parallel()[0] if c.get("shard_index") is None else 1  # a Slurm task is one shard already
        by_rows = max(1, -(-rows // c["shard_rows"]))
        c["num_shards"] = max(1, min(groups, -(-by_rows // world) * world))
    return c["num_shards"]


def check_format(fmt: str) -> str:
    if fmt not in ("parquet", "webdataset"):
        raise UserInputError(f"--format {fmt}: choose parquet or webdataset")
    return fmt


# Options that say where and how the output is stored or reported, never what it holds. A Slurm
# array task (--shard-index) shares its run's identity, so the tasks complete one shard set together;
# the writer adds the format and shard count to the fingerprint of the files themselves.
NOT_IDENTITY = (
    "json_",
    "overwrite",
    "shard_index",
    "out",
    "fmt",
    "num_shards",
    "shard_rows",
    "strategy",
    "gradient_checkpointing",
    "sp_degree",
    "sp_kind",
    "tp_degree",
    "compile",
    "report_to",
    "run_name",
    "server_token_env",
    "server_timeout",
    "server_startup_timeout",
    "server_retries",
)
# Options that say where a diffusion rollout runs (`stages.sample.engines`): every engine computes the
# same samples, so they stay out of a diffusion rollout's identity (a VLM's engine changes its output).
ROLLOUT_PLACEMENT = ("engine", "server_url")
# Options naming the weights that determine the output: their content digests join the identity, so
# a re-run under retrained or replaced weights redoes the work. (Prompt files and plugin sources are
# parents of the output, with their sha256, in its lineage.)
CONTENT_OPTIONS = ("model", "adapter")


def run_config(resolved: dict[str, Any], exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The config recorded (and hashed) for an output: the resolved options that determine it (not
    `NOT_IDENTITY`, nor `exclude`, nor an attention backend that agrees with native to rounding: the
    --attention-backend, else DIFFUSERS_ATTN_BACKEND from the environment, is recorded when quantized), plus
    `model_sha256` / `adapter_sha256` content digests.

    Input shard sets, prompt files and plugin files enter the output's identity through the writer's
    lineage (`parents`).
    """
    from stages.shards.digest import content_digest

    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return str(v) if isinstance(v, Path) else v

    config = {k: plain(v) for k, v in resolved.items() if k not in NOT_IDENTITY and k not in exclude}
    if "attention_backend" in config:
        from stages.models.kernels import active_backend, changes_numbers

        backend = active_backend(config["attention_backend"])  # the option, else DIFFUSERS_ATTN_BACKEND
        if changes_numbers(backend):
            config["attention_backend"] = backend
        else:  # native, or native's to rounding
            del config["attention_backend"]
    for key in CONTENT_OPTIONS:
        if resolved.get(key) is not None:
            config[f"{key}_sha256"] = content_digest(resolved[key], f"--{key.replace('_', '-')}")
    return config


def plugin_files(names: list[str]) -> list[Path]:
    """The Python files named by 'path/to/file.py:attribute' plugin names, once each (for lineage)."""
    from stages.plugins import spec_file

    return list(dict.fromkeys(f for f in map(spec_file, names) if f is not None))
