"""Entry point: `python -m benchmarks.router_overhead [--quick] --out DIR`."""

import sys

from benchmarks.router_overhead.cli import main

sys.exit(main())
