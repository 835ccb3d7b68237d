"""`python -m fxflops.cli`: the `fxflops` command."""

import sys

from fxflops.cli.console import main

sys.exit(main())
