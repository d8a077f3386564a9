"""Lagom's NCCL tuner plugin, a C library built at install time (see lagom_nccl_tuner.h).

NCCL loads it from ``NCCL_TUNER_PLUGIN``; it reads the rules file named by ``LAGOM_NCCL_TUNER_FILE``
(``lagom.plan.emit.tuner_rules`` writes it) and applies each planned size's algorithm, protocol, channels
and chunk. Installed without a C compiler, the package has no library and ``path()`` says so.
"""

from __future__ import annotations

from pathlib import Path

from lagom.nccl_tuner.build import LIBRARY_DIR, LIBRARY_NAME

RULES_FILE_ENV = "LAGOM_NCCL_TUNER_FILE"  # the C side reads the same name (lagom_nccl_tuner.h)
UNAVAILABLE = ("Lagom's NCCL tuner plugin is not built (no C compiler at install time?): "
               "planned algorithms, protocols and per-size channels and chunks are left to NCCL; "
               "reinstall with a C compiler (pip install -e .) to build it")


def path() -> Path | None:
    """The built plugin library, or None when the install could not build it."""
    library = Path(__file__).resolve().parent / LIBRARY_DIR / LIBRARY_NAME
    return library if library.is_file() else None
