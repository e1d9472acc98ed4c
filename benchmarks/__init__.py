"""Benchmarks: speed and memory figures measured side by side in one run, printed as a table and
written as JSON under benchmarks/results/. Tests check correctness; only benchmarks measure time.

Uses swarm (trainer, tasks) and hivemind. Entry point: `python -m benchmarks.run [--quick|--full]`
(`make bench`, `make bench-full`).
"""

import bootstrap  # noqa: F401, E402  (first: it defers what hivemind imports and no benchmark uses, see bootstrap._private.deferred)
