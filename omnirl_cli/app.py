"""The `omnirl` Typer application: one module per command under `omnirl_cli.commands`.

torch and the model libraries are imported inside commands only, so `omnirl --help` stays fast.
"""

from __future__ import annotations

from importlib import metadata
from typing import Annotated

import typer

from .commands import COMMANDS

app = typer.Typer(
    name="omnirl",
    help="RL post-training of diffusion and omni-modality models, one inspectable, resumable stage at a time.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        try:
            version = metadata.version("omnirl")
        except metadata.PackageNotFoundError:
            version = "unknown"
        typer.echo(f"omnirl {version}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool | None,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = None,
) -> None:
    """RL post-training of diffusion and omni-modality models, one inspectable, resumable stage at a time."""


for _name, _func in COMMANDS:
    app.command(_name)(_func)


def main() -> None:
    """Console-script entry point."""
    from .runtime import quiet_libraries

    quiet_libraries()
    app()
