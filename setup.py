"""Builds Lagom's C libraries (no CUDA): the NCCL tuner plugin into lagom/nccl_tuner/lib/, the profiler
plugin into lagom/nccl_profiler/lib/, the simulator's event loop into lagom/model/lib/; everything else is
in pyproject.toml.

Each is an optional extension: without a C compiler the install goes on and prints why;
``lagom.nccl_tuner.path()`` / ``lagom.nccl_profiler.path()`` return None and planning runs on the Python
event loop. An editable install (``pip install -e .``) builds them in place.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
PLUGIN_DIR = "lagom/nccl_tuner"


def _load_build_module():
    """lagom/nccl_tuner/build.py, loaded by path: the package itself is not importable mid-build."""
    spec = importlib.util.spec_from_file_location("lagom_nccl_tuner_build", HERE / PLUGIN_DIR / "build.py")
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {PLUGIN_DIR}/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plugin_build = _load_build_module()
# An extension name only places the file: lagom/nccl_tuner/lib/, named as get_ext_filename says.
PLUGIN_MODULE = f"lagom.nccl_tuner.{plugin_build.LIBRARY_DIR}.nccl_tuner_plugin"
PROFILER_DIR = "lagom/nccl_profiler"
PROFILER_MODULE = f"lagom.nccl_profiler.{plugin_build.LIBRARY_DIR}.nccl_profiler_plugin"
EVENT_LOOP_DIR = "lagom/model"
EVENT_LOOP_MODULE = f"lagom.model.{plugin_build.LIBRARY_DIR}.event_loop"
# Per plugin extension: what it builds, and what a job loses without it.
PLUGINS = {
    PLUGIN_MODULE: (plugin_build.TUNER, "planned algorithms, protocols, channels and chunks per size are then left to NCCL."),
    PROFILER_MODULE: (plugin_build.PROFILER, "collectives are then measured through torch's hooks alone, and the "
                      "report cannot say which algorithm, protocol and channels NCCL ran."),
    EVENT_LOOP_MODULE: (plugin_build.EVENT_LOOP, "planning then runs on the slower Python event loop (README: How fast planning is)."),
}


def _plugin(fullname: str):
    """The plugin an extension name stands for (matched on its last part, as build_ext passes either), or None."""
    for module, (library, _) in PLUGINS.items():
        if fullname.split(".")[-1] == module.split(".")[-1]:
            return module, library
    return None


class BuildTunerPlugin(build_ext):
    """Compiles each C library as a plain shared library, under its own name (NCCL's for the plugins) rather than a
    Python module's."""

    def get_ext_filename(self, fullname: str) -> str:
        plugin = _plugin(fullname)
        if plugin is not None:
            return os.path.join(*fullname.split(".")[:-1], plugin[1].name)
        return super().get_ext_filename(fullname)

    def copy_extensions_to_source(self) -> None:
        """Editable installs copy the libraries into the source tree, into folders git does not keep."""
        build_py = self.get_finalized_command("build_py")
        for module in PLUGINS:
            Path(build_py.get_package_dir(module.rpartition(".")[0])).mkdir(parents=True, exist_ok=True)
        super().copy_extensions_to_source()

    def build_extension(self, ext: Extension) -> None:
        if ext.name not in PLUGINS:
            super().build_extension(ext)
            return
        library, without = PLUGINS[ext.name]
        try:
            plugin_build.compile_library(library, Path(self.get_ext_fullpath(ext.name)))
        except plugin_build.BuildError as err:
            self.warn(f"Lagom's C library {library.name} was not built: {err}\nLagom works without it; {without}")


setup(
    ext_modules=[Extension(
        module,
        sources=[f"{folder}/{name}" for name in library.sources],
        depends=[f"{folder}/{name}" for name in library.headers],
        optional=True,
    ) for module, folder, library in ((PLUGIN_MODULE, PLUGIN_DIR, plugin_build.TUNER),
                                      (PROFILER_MODULE, PROFILER_DIR, plugin_build.PROFILER),
                                      (EVENT_LOOP_MODULE, EVENT_LOOP_DIR, plugin_build.EVENT_LOOP))],
    cmdclass={"build_ext": BuildTunerPlugin},
)
