"""`python -m benchmarks ...`: the same command as `gpupool-bench` (see benchmarks/cli.py)."""

import sys

from benchmarks.cli import main

sys.exit(main())
