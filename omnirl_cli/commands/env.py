"""`omnirl env`: the versions, devices, accelerate config and environment variables a bug report needs."""

from __future__ import annotations

from stages.inspection import EnvConfig

from ..console import emit_json, out
from ..generate import config_command


def run(c: EnvConfig, json_: bool) -> None:
    """Print what a bug report needs: omnirl (and the git commit of a checkout it runs from), Python and
    package versions, which optional extras and experiment trackers are installed, the accelerator torch sees (type, count, names), the accelerate config file in effect
    and the OMNIRL_*, ACCELERATE_*, HF_* and launcher variables that are set (secrets redacted).

    Example: [bold]omnirl env --json > env.json[/]
    """
    from stages.installation import describe_installation

    report = describe_installation()
    if json_:
        emit_json(report)
        return
    dev, src = report["devices"], report["source"]
    commit = (
        f" (git {src['commit'][:12]}{', modified' if src['modified'] else ''}, {src['path']})"
        if src["commit"]
        else ""
    )
    lines = [
        f"omnirl {report['omnirl']}{commit}  python {report['python']['version']} ({report['python']['executable']})",
        f"platform {report['platform']}",
        "packages: " + ", ".join(f"{k} {v or 'missing'}" for k, v in report["packages"].items()),
        "extras: "
        + ", ".join(f"{k} {'yes' if e['installed'] else 'no'}" for k, e in report["extras"].items()),
        "trackers: " + ", ".join(f"{k} {v or 'missing'}" for k, v in report["trackers"].items()),
        f"devices: torch {dev['torch']}, "
        + (
            f"{dev['count']} × {dev['accelerator']} {dev['names']}"
            if dev["accelerator"]
            else "no accelerator"
        )
        + f", {dev['cpu_count']} CPUs, {dev['torch_threads']} torch threads",
        f"accelerate config: {report['accelerate_config']['path']}"
        + ("" if report["accelerate_config"]["exists"] else " (none)"),
    ]
    if isinstance(report["accelerate_config"]["config"], dict):
        lines += [f"  {k}: {v}" for k, v in report["accelerate_config"]["config"].items()]
    lines.append("environment:" + ("" if report["environment"] else " (no OMNIRL_*, ACCELERATE_*, HF_* set)"))
    lines += [f"  {k}={v}" for k, v in report["environment"].items()]
    for line in lines:
        out.print(line, markup=False)


env = config_command(EnvConfig, "env", run, presets=False)
