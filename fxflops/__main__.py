"""`python -m fxflops`: the `fxflops` command."""

import sys

from fxflops.cli.console import main

sys.exit(main())
