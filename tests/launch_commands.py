"""Run several `omnirl` commands one after another in one process, each as `omnirl ARGS --json` (argv[1]:
a JSON list of argument lists), so a torchrun test pays the import of torch and diffusers once for a
whole staged iteration instead of once per command. A failing command stops the rest with its exit code."""

from __future__ import annotations

import json
import sys

from omnirl_cli.app import app

if __name__ == "__main__":  # not again in a process a command spawns (online's workers re-import it)
    for args in json.loads(sys.argv[1]):
        try:
            app([*args, "--json"], prog_name="omnirl")
        except SystemExit as exc:
            if exc.code:
                raise
