"""Compiles Lagom's C libraries with the system C compiler (no CUDA, no NCCL headers, no Python API): the NCCL
plugins (the tuner, and the profiler in lagom/nccl_profiler/) and the simulator's event loop (lagom/model/).

setup.py loads this file by path (the package is not importable while it is being built) and calls
``compile_library`` for each of them at every install; the tests call it for sanitizer builds.
Only the standard library is imported here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

# NCCL's naming for tuner plugins (libnccl-tuner-<name>.so), in a folder without __init__.py: a .so
# beside the package's modules would look like a Python extension module to pkgutil and importlib.
LIBRARY_NAME = "libnccl-tuner-lagom.so"
LIBRARY_DIR = "lib"
SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("plugin.c", "rules.c")
HEADERS = ("lagom_nccl_tuner.h", "rules.h")
# Only the plugin structs and the functions Python calls are exported (EXPORT in each plugin.c).
FLAGS = ("-std=c11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra")


class CLibrary(NamedTuple):
    """One plugin's shared library: NCCL's file name for it, and its C sources and headers in ``source_dir``.
    (A NamedTuple: a dataclass needs its module in sys.modules, and setup.py loads this file by path.)"""

    name: str
    source_dir: Path
    sources: tuple[str, ...]
    headers: tuple[str, ...]


TUNER = CLibrary(LIBRARY_NAME, SOURCE_DIR, SOURCES, HEADERS)
# NCCL's naming for profiler plugins (libnccl-profiler-<name>.so); exports ncclProfiler_v4..v6 and the drain.
PROFILER = CLibrary("libnccl-profiler-lagom.so", SOURCE_DIR.parent / "nccl_profiler", ("plugin.c", "ring.c"),
                    ("lagom_nccl_profiler.h", "ring.h"))
# The simulator's compiled event loop (lagom.model.compiled loads it with ctypes; no NCCL naming to follow).
EVENT_LOOP = CLibrary("liblagom-event-loop.so", SOURCE_DIR.parent / "model", ("event_loop.c",), ("event_loop.h",))


class BuildError(RuntimeError):
    """The plugin could not be built; the message says why (no compiler, or the compiler's error)."""


def c_compiler() -> list[str] | None:
    """The compiler command: $CC when set, and then only it (as for make: ``CC=/nonexistent`` means no
    compiler, not another one); else the one Python was built with, else cc, gcc or clang on PATH."""
    chosen = os.environ.get("CC", "").strip()
    candidates = [chosen] if chosen else [str(sysconfig.get_config_var("CC") or ""), "cc", "gcc", "clang"]
    for candidate in candidates:
        words = shlex.split(candidate)
        if words and shutil.which(words[0]):
            return words
    return None


def compile_plugin(output: Path, extra_flags: Sequence[str] = ()) -> Path:
    """Builds the tuner's shared library at ``output`` (flags such as ``-fsanitize=address`` go in ``extra_flags``)."""
    return compile_library(TUNER, output, extra_flags)


def compile_profiler(output: Path, extra_flags: Sequence[str] = ()) -> Path:
    """Builds the profiler's shared library at ``output``, as ``compile_plugin`` builds the tuner's."""
    return compile_library(PROFILER, output, extra_flags)


def compile_library(library: CLibrary, output: Path, extra_flags: Sequence[str] = ()) -> Path:
    """Builds ``library`` at ``output``; BuildError says why it could not."""
    compiler = c_compiler()
    if compiler is None:
        chosen = os.environ.get("CC", "").strip()
        raise BuildError(f"CC={chosen} names no program" if chosen else "no C compiler found (set CC, or install gcc or clang)")
    output.parent.mkdir(parents=True, exist_ok=True)
    return _compile([*compiler, *FLAGS, *extra_flags, *(str(library.source_dir / name) for name in library.sources),
                     "-o", str(output)], output)


def compile_driver(source: Path, output: Path, include_dirs: Sequence[Path], extra_flags: Sequence[str] = ()) -> Path:
    """Builds a C program that loads a plugin with dlopen, as NCCL does (a test harness, a benchmark's driver);
    BuildError says why it could not."""
    compiler = c_compiler()
    if compiler is None:
        raise BuildError("no C compiler found (set CC, or install gcc or clang)")
    return _compile([*compiler, "-std=c11", "-Wall", "-Wextra", *extra_flags, *(f"-I{d}" for d in include_dirs),
                     str(source), "-o", str(output), "-ldl", "-lpthread"], output)


def _compile(command: list[str], output: Path) -> Path:
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as err:
        raise BuildError(f"{command[0]} could not run ({err})") from None
    if done.returncode != 0:
        raise BuildError(f"{shlex.join(command)} failed:\n{done.stderr.strip()}")
    return output
