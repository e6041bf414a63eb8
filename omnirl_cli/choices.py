"""The names choice options accept, for `--help`, shell completion and validation without importing torch.

Closed sets are `Literal` types: typer lists them in help as <a|b|c>, completes them and refuses other
flag values; `config.resolve` checks values from --config, --set and OMNIRL_* variables against the
same sets. Open registries that plugins extend (rewards, algorithms, advantage estimators, model
families) stay plain strings whose built-in names are offered by completion only, so a
`module:attribute` plugin is never refused here. Every set is the library's own torch-free
declaration (`stages.knobs`, a stage's config module), so nothing here mirrors a stage constant.
Every command is generated from a stage's config (`omnirl_cli.generate`) and takes its sets from its
knobs; what is left here is the completion helper their open registries use.
"""

from __future__ import annotations

from collections.abc import Callable


def complete(names: tuple[str, ...], entry_points: str | None = None) -> Callable[[str], list[str]]:
    """A typer `autocompletion` callback offering `names` (and the installed entry points of the group
    `entry_points`) that start with what was typed."""

    def offer(incomplete: str) -> list[str]:
        found = list(names)
        if entry_points:
            from importlib.metadata import entry_points as installed

            found += sorted({ep.name for ep in installed(group=entry_points)} - set(names))
        return [name for name in found if name.startswith(incomplete)]

    return offer
