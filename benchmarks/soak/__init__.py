"""Long-running checks of the router: 2,000 concurrent streaming connections through it against
the fake engine (`python -m benchmarks.soak.connections`), and a soak at about 70 % of measured
capacity on real CPU engines (`python -m benchmarks.soak.run`). See README.md."""
