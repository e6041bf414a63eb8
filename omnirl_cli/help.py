"""`omnirl COMMAND --help`: each option on its own line with its metavar, its help below it, so the text
fits any terminal width (80 columns included) with no word cut and no cell truncated with "…".

typer's rich help lays options out as a table of five columns; at 80 columns the name and help columns
are squeezed until option names and long words (`torch.amp.GradScaler`) are cut. Here a panel per
`rich_help_panel` lists each parameter as

    -n, --group-size INT
        Samples per prompt (the GRPO group). [default: 4; ≥ 1]

Metavars: a choice's names (`ode|sde|cps|dance`), PATH for a path, INT / FLOAT / TEXT, the option's own
`metavar` where it declares one (KEY=VALUE, SOURCE), nothing on a flag; a repeatable option says so.
"""

from __future__ import annotations

import inspect
from enum import Enum
from pathlib import Path
from typing import Any, get_args, get_origin

from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.text import Text

from .config import choices_of

ARGUMENTS, OPTIONS = "Arguments", "Options"
INDENT = 4  # the help text under an option's line
_NAMES = {int: "INT", float: "FLOAT", str: "TEXT", Path: "PATH"}


def _positional(param: Any) -> bool:
    """Whether `param` is an argument (typer vendors click: its classes are not click's own)."""
    return param.param_type_name == "argument"


def _type_name(annotation: Any) -> str:
    """INT, FLOAT, TEXT or PATH for one value of `annotation` (a list's element, each tuple item)."""
    if get_origin(annotation) in (list, tuple):
        return " ".join(_type_name(arg) for arg in get_args(annotation) if arg is not Ellipsis)
    return _NAMES.get(annotation, "TEXT")


def metavar(param: Any) -> str:
    """How `param`'s value is shown: its declared metavar, a choice's names, a type name, or "" for a
    flag; a positional without a declared metavar shows its name in capitals."""
    if param.metavar:
        return param.metavar
    if getattr(param, "is_flag", False):
        return ""
    choices = choices_of(param)
    if choices:
        return "|".join(choices)
    if _positional(param):
        return (param.name or "").upper()
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is None:  # click's own parameters (--help has no value)
        return param.type.name.upper()
    return _type_name(descriptor.annotation)


def _default(param: Any, ctx: Any) -> str:
    """The default as --help shows it: the form a two-way flag takes, a value; "" for none."""
    if isinstance(param.show_default, str):
        return param.show_default
    if not param.show_default or _positional(param):
        return ""
    default = param.get_default(ctx, call=False)
    if getattr(param, "is_flag", False):
        secondary = getattr(param, "secondary_opts", [])
        if not secondary:
            return ""
        return (param.opts[0] if default else secondary[0]).lstrip("-")
    if default is None or default == [] or default == ():
        return ""
    if isinstance(default, Enum):
        return str(default.value)
    if isinstance(default, (list, tuple)):
        return ", ".join(map(str, default))
    return str(default)


def _range(param: Any) -> str:
    """`≥ 1`, `≤ 9` or `1–4096` for a number option with bounds, else ""."""
    info = getattr(getattr(param, "type_descriptor", None), "parameter_info", None)
    low, high = getattr(info, "min", None), getattr(info, "max", None)
    if low is not None and high is not None:
        return f"{low}–{high}"
    return f"≥ {low}" if low is not None else f"≤ {high}" if high is not None else ""


def _facts(param: Any, ctx: Any) -> str:
    """The bracketed tail of an option's help: required, repeatable, default, range, env var."""
    facts = []
    if param.required:
        facts.append("required")
    if getattr(param, "multiple", False):
        facts.append("repeatable")
    default = _default(param, ctx)
    if default:
        facts.append(f"default: {default}")
    bounds = _range(param)
    if bounds:
        facts.append(bounds)
    envvar = getattr(param, "envvar", None)
    if isinstance(envvar, str) and getattr(param, "show_envvar", True):
        facts.append(f"env var: {envvar}")
    return f"[{'; '.join(facts)}]" if facts else ""


def _heading(param: Any) -> Text:
    """The option's line: short and long names, the negative form of a two-way flag, the metavar."""
    if _positional(param):
        line = Text(metavar(param), style="bold cyan")
    else:
        names = sorted(param.opts, key=lambda opt: opt.startswith("--"))
        line = Text(", ".join(names), style="bold cyan")
        for opt in getattr(param, "secondary_opts", []):
            line.append(" / ").append(opt, style="bold magenta")
        shown = metavar(param)
        if shown:
            line.append(" ").append(shown, style="yellow")
    return line


def _paragraph(text: str) -> str:
    """A docstring paragraph as one line per source line that ends in a shell continuation (`\\`),
    the rest joined, so terminals of any width reflow it."""
    out, pending = [], []
    for line in text.splitlines():
        pending.append(line.strip())
        if line.rstrip().endswith("\\"):
            out.append(" ".join(pending))
            pending = []
    if pending:
        out.append(" ".join(pending))
    return "\n".join(out)


def _body(command: Any) -> list[RenderableType]:
    """The command's docstring: the first paragraph bold, the rest reflowed, rich markup kept."""
    text = inspect.cleandoc(command.help or "").partition("\f")[0]
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    out: list[RenderableType] = []
    for i, paragraph in enumerate(paragraphs):
        rendered = Text.from_markup(_paragraph(paragraph), style="bold" if i == 0 else "")
        out.append(Padding(rendered, (0, 1, 1, 1)))
    return out


def _entry(param: Any, ctx: Any) -> RenderableType:
    help_text = Text.from_markup(" ".join((getattr(param, "help", None) or "").split()))
    facts = _facts(param, ctx)
    if facts:
        help_text.append(" " if help_text.plain else "").append(facts, style="dim")
    if not help_text.plain:
        return _heading(param)
    return Group(_heading(param), Padding(help_text, (0, 0, 0, INDENT)))


def render_help(command: Any, ctx: Any) -> None:
    """Print `command`'s help on stdout, as wide as the terminal (COLUMNS, else 80)."""
    console = Console(highlight=False, soft_wrap=False)
    arguments = " ".join(
        f"{metavar(p)}{'...' if p.nargs == -1 else ''}" if p.required else f"[{metavar(p)}]"
        for p in command.get_params(ctx)
        if _positional(p)
    )
    console.print(Padding(Text(f"Usage: {ctx.command_path} [OPTIONS] {arguments}".rstrip()), (1, 1)))
    for part in _body(command):
        console.print(part)
    panels: dict[str, list[Any]] = {ARGUMENTS: [], OPTIONS: []}
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        default = ARGUMENTS if _positional(param) else OPTIONS
        panels.setdefault(getattr(param, "rich_help_panel", None) or default, []).append(param)
    for name, params in panels.items():
        if params:
            entries = [_entry(param, ctx) for param in params]
            console.print(Panel(Group(*entries), title=name, title_align="left", border_style="dim"))
