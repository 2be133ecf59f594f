"""Fault scenarios on real CPU vLLM engines under load (`faults`), and the reliability report
that runs them with heavier load (`run`)."""
