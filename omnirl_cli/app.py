"""The `omnirl` Typer application: one module per command under `omnirl_cli.commands`.

torch and the model libraries are imported inside commands only, so `omnirl --help` stays fast.
"""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from .commands import COMMANDS


class OneLineErrors(TyperGroup):
    """Usage errors (unknown option, bad value, missing option) as one line and exit 2, like every
    other error a user can cause, instead of a boxed panel."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except typer.TyperException as exc:  # click's exceptions, as typer vendors them
            if type(exc).__name__ == "NoArgsIsHelpError":  # bare `omnirl`: the help text
                typer.echo(exc.format_message(), err=True)
                sys.exit(exc.exit_code)
            from rich.markup import escape

            from .console import err

            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            err.print(f"[bold red]error:[/] {escape(' '.join(exc.format_message().split()))}{hint}")
            sys.exit(exc.exit_code)
        except typer.Abort:
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=OneLineErrors,
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
