"""Where the data Lagom ships lives, and where a user's own hardware presets are looked for.

The hardware presets, shipped workloads, fidelity suite, published results and Megatron patch are
package data, found through ``importlib.resources``: a wheel installed into a training image finds them
as a checkout does. No other module spells out these locations. A checkout's ``configs/`` is a link to
``lagom/configs/``, so there is one copy.

``LAGOM_HARDWARE_PATH`` (folders separated by ``os.pathsep``) holds a user's own presets, searched
before the shipped ones.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

from lagom.errors import ConfigError

HARDWARE_PATH_ENV = "LAGOM_HARDWARE_PATH"


def shipped(package: str, *parts: str) -> Path:
    """A file or folder of ``package``'s data. Lagom reads its data as files (YAML bases are found beside
    the file that names them), so an install that is not on the file system (a zip) is refused."""
    found = files(package).joinpath(*parts)
    if not isinstance(found, Path):
        raise ConfigError(package, f"its data {'/'.join(parts)} is not on the file system ({found!r})",
                          "install Lagom with pip (a wheel or the repository), not as a zip")
    return found


CONFIGS = shipped("lagom", "configs")
HARDWARE_DIR = CONFIGS / "hardware"
WORKLOAD_DIR = CONFIGS / "workloads"
FIDELITY_DIR = CONFIGS / "fidelity"
PUBLISHED_FILE = CONFIGS / "published.yaml"


def megatron_patch() -> Path:
    """The patch that adds ``--lagom`` to megatron/training (``lagom patch megatron``)."""
    return shipped("lagom_megatron", "patches", "megatron-training.patch")


def hardware_dirs() -> list[Path]:
    """The folders presets are looked for in, first match first: ``LAGOM_HARDWARE_PATH``'s, then the
    shipped ones. A folder named there that does not exist is an error, not a silently empty search."""
    user = [Path(p).expanduser() for p in os.environ.get(HARDWARE_PATH_ENV, "").split(os.pathsep) if p]
    for folder in user:
        if not folder.is_dir():
            raise ConfigError(HARDWARE_PATH_ENV, f"{folder} is not a folder",
                              f"set it to folders of hardware YAML files separated by '{os.pathsep}'")
    return [*user, HARDWARE_DIR]
