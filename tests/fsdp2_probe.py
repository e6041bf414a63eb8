"""`omnirl update ARGS` on one rank of a torchrun launch, watching what the rank holds of the trained
module (tests/test_fsdp2.py): written to $PROBE_OUT/rank<R>.json.

- `device`: the device the rank loads onto (`stages.dist.device`).
- `param_bytes` / `shard_bytes`: the trained module's parameter bytes whole / this rank's share after
  sharding.
- `max_whole_bytes`: the most bytes of whole (gathered) tensors alive at once while saving.
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any

from stages.dist import device
from stages.update import parallel
from stages.update.parallel import Parallel, local_tensor

OUT = Path(os.environ["PROBE_OUT"])
report = {"max_whole_bytes": 0}
alive = {"bytes": 0}


setup = Parallel.setup.__func__


def _setup(cls: type[Parallel], module: Any, strategy: str, **kw: Any) -> Parallel:
    par = setup(cls, module, strategy, **kw)
    report.update(
        device=str(device()),
        param_bytes=sum(p.numel() * p.element_size() for p in module.parameters()),
        shard_bytes=sum(
            local_tensor(p).numel() * local_tensor(p).element_size() for p in module.parameters()
        ),
    )
    return par


gather = Parallel.gather


def _dropped(size: int) -> None:
    alive["bytes"] -= size


def _gather(self: Parallel, tensors: dict[str, Any], of: str | None = None) -> dict[str, Any]:
    out = gather(self, tensors, of)
    for k, v in out.items():
        if parallel.is_sharded(tensors[k]):
            size = v.numel() * v.element_size()
            alive["bytes"] += size
            weakref.finalize(v, _dropped, size)
            report["max_whole_bytes"] = max(report["max_whole_bytes"], alive["bytes"])
    return out


Parallel.setup = classmethod(_setup)
Parallel.gather = _gather
try:
    from omnirl_cli.app import main

    sys.argv = ["omnirl", *sys.argv[1:]]
    main()
finally:
    (OUT / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))
