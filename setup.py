"""Builds Lagom's NCCL tuner plugin (C, no CUDA) into lagom/nccl_tuner/; everything else is in pyproject.toml.

The plugin is an optional extension: without a C compiler the install goes on, prints why, and
``lagom.nccl_tuner.path()`` returns None. An editable install (``pip install -e .``) builds it in place.
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


class BuildTunerPlugin(build_ext):
    """Compiles the plugin as a plain shared library, under NCCL's name for it rather than a Python module's."""

    def get_ext_filename(self, fullname: str) -> str:
        if fullname.split(".")[-1] == PLUGIN_MODULE.split(".")[-1]:
            return os.path.join(*fullname.split(".")[:-1], plugin_build.LIBRARY_NAME)
        return super().get_ext_filename(fullname)

    def copy_extensions_to_source(self) -> None:
        """Editable installs copy the library into the source tree, into a folder git does not keep."""
        build_py = self.get_finalized_command("build_py")
        Path(build_py.get_package_dir(PLUGIN_MODULE.rpartition(".")[0])).mkdir(parents=True, exist_ok=True)
        super().copy_extensions_to_source()

    def build_extension(self, ext: Extension) -> None:
        if ext.name != PLUGIN_MODULE:
            super().build_extension(ext)
            return
        try:
            plugin_build.compile_plugin(Path(self.get_ext_fullpath(ext.name)))
        except plugin_build.BuildError as err:
            self.warn(f"Lagom's NCCL tuner plugin was not built: {err}\n"
                      "Lagom works without it; planned algorithms, protocols, channels and chunks per size are "
                      "then left to NCCL.")


setup(
    ext_modules=[Extension(
        PLUGIN_MODULE,
        sources=[f"{PLUGIN_DIR}/{name}" for name in plugin_build.SOURCES],
        depends=[f"{PLUGIN_DIR}/{name}" for name in plugin_build.HEADERS],
        optional=True,
    )],
    cmdclass={"build_ext": BuildTunerPlugin},
)
