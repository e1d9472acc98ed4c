"""Benchmarks: speed and memory figures measured side by side in one run, printed as a table and
written as JSON under benchmarks/results/. Tests check correctness; only benchmarks measure time.

Uses swarm (trainer, tasks) and hivemind. Entry point: `python -m benchmarks.run [--quick|--full]`
(`make bench`, `make bench-full`).
"""
