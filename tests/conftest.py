"""Test-session settings shared by every test file.

One OpenMP thread per process. Each multi-rank test runs one process per pretend GPU, and
``make test`` runs two xdist workers, so on a 2-core machine several processes already share each
core; with torch's default of one OpenMP thread per core on top, the threads spin-wait on each
other and the tiny models train about twice as slowly. Set before any test imports torch (OpenMP
reads it once, at load), and inherited by the ranks and example subprocesses the tests start.
A value the caller sets explicitly wins.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
