"""The rebalancer benchmarks: day-night on real CPU engines, static ratio vs rebalanced."""
