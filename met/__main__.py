"""`python -m met` is the `met` command."""

import sys

from met.cli import main

sys.exit(main())
