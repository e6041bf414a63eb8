"""Options as typer reads them: each knob's (`option`, used by `omnirl_cli.generate`) and the options
that steer resolution and output (--config, --set, --json, -q, -v).

Precedence, applied by `config.resolve`: flags > --set > OMNIRL_* variables > --config YAML > defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import typer

from stages.knobs import Knob, flag_of

from .choices import complete
from .console import QUIET, VERBOSE, set_verbosity

RUN = "Run"
# Said by the help of an option that has no default but may come from a preset: required after
# resolution (`config.resolve(..., required=)`), not by typer, so --config can supply it.
REQUIRED = "Required (a flag, or --config / --set)."


def _with_choices(annotation: Any, choices: tuple[str, ...]) -> Any:
    """`annotation` with its `str` replaced by `Literal[choices]` (`str | None` → `Literal[...] | None`)."""
    if annotation is str:
        return Literal[choices]
    if get_origin(annotation) is not None and str in get_args(annotation):
        return Union[tuple(Literal[choices] if arg is str else arg for arg in get_args(annotation))]  # noqa: UP007
    raise TypeError(f"a knob with choices must be a str field, not {annotation}")


def option(name: str, declared: Knob, annotation: Any) -> Any:
    """The typer option of knob `name` of type `annotation` (`stages.knobs`), as an `Annotated` type:
    a `choices` knob's `str` becomes a `Literal` of its names (listed in --help, completed, checked),
    `names` are offered by completion, a `required` knob's help says how to give it, and an `argument`
    knob is a positional argument."""
    help_text = f"{declared.help} {REQUIRED}" if declared.required else declared.help
    settings: dict[str, Any] = {"help": help_text, "rich_help_panel": declared.panel}
    for key, value in (
        ("envvar", declared.envvar),
        ("metavar", declared.metavar),
        ("min", declared.low),
        ("max", declared.high),
    ):
        if value is not None:
            settings[key] = value
    if declared.names:
        settings["autocompletion"] = complete(declared.names, declared.entry_points)
    if declared.choices:
        annotation = _with_choices(annotation, declared.choices)
    if declared.argument:
        return Annotated[annotation, typer.Argument(**settings)]
    long = flag_of(name, declared)
    names = (
        f"{long}/--no-{long[2:]}" if declared.negative else long,
        *((declared.short,) if declared.short else ()),
    )
    return Annotated[annotation, typer.Option(*names, **settings)]


ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        envvar="OMNIRL_CONFIG",
        help="YAML preset; top-level keys and a section named after the command fill options not given as flags.",
        rich_help_panel=RUN,
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="KEY=VALUE",
        help="Override a config value, e.g. --set steps=10. Flags > --set > OMNIRL_* variables > "
        "YAML > defaults.",
        rich_help_panel=RUN,
    ),
]
JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON result object on stdout instead of the summary lines; progress stays on stderr "
        "(-q turns it off).",
        rich_help_panel=RUN,
    ),
]


def _set_level(level: int) -> Callable[[bool], None]:
    def apply(value: bool) -> None:
        if value:
            set_verbosity(level)

    return apply


QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        envvar="OMNIRL_QUIET",
        expose_value=False,
        callback=_set_level(QUIET),
        help="No progress, no log lines (omnirl's loggers at ERROR): results and errors only.",
        rich_help_panel=RUN,
    ),
]
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        envvar="OMNIRL_VERBOSE",
        expose_value=False,
        callback=_set_level(VERBOSE),
        help="Also omnirl's info and debug log records (e.g. remote-reward retries), with logger names.",
        rich_help_panel=RUN,
    ),
]
