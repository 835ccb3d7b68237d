"""`python -m fxflops`: the `fxflops` command."""

import sys

from fxflops.console import main

sys.exit(main())
