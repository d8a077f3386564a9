"""Where a command will write, checked before it works: a search or a calibration must not run for
minutes and then fail on a typo in ``--out``.

A missing folder is an error rather than created: a mistyped path would otherwise scatter results
where nobody looks. The check writes and removes a probe file, because permission bits do not tell
(root ignores them; a read-only mount does not show in them).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lagom.errors import ConfigError


def _check_folder(folder: Path, flag: str) -> None:
    if not folder.exists():
        raise ConfigError(flag, f"folder {folder} does not exist", "create it first, or write elsewhere")
    if not folder.is_dir():
        raise ConfigError(flag, f"{folder} is a file, not a folder", "pass a path inside a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".lagom-write-check-")
    except OSError as err:
        raise ConfigError(flag, f"cannot write into {folder}: {err.strerror or err}",
                          "pick a folder you can write to") from None
    os.close(fd)
    os.unlink(probe)


def output_file(path: str | Path, flag: str) -> Path:
    """A file the command will (over)write: its folder exists and takes files, and it is no folder itself."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(flag, f"{path} is a folder", "pass a file name")
    _check_folder(path.parent, flag)
    return path


def output_folder(path: str | Path, flag: str) -> Path:
    """A folder the command will fill: an existing folder that takes files, or a new one inside such a
    folder (the caller creates it once the work is done, so a failed run leaves nothing behind)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(flag, f"{path} is an existing file, not a folder", "pass a folder name")
    _check_folder(path if path.exists() else path.parent, flag)
    return path
