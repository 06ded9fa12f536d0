"""`python -m met.cli` is the `met` command (scripts and tests run it so)."""

import sys

from met.cli import main

sys.exit(main())
