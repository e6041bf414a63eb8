"""Structure counters of the code base (issue 30's targets), measured from the source as it stands.

- import cycles among the modules of stages/ and omnirl_cli/: over every explicit import that runs
  (module level and inside functions), over those run at import time alone, and over those plus the
  type-only ones (`if TYPE_CHECKING:`); each cycle is a strongly connected component of the import
  graph, listed by its modules;
- CLI signature lines: the lines of each command's hand-written typer signature (from `def` to the
  line before its body), per command; a command generated from its config (`omnirl_cli.generate`)
  has none;
- total lines of omnirl_cli/, and every file of stages/ and omnirl_cli/ over 500 and over 600 lines;
- `c["..."]` look-ups left in omnirl_cli/ (knobs read from an untyped dict).

Run from the repository root: `python tools/structure.py` (a table), `--json` for one object.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("stages", "omnirl_cli")
LOOKUP = re.compile(r"\bc\[\s*[\"']")


def modules() -> dict[str, Path]:
    """Every module of PACKAGES by dotted name (a package by its own name, for its __init__.py)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _target(name: str, known: dict[str, Path]) -> str | None:
    """The known module `name` names: itself, else (an attribute `pkg.mod.attr`) its longest known prefix."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _import_nodes(node: ast.AST, when: str) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """The import statements under `node`, each with when it runs: "top" (at import time), "deferred"
    (inside a function, when it is called) or "typing" (under `if TYPE_CHECKING:`, never)."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            found.append((child, when))
            continue
        inner = when
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and when == "top":
            inner = "deferred"
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            found += [
                (n, "typing") for n, _ in _import_nodes(ast.Module(body=child.body, type_ignores=[]), when)
            ]
            found += _import_nodes(ast.Module(body=child.orelse, type_ignores=[]), when)
            continue
        found += _import_nodes(child, inner)
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> dict[str, set[str]]:
    """The known modules module `name` imports, by when the import runs (`_import_nodes`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, set[str]] = {"top": set(), "deferred": set(), "typing": set()}
    for node, when in _import_nodes(ast.parse(path.read_text(), str(path)), "top"):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            stem = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import attr` the module mod
            names = [f"{stem}.{alias.name}" for alias in node.names]
        for imported in names:
            target = _target(imported, known)
            if target is not None and target != name:
                found[when].add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def signature_lines() -> dict[str, int]:
    """Per command of `omnirl`, the lines of its hand-written typer signature (0: generated)."""
    sys.path.insert(0, str(ROOT))
    from omnirl_cli.commands import COMMANDS

    counts = {}
    for command, function in COMMANDS:
        if "__signature__" in vars(function):  # `config_command` sets the signature it generates
            counts[command] = 0
            continue
        source, _ = inspect.getsourcelines(inspect.unwrap(function))
        node = next(n for n in ast.parse("".join(source)).body if isinstance(n, ast.FunctionDef))
        counts[command] = node.body[0].lineno - node.lineno  # `def` to the line before the body
    return counts


def measure() -> dict:
    """Every counter, as one JSON-able object."""
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    runtime = {name: found["top"] | found["deferred"] for name, found in graph.items()}
    typed = {name: runtime[name] | found["typing"] for name, found in graph.items()}
    lines = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in known.values()}
    cli = {path: n for path, n in lines.items() if path.startswith("omnirl_cli/")}
    signatures = signature_lines()
    return {
        "import_cycles": cycles(runtime),
        "import_time_cycles": cycles({name: found["top"] for name, found in graph.items()}),
        "cycles_with_type_only_imports": cycles(typed),
        "cli_signature_lines": sum(signatures.values()),
        "cli_signature_lines_per_command": {k: v for k, v in signatures.items() if v},
        "omnirl_cli_lines": sum(cli.values()),
        "files_over_500": {p: n for p, n in sorted(lines.items(), key=lambda x: -x[1]) if n > 500},
        "files_over_600": {p: n for p, n in sorted(lines.items(), key=lambda x: -x[1]) if n > 600},
        "c_lookups_in_omnirl_cli": sum(len(LOOKUP.findall((ROOT / path).read_text())) for path in cli),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    result = measure()
    if parser.parse_args().json:
        print(json.dumps(result, indent=1))
        return
    for key, value in result.items():
        if isinstance(value, dict):
            print(f"{key}: {len(value)}")
            for item, n in value.items():
                print(f"  {item}: {n}")
        elif isinstance(value, list):
            print(f"{key}: {len(value)}")
            for cycle in value:
                print("  " + " ↔ ".join(cycle))
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
