"""`python -m data_packing` runs the `longctx-pack` CLI."""

import sys

from data_packing.cli import main

sys.exit(main())
