"""What every benchmark's JSON carries about the run that produced it."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from typing import Any


def run_metadata(name: str, argv: list[str] | None, **extra: Any) -> dict[str, Any]:
    """Benchmark name, date, machine, versions and the exact command (``python -m benchmarks.NAME ...``)."""
    import hivemind
    import torch

    return {"benchmark": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "hivemind": hivemind.__version__, **extra,
            "command": shlex.join([sys.executable, "-m", f"benchmarks.{name}",
                                   *(sys.argv[1:] if argv is None else argv)])}
