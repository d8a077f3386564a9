"""`python -m lagom`: the `lagom` command, for environments whose scripts folder is not on PATH."""

import sys

from lagom.cli import main

if __name__ == "__main__":  # importing the module (pkgutil walks, docs tools) runs nothing
    sys.exit(main())
