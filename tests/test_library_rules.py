"""House rules of the library that a grep can hold: nothing in stages/ names one accelerator's API or
collective backend (the device comes from Accelerate, so CUDA, NPU and CPU all work), comments and
docstrings included."""

from __future__ import annotations

import re
from pathlib import Path

STAGES = Path(__file__).resolve().parents[1] / "stages"
FORBIDDEN = re.compile(r"cuda|nccl", re.IGNORECASE)


def offenders(root: Path) -> list[str]:
    """`file:line: text` of every line under `root`'s Python files that names cuda or nccl."""
    return [
        f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if FORBIDDEN.search(line)
    ]


def test_the_grep_finds_a_mention_in_code_and_in_a_docstring(tmp_path: Path) -> None:
    pkg = tmp_path / "stages"
    pkg.mkdir()
    (pkg / "a.py").write_text('"""Runs on CUDA."""\nx = 1\n')
    (pkg / "b.py").write_text("import torch\nbackend = 'NCCL'\ny = torch.device('cpu')\n")
    (pkg / "notes.txt").write_text("cuda\n")  # only Python files are library code
    assert offenders(pkg) == ['stages/a.py:1: """Runs on CUDA."""', "stages/b.py:2: backend = 'NCCL'"]


def test_stages_never_name_cuda_or_nccl() -> None:
    assert STAGES.is_dir() and any(STAGES.rglob("*.py"))
    assert offenders(STAGES) == []
