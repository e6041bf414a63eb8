"""The `omnirl` Typer application: one module per command under `omnirl_cli.commands`.

torch and the model libraries are imported inside commands only, so `omnirl --help` stays fast.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from .commands import COMMANDS
from .config import choices_of
from .console import NORMAL, set_verbosity
from .options import QuietOpt, VerboseOpt


def _usage_message(exc: Exception) -> str:
    """typer's usage error on one line; a value outside a choice option's names is worded as the
    stages and `config.resolve` word it: `--sampler magic: choose one of ode, sde, cps, dance`."""
    message = " ".join(exc.format_message().split())  # type: ignore[attr-defined]
    param = getattr(exc, "param", None)
    choices = choices_of(param) if param is not None else None
    found = re.search(r"'([^']*)' is not one of ", message)
    if not (choices and found and param.opts):
        return message
    env = f" (flag or {param.envvar})" if isinstance(param.envvar, str) else ""
    return f"{param.opts[0]} {found.group(1)}{env}: choose one of {', '.join(choices)}"


class OneLineErrors(TyperGroup):
    """Usage errors (unknown option, bad value, missing option) as one line and exit 2, like every
    other error a user can cause, instead of a boxed panel."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        # -q/-v hold for this invocation only (tests invoke the app many times in one process)
        set_verbosity(NORMAL)
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
            err.print(f"[bold red]error:[/] {escape(_usage_message(exc))}{hint}")
            sys.exit(exc.exit_code)
        except typer.Abort:
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _verbosity_params() -> list[Any]:
    """The -q/--quiet and -v/--verbose options, as typer builds them from `QuietOpt` / `VerboseOpt`."""
    probe = typer.Typer(add_completion=False)

    @probe.command()
    def flags(quiet: QuietOpt = False, verbose: VerboseOpt = False) -> None:
        """Only a carrier of the options."""

    return list(typer.main.get_command(probe).params)


_VERBOSITY = _verbosity_params()


class OmnirlCommand(TyperCommand):
    """A command that also takes -q/--quiet and -v/--verbose after its name, as `omnirl` takes them
    before it: the options set the verbosity while parsing and never reach the command's function. Its
    --help is `help.render_help`'s."""

    def __init__(self, *args: Any, params: list[Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, params=[*(params or []), *_VERBOSITY], **kwargs)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """One option per line with its help below (`help.render_help`): fits 80 columns uncut."""
        from .help import render_help

        render_help(self, ctx)


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
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """RL post-training of diffusion and omni-modality models, one inspectable, resumable stage at a time."""


for _name, _func in COMMANDS:
    app.command(_name, cls=OmnirlCommand)(_func)


def main() -> None:
    """Console-script entry point."""
    from .runtime import quiet_libraries

    quiet_libraries()
    app()
