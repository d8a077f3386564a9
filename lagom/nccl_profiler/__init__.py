"""Lagom's NCCL profiler plugin, a C library built at install time (see lagom_nccl_profiler.h).

NCCL loads it from ``NCCL_PROFILER_PLUGIN`` (this package's ``path()``); for every collective it writes one
record (communicator, function, size, sequence number, the algorithm, protocol, channels and warps NCCL ran,
host and GPU times) into a lock-free ring in the process. ``drain.ProfilerDrain`` reads the ring once per
step; ``what_ran`` compares what ran with a plan. Installed without a C compiler, the package has no library
and ``path()`` says so.
"""

from __future__ import annotations

from pathlib import Path

PLUGIN_ENV = "NCCL_PROFILER_PLUGIN"  # NCCL's variable naming the profiler library
LIBRARY_DIR = "lib"  # a folder without __init__.py, as for the tuner (lagom/nccl_tuner/build.py says why)
LIBRARY_NAME = "libnccl-profiler-lagom.so"  # lagom.nccl_tuner.build.PROFILER.name
UNAVAILABLE = ("Lagom's NCCL profiler plugin is not built (no C compiler at install time?): collectives are "
               "measured through torch's hooks alone; reinstall with a C compiler (pip install -e .) to build it")


def path() -> Path | None:
    """The built profiler library, or None when the install could not build it."""
    library = Path(__file__).resolve().parent / LIBRARY_DIR / LIBRARY_NAME
    return library if library.is_file() else None


def env() -> dict[str, str]:
    """The environment that makes NCCL load this install's profiler (empty when it is not built). NCCL reads it
    at its first communicator, so it must be set before the process creates one."""
    library = path()
    return {} if library is None else {PLUGIN_ENV: str(library)}
