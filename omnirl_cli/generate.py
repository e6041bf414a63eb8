"""A command's typer options generated from its stage's typed config (`stages.knobs`).

Each knob of the config becomes one option: its type from the field's annotation (a `choices` knob's
`str` becomes a `Literal` of its names, which typer lists in --help, completes and checks), its default
from the field's, and help, flag, panel, environment variable, metavar, bounds and completion from the
`Knob`. `config_command` adds the options that steer resolution (--config, --set, --json) and hands the
command's body one resolved instance of the config (`config.resolve_config`), so no option is written
by hand and no setting travels as an untyped dict.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Any, TypeVar, get_type_hints

import typer

from stages.knobs import knobs

from .config import Layer, Presets, command_sections, resolve_config
from .errors import handle_errors
from .options import ConfigOpt, JsonOpt, SetOpt, option

C = TypeVar("C")


def options_of(*configs: type) -> list[inspect.Parameter]:
    """One keyword parameter per knob of the dataclasses `configs`, in declaration order, as typer reads
    them; a knob several configs share (a common base class's) is one parameter, and an `argument` knob
    has no default, so the command line must give it."""
    made: dict[str, inspect.Parameter] = {}
    for config in configs:
        hints = get_type_hints(config)
        for field, declared in knobs(config):
            made.setdefault(
                field.name,
                inspect.Parameter(
                    field.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=inspect.Parameter.empty if declared.argument else field.default,
                    annotation=option(field.name, declared, hints[field.name]),
                ),
            )
    return list(made.values())


def config_command(
    config: type[C] | tuple[type[C], ...],
    command: str,
    run: Callable[..., None],
    choose: Callable[[dict[str, Any]], type[C]] | None = None,
    *,
    presets: bool = True,
    shared: Collection[str] | None = None,
) -> Callable[..., None]:
    """The typer command `omnirl COMMAND`: options generated from `config`, then --config and --set
    (unless `presets` is False: a command that reads no preset, whose settings are its flags alone) and
    --json; it resolves them into one `config` instance and calls `run(instance, json)`. Its --help
    text is `run`'s docstring.

    A command of several kinds passes a tuple of configs and `choose`, which picks the kind from the
    resolved values: its options are the union of theirs, and a knob of another kind given from any
    source is refused (`resolve_config`).

    A command that also hands a preset's sections to configs of other commands (`omnirl online`: its
    `sample:` ... `update:` sections, the staged commands' settings) passes `shared`, the names of those
    settings, which a preset may also give at its top level (so they are not refused as unknown); its
    `run` then also receives the preset layers that resolution read, `run(instance, json, presets)`
    (`config.Presets`)."""
    configs = config if isinstance(config, tuple) else (config,)

    @handle_errors
    def generated(ctx: typer.Context, **values: Any) -> None:
        layers: list[Layer] = []
        c = resolve_config(ctx, command, configs, choose, shared=shared or (), read=layers)
        handed = () if shared is None else (Presets(layers, command_sections(ctx)),)
        run(c, values["json_"], *handed)

    keyword = inspect.Parameter.KEYWORD_ONLY
    steering = [
        inspect.Parameter("config", keyword, default=None, annotation=ConfigOpt),
        inspect.Parameter("set_", keyword, default=None, annotation=SetOpt),
    ]
    generated.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
            *options_of(*configs),
            *(steering if presets else []),
            inspect.Parameter("json_", keyword, default=False, annotation=JsonOpt),
        ]
    )
    generated.__annotations__ = {}  # typer reads the types from the signature
    # the command is `run`'s, as --help and the command registry see it
    generated.__doc__, generated.__module__, generated.__name__ = run.__doc__, run.__module__, command
    return generated
