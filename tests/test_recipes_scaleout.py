"""The shipped scale-out recipes: recipes/accelerate/*.yaml, the Slurm profile and the sbatch scripts.

Accelerate configs are read with accelerate's own loader and turned into the environment
`accelerate launch` gives its processes (its argument parser, config merge and env builder), then
`update`'s strategy resolution and Accelerate's FSDP plugin read that environment. The sbatch scripts
run under bash with stand-ins for srun/sbatch/scontrol/accelerate/omnirl that record their argument
lists, which then go through accelerate's launch parser and omnirl's own command parser.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = ROOT / "recipes" / "accelerate"
SLURM = ROOT / "recipes" / "slurm"
# file → (distributed_type, num_processes, mixed_precision, the strategy `update --strategy auto` resolves)
DECLARED = {
    "1gpu.yaml": ("NO", 1, "bf16", "none"),
    "ddp_8gpu.yaml": ("MULTI_GPU", 8, "bf16", "ddp"),
    "fsdp2_8gpu.yaml": ("FSDP", 8, "bf16", "fsdp2"),
    "fsdp2_multinode.yaml": ("FSDP", 16, "bf16", "fsdp2"),
    "npu_8.yaml": ("MULTI_NPU", 8, "bf16", "ddp"),
}
STAGE_RULES = {"sample", "score", "logprob", "advantage", "update", "eval_sample", "eval_score"}
GPU_RULES = {"sample", "score", "logprob", "update", "eval_sample", "eval_score"}
# Resource names the Slurm executor plugin maps to sbatch options (its docs/further.md).
PLUGIN_RESOURCES = {
    "gpu", "gpu_model", "gres", "cpus_per_gpu", "cpus_per_task", "mem", "mem_mb", "mem_mb_per_cpu",
    "runtime", "nodes", "tasks", "slurm_partition", "slurm_account", "constraint", "slurm_extra",
}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean_env() -> Iterator[None]:
    """No launcher variables from the test run leak in, and none set here leak out."""
    saved = dict(os.environ)
    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "FSDP_")) or key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            del os.environ[key]
    yield
    os.environ.clear()
    os.environ.update(saved)


def _launch(argv: list[str]) -> tuple[Any, dict[str, str]]:
    """accelerate launch's parsed arguments and the ACCELERATE_*/FSDP_* environment its processes get,
    built by accelerate 1.x's own launcher code (parser, config merge, env)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    if args.use_fsdp or args.multi_gpu:
        env = prepare_multi_gpu_env(args)
    else:
        env = prepare_simple_launcher_cmd_env(args)[1]
    return args, {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def _config_argv(name: str, *flags: str) -> list[str]:
    multinode = ["--machine_rank", "0", "--main_process_ip", "127.0.0.1", "--main_process_port"]
    extra = [*multinode, str(_free_port())] if "multinode" in name else []
    return ["--config_file", str(ACCELERATE / name), *extra, *flags, "-m", "omnirl_cli", "update"]


def _omnirl_params(argv: list[str]) -> dict[str, Any]:
    """omnirl's own parser applied to `argv` (command first), without running it: an unknown option,
    a missing value or a value of the wrong type fails here."""
    import typer.main

    from omnirl_cli.app import app

    command = typer.main.get_command(app).commands[argv[0]]
    return command.make_context(argv[0], list(argv[1:])).params


def test_every_shipped_config_is_declared() -> None:
    assert sorted(p.name for p in ACCELERATE.glob("*.yaml")) == sorted(DECLARED)


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_config_loads_with_accelerates_loader(name: str) -> None:
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    config = load_config_from_file(str(ACCELERATE / name))
    kind, processes, precision, _ = DECLARED[name]
    assert isinstance(config, ClusterConfig)
    assert (config.distributed_type.value, config.num_processes, config.mixed_precision) == (
        kind,
        processes,
        precision,
    )
    header = (ACCELERATE / name).read_text().split("\ncompute_environment:")[0]
    assert f"accelerate launch --config_file recipes/accelerate/{name}" in header


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_launch_environment_resolves_the_declared_strategy(name: str, clean_env: None) -> None:
    from stages.update.parallel import resolve_strategy

    args, env = _launch(_config_argv(name))
    os.environ.update(env)
    _, processes, precision, strategy = DECLARED[name]
    assert env["ACCELERATE_MIXED_PRECISION"] == precision
    assert resolve_strategy("auto", processes) == strategy
    if strategy != "none":
        machines = yaml.safe_load((ACCELERATE / name).read_text()).get("num_machines", 1)
        assert int(args.nproc_per_node) == processes // machines


@pytest.mark.parametrize(
    ("name", "flags", "offload"),
    [
        ("fsdp2_8gpu.yaml", [], False),
        ("fsdp2_8gpu.yaml", ["--fsdp_offload_params", "true"], True),  # the documented CPU-offload line
        ("fsdp2_multinode.yaml", [], False),
    ],
)
def test_fsdp2_plugin_reads_the_file(name: str, flags: list[str], offload: bool, clean_env: None) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    fsdp = yaml.safe_load((ACCELERATE / name).read_text())["fsdp_config"]
    assert fsdp["fsdp_offload_params"] is False
    _, env = _launch(_config_argv(name, *flags))
    os.environ.update(env)
    assert (env["ACCELERATE_USE_FSDP"], env["FSDP_VERSION"]) == ("true", "2")
    # omnirl loads weights itself on every rank: transformers must not load them onto meta devices.
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    assert plugin.reshard_after_forward is fsdp["fsdp_reshard_after_forward"]
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) is offload
    assert plugin.transformer_cls_names_to_wrap is None  # blocks: the model's _no_split_modules


def test_slurm_profile_names_existing_rules_and_options() -> None:
    from snakemake.cli import get_argument_parser

    profile = yaml.safe_load((SLURM / "profile" / "config.yaml").read_text())
    rules = set(re.findall(r"^rule (\w+):", (ROOT / "recipes" / "Snakefile").read_text(), re.M))
    assert rules == STAGE_RULES | {"all", "summary"}  # all and summary are local rules
    assert profile["executor"] == "slurm"
    assert set(profile["set-resources"]) == STAGE_RULES
    options = {o for action in get_argument_parser()._actions for o in action.option_strings}
    # slurm-* settings come from the executor plugin, which is not a dependency of the tests
    assert {f"--{key}" for key in profile if not key.startswith("slurm-")} <= options
    for rule, resources in profile["set-resources"].items():
        assert set(resources) <= PLUGIN_RESOURCES, rule
        # GPUs are the Snakefile's (its processes per job): a profile's set-resources would override them
        assert "gpu" not in resources and ("cpus_per_gpu" in resources) is (rule in GPU_RULES), rule
    assert set(profile["default-resources"]) <= PLUGIN_RESOURCES


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _recorded(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def _run_script(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(
        ["bash", str(script)], cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize("script", ["update_multinode.sbatch", "sample_array.sbatch"])
def test_sbatch_scripts_pass_bash_syntax_check(script: str) -> None:
    subprocess.run(["bash", "-n", str(SLURM / script)], check=True)


def test_update_multinode_launches_one_rank_per_node(tmp_path: Path, clean_env: None) -> None:
    from accelerate.commands.launch import launch_command_parser

    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    _stub(bin_dir, "scontrol", 'printf "gpu001\\ngpu002\\n"\n')
    # srun: drop its options, then run the command once per node with that node's SLURM_NODEID
    _stub(
        bin_dir,
        "srun",
        'while [ "${1#--}" != "$1" ]; do shift; done\n'
        'for n in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$n "$@" || exit; done\n',
    )
    _stub(bin_dir, "accelerate", 'printf \'%s\\0\' "$@" > "$RECORD/node$SLURM_NODEID"\n')
    port = _free_port()
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RECORD": str(record),
        "SLURM_JOB_NODELIST": "gpu[001-002]",
        "SLURM_NNODES": "2",
        "RUN": "runs/x",
        "IT": "3",
        "PORT": str(port),
        "UPDATE_FLAGS": "--full --gradient-checkpointing",
    }
    done = _run_script(SLURM / "update_multinode.sbatch", env)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in record.iterdir()) == ["node0", "node1"]
    for node in (0, 1):
        argv = _recorded(record / f"node{node}")
        assert argv[0] == "launch"
        args = launch_command_parser().parse_args(argv[1:])
        assert Path(args.config_file) == Path("recipes/accelerate/fsdp2_multinode.yaml")
        assert (args.machine_rank, args.main_process_ip, args.main_process_port) == (node, "gpu001", port)
        assert (args.module, args.training_script) == (True, "omnirl_cli")
        args, launch_env = _launch(argv[1:])
        assert (args.nnodes, args.nproc_per_node, args.rdzv_endpoint) == ("2", "8", f"gpu001:{port}")
        assert launch_env["FSDP_VERSION"] == "2"
        params = _omnirl_params(args.training_script_args)
        assert args.training_script_args[0] == "update"
        assert [str(p) for p in params["inputs"]] == [
            f"runs/x/it3/{s}" for s in ("samples", "logprobs", "advantages")
        ]
        assert (str(params["out"]), str(params["adapter"]), params["seed"]) == (
            "runs/x/it4/policy",
            "runs/x/it3/policy",
            3,
        )
        assert params["full"] and params["gradient_checkpointing"]


def test_sample_array_submits_tasks_then_an_afterok_finaliser(tmp_path: Path) -> None:
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    # sbatch: record the call, answer job ids 100, 101, ... as --parsable does
    _stub(
        bin_dir,
        "sbatch",
        'n=$(ls "$RECORD" | grep -c sbatch || true)\n'
        'printf \'%s\\0\' "$@" > "$RECORD/sbatch$n"\necho $((100 + n))\n',
    )
    _stub(bin_dir, "omnirl", 'printf \'%s\\0\' "$@" > "$RECORD/omnirl.${SLURM_ARRAY_TASK_ID:-final}"\n')
    script = SLURM / "sample_array.sbatch"
    shards = 3
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record), "SHARDS": str(shards), "IT": "2"}
    done = _run_script(script, env)
    assert done.returncode == 0, done.stderr
    array, final = _recorded(record / "sbatch0"), _recorded(record / "sbatch1")
    assert array == ["--parsable", f"--array=0-{shards - 1}", str(script)]
    assert final == ["--parsable", "--dependency=afterok:100", str(script)]

    # the jobs themselves: every array task, then the finaliser
    for task in range(shards):
        job = _run_script(script, {**env, "SLURM_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": str(task)})
        assert job.returncode == 0, job.stderr
    job = _run_script(script, {**env, "SLURM_JOB_ID": "101"})
    assert job.returncode == 0, job.stderr
    final_argv = _recorded(record / "omnirl.final")
    final_params = _omnirl_params(final_argv)
    assert final_argv[0] == "sample"
    assert (final_params["num_shards"], final_params["shard_index"]) == (shards, None)
    assert (str(final_params["adapter"]), final_params["seed"], final_params["iteration"]) == (
        "runs/flow_grpo/it2/policy",
        2,
        2,
    )
    for task in range(shards):
        argv = _recorded(record / f"omnirl.{task}")
        params = _omnirl_params(argv)
        assert (params["num_shards"], params["shard_index"]) == (shards, task)
        assert argv[:-2] == final_argv and argv[-2:] == ["--shard-index", str(task)]


def _dry_run(tmp_path: Path, *config: str) -> tuple[dict[str, list[str]], dict[str, int]]:
    """`snakemake -n -p` of one iteration with `config`: each stage rule's first shell command (argv, without
    the redirection of its --json result) and the GPUs its jobs ask for (resource gpu, 0 if none)."""
    snakemake = Path(sys.executable).parent / "snakemake"
    base = [f"run={tmp_path / 'run'}", "model=models/m", "prompts=p.txt", "iterations=1"]
    base += ["preset=recipes/configs/demo_tiny.yaml"]
    argv = [str(snakemake), "-s", "recipes/Snakefile", "-n", "-p", "--cores", "1", "--config", *base, *config]
    text = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    commands: dict[str, list[str]] = {}
    gpus: dict[str, int] = {}
    for block in re.split(r"^rule ", text, flags=re.M)[1:]:
        rule = block.split(":", 1)[0]
        shell = re.search(r"^Shell command: (.*?)(?: --json > .*)?$", block, re.M)
        if shell and rule in STAGE_RULES:
            commands.setdefault(rule, shlex.split(shell.group(1)))
            gpu = re.search(r"^    resources: .*\bgpu=(\d+)", block, re.M)
            gpus[rule] = int(gpu.group(1)) if gpu else 0
    return commands, gpus


def _snakemake_installed() -> bool:
    return (Path(sys.executable).parent / "snakemake").exists()


@pytest.mark.skipif(not _snakemake_installed(), reason="snakemake is a dev extra")
def test_snakefile_launches_each_rule_with_its_processes(tmp_path: Path, clean_env: None) -> None:
    from torch.distributed.run import get_args_parser

    commands, gpus = _dry_run(tmp_path, "sample_procs=2", "logprob_procs=4", "update_procs=8")
    procs = {}
    for rule, argv in commands.items():
        if argv[0] == "torchrun":
            args = get_args_parser().parse_args(argv[1:])
            assert args.standalone and args.module and args.training_script == "omnirl_cli"
            procs[rule], omnirl = int(args.nproc_per_node), args.training_script_args
        else:
            assert argv[0] == "omnirl"
            procs[rule], omnirl = 1, argv[1:]
        assert omnirl[0] == rule
        _omnirl_params(omnirl)  # every option on the line is omnirl's
    assert procs == {"sample": 2, "score": 1, "logprob": 4, "advantage": 1, "update": 8}
    # a job asks the scheduler for one GPU per process; advantage for none
    assert gpus == {**procs, "advantage": 0}


@pytest.mark.skipif(not _snakemake_installed(), reason="snakemake is a dev extra")
@pytest.mark.parametrize(("name", "strategy"), [("ddp_8gpu.yaml", "ddp"), ("fsdp2_8gpu.yaml", "fsdp2")])
def test_snakefile_with_an_accelerate_config_launches_every_gpu_rule_through_it(
    tmp_path: Path, clean_env: None, name: str, strategy: str
) -> None:
    from stages.precision import resolve_mixed_precision
    from stages.update.parallel import launcher_state_dict_type, resolve_strategy

    config = f"accelerate_config=recipes/accelerate/{name}"
    commands, gpus = _dry_run(tmp_path, config, "update_procs=4", "logprob_procs=2")
    assert commands["advantage"][0] == "omnirl" and gpus["advantage"] == 0  # CPU work stays one process
    for rule in ("sample", "score", "logprob", "update"):
        argv = commands[rule]
        assert argv[:2] == ["accelerate", "launch"], rule
        args, env = _launch(argv[2:])
        assert args.module and args.training_script_args[0] == rule
        _omnirl_params(args.training_script_args)
        assert int(args.num_processes) == gpus[rule] == {"logprob": 2, "update": 4}.get(rule, 1)
        os.environ.update(env)
        assert resolve_mixed_precision(None) == "bf16"  # logprob replays as update trains: the file's
    assert resolve_strategy("auto", 4) == strategy  # the update's launch environment, set last
    assert launcher_state_dict_type() == ("sharded" if strategy == "fsdp2" else "full")


@pytest.mark.skipif(not _snakemake_installed(), reason="snakemake is a dev extra")
def test_snakefile_runs_the_replay_as_replay_says(tmp_path: Path, clean_env: None) -> None:
    """replay=auto (default) and yes reach `logprob --replay`; no drops the rule and update's --in."""
    for config, mode in (((), "auto"), (("replay=yes",), "yes")):
        commands, _ = _dry_run(tmp_path, *config)
        argv = commands["logprob"]
        assert argv[argv.index("--replay") + 1] == mode
        assert f"{tmp_path / 'run'}/it0/logprobs" in commands["update"]
    commands, _ = _dry_run(tmp_path, "replay=no")
    assert "logprob" not in commands
    assert not any("logprobs" in arg for arg in commands["update"])
    assert f"{tmp_path / 'run'}/it0/advantages" in commands["update"]


@pytest.mark.skipif(not _snakemake_installed(), reason="snakemake is a dev extra")
def test_snakefile_evaluates_held_out_prompts_and_prints_a_line_per_iteration(tmp_path: Path) -> None:
    """eval_prompts= adds recipes/eval.mk's evaluation of every iteration's policy; each stage keeps its
    --json result in it<K>/<stage>.json; each iteration's line waits for its update and evaluation."""
    run = tmp_path / "run"
    commands, gpus = _dry_run(
        tmp_path, "eval_prompts=heldout.jsonl", "eval_flags=--sampler ode --group-size 4"
    )
    argv = commands["eval_sample"]
    assert argv[argv.index("--prompts") + 1] == "heldout.jsonl" and argv[argv.index("--seed") + 1] == "0"
    assert argv[argv.index("--sampler") + 1] == "ode" and argv[argv.index("--group-size") + 1] == "4"
    assert argv[argv.index("--out") + 1] == f"{run}/it0/eval/samples"
    assert commands["eval_score"][commands["eval_score"].index("--in") + 1] == f"{run}/it0/eval/samples"
    assert gpus["eval_sample"] == gpus["eval_score"] == 1
    argv = [str(Path(sys.executable).parent / "snakemake"), "-s", "recipes/Snakefile", "-n", "-p", "--cores",
            "1", "--config", f"run={run}", "model=models/m", "prompts=p.txt", "iterations=1",
            "preset=recipes/configs/demo_tiny.yaml", "eval_prompts=heldout.jsonl"]  # fmt: skip
    text = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    blocks = {
        (block.split(":", 1)[0], re.search(r"^    output: (.*)$", block, re.M).group(1)): block
        for block in re.split(r"^rule ", text, flags=re.M)[1:]
        if block.startswith(("summary", "sample", "update"))
    }
    inputs = re.search(r"^    input: (.*)$", blocks["summary", f"{run}/it0/summary.txt"], re.M).group(1)
    assert inputs.split(", ") == [
        f"{run}/it0/rewards/_manifest.json",
        f"{run}/it1/policy/omnirl_adapter.json",
        f"{run}/it0/eval/rewards/_manifest.json",
    ]
    shell = re.search(r"^Shell command: (.*)$", blocks["summary", f"{run}/it1/summary.txt"], re.M).group(1)
    assert shell.startswith(f"omnirl report {run} --iteration 1 > ")
    shell = re.search(
        r"^Shell command: (.*)$", blocks["update", f"{run}/it1/policy/omnirl_adapter.json"], re.M
    )
    assert shell.group(1).endswith(
        f"--json > {run}/it0/update.json.tmp && mv {run}/it0/update.json.tmp {run}/it0/update.json"
    )


def _omnirl_argv(argv: list[str]) -> list[str]:
    """The omnirl command line (command first) inside a launch line: torchrun's script arguments, or
    the line after `omnirl`."""
    from torch.distributed.run import get_args_parser

    if argv[0] == "torchrun":
        return get_args_parser().parse_args(argv[1:]).training_script_args
    assert argv[0] == "omnirl", argv
    return argv[1:]


SP_STAGES = {"sample", "logprob", "update", "eval_sample"}  # the rules that run a transformer's forward


@pytest.mark.skipif(not _snakemake_installed(), reason="snakemake is a dev extra")
def test_snakefile_passes_the_sp_degree_to_the_stages_that_take_it(tmp_path: Path, clean_env: None) -> None:
    """sp_degree=2: --sp-degree 2 on sample, logprob, update and the held-out sampling, whose jobs
    default to 2 processes (one sp group); score and advantage get no degree. Processes that are not a
    multiple of the degree are refused before anything runs."""
    commands, gpus = _dry_run(tmp_path, "sp_degree=2", "update_procs=4", "eval_prompts=heldout.jsonl")
    assert set(commands) == STAGE_RULES
    for rule, argv in commands.items():
        omnirl = _omnirl_argv(argv)
        params = _omnirl_params(omnirl)
        if rule in SP_STAGES:
            assert omnirl.count("--sp-degree") == 1 and params["sp_degree"] == 2, rule
        else:
            assert "--sp-degree" not in omnirl and "sp_degree" not in params, rule
    assert gpus == {
        "sample": 2,
        "logprob": 2,
        "update": 4,
        "eval_sample": 2,
        "score": 1,
        "eval_score": 1,
        "advantage": 0,
    }
    commands, _ = _dry_run(tmp_path)  # the default: no sequence parallelism, no option
    assert not any("--sp-degree" in argv for argv in commands.values())

    snakemake = str(Path(sys.executable).parent / "snakemake")
    refused = subprocess.run(
        [snakemake, "-s", "recipes/Snakefile", "-n", "--cores", "1", "--config", f"run={tmp_path}",
         "sp_degree=2", "update_procs=3"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "sp_degree=2: update_procs=3 is not a multiple of it" in refused.stdout + refused.stderr


def test_make_passes_sp_to_the_stages_that_take_it() -> None:
    """recipes/flow_grpo.mk SP=2: --sp-degree 2 on every sample (the held-out one too), logprob and
    update `make -n` plans, none on score and advantage; SP unset (1) passes none."""

    def planned(*variables: str) -> list[list[str]]:
        cmd = ["make", "-n", "--no-print-directory", "-f", "recipes/flow_grpo.mk", "RUN=runs/plan"]
        cmd += ["ITERATIONS=1", "EVAL_PROMPTS=heldout.jsonl", *variables]
        plan = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        lines = [line for line in plan.replace("\\\n", " ").splitlines() if line.startswith("omnirl ")]
        return [shlex.split(line.split(" --json", 1)[0])[1:] for line in lines]

    plan = planned("SP=2")
    assert {argv[0] for argv in plan} == {"sample", "score", "logprob", "advantage", "update", "report"}
    takes = {"sample", "logprob", "update"}
    for argv in plan:
        if argv[0] == "report":
            continue
        params = _omnirl_params(argv)
        if argv[0] in takes:
            assert argv.count("--sp-degree") == 1 and params["sp_degree"] == 2, argv
        else:
            assert "--sp-degree" not in argv, argv
    assert sum(argv[0] == "sample" and "heldout.jsonl" in argv for argv in plan) == 2  # it0, it1 evaluated
    assert not any("--sp-degree" in argv for argv in planned())
