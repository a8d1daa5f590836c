"""`python -m service.cli`: the `stencild` command."""

import sys

from service.cli import main

sys.exit(main())
