"""`python -m lagom`: the `lagom` command, for environments whose scripts folder is not on PATH."""

import sys

from lagom.cli import main

sys.exit(main())
