"""Settings of the commands that look at what a run left behind, or at the installation, and write
no shard set: `omnirl report` (a run), `omnirl inspect` (a shard set) and `omnirl env`; torch-free.

Each is the single declaration of its command's options (`omnirl_cli.generate`). These commands read
no preset (--config / --set): their settings are their flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stages import knobs
from stages.knobs import knob


@dataclass
class ReportConfig:
    """Every setting of `omnirl report`."""

    run: Path | None = knob(None, "Run directory holding it<K>/ iterations.", argument=True)
    grids: bool = knob(True, "Write an image grid per iteration.", negative=True)
    iteration: int | None = knob(
        None,
        "Print iteration K's row as one line on stdout (the recipes' line per finished iteration) and "
        "nothing else.",
        low=0,
    )
    report_to: list[str] | None = knobs.report_to()
    run_name: str | None = knobs.run_name()


@dataclass
class InspectConfig:
    """Every setting of `omnirl inspect`."""

    path: Path | None = knob(None, "A shard-set directory (holding _manifest.json).", argument=True)
    verify: bool = knob(False, "Re-check every shard's size and sha256.")
    head: int = knob(0, "Also show the first N rows.", low=0)


@dataclass
class EnvConfig:
    """`omnirl env` has no settings (--json aside): an empty config, so that it is generated as every
    other command is."""
