"""Run every `benchmarks/bench_*.py` in turn; each writes `benchmarks/results/<name>.json` and the
markdown table in `benchmarks/results/README.md`. Ratios are measured side by side in one run, so
they are meaningful on a noisy machine where absolute times are not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    failed = []
    for bench in sorted(HERE.glob("bench_*.py")):
        print(f"== {bench.name}", flush=True)
        if subprocess.run([sys.executable, str(bench), *sys.argv[1:]], cwd=HERE.parent).returncode != 0:
            failed.append(bench.name)
    print(f"results: {HERE / 'results' / 'README.md'}")
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
