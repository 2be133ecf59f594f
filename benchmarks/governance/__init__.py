"""Benchmarks of tenant and run governance (docs/governance.md)."""
