"""`python -m router.cli`: the `gpupool` command without its console script."""

import sys

from router.cli import main

sys.exit(main())
