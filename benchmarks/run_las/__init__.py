"""Run-aware scheduling benchmark: `queue.order: fifo` vs `run_las` at the same time on two
saturated agent engines (one per mode, each pinned to its own CPU, swapped between rounds),
with short (2-step) and long (20-step) agent runs at the same offered load.
`python -m benchmarks.run_las --out DIR` (see `run.py`); the comparison arithmetic is in
`analysis.py`."""
