"""The tuner plugin's live table: rules a running job puts in force between steps (see plugin.c).

A session writes the rules for the next step into a file of its own (a private directory, mode 0600,
replaced atomically) and tells the plugin instance in this process to read it
(``lagom_tuner_live_reload``, through ctypes: the library NCCL loaded from the same file is the same
library). The plugin refuses a file another user owns or that group or others may write, a malformed
one, one for another world size or format version, and keeps the table in force. ``lookup`` asks the
plugin which rule a call gets, with the code getCollInfo uses.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lagom import nccl_tuner

LIVE_TABLE_ENV = "LAGOM_NCCL_TUNER_LIVE"  # where the session's live table is (for people and tools reading the env)
HEADER = "lagom-nccl-tuner 1"
ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")  # NCCL_ALGO_* order
PROTOCOLS = ("ll", "ll128", "simple")  # NCCL_PROTO_* order
COLLECTIVES = {"broadcast": 0, "reduce": 1, "all_gather": 2, "reduce_scatter": 3, "all_reduce": 4}  # ncclFunc_t


class LiveTableError(RuntimeError):
    """The plugin refused a live table (the message says why); the table in force stays."""


@dataclass(frozen=True)
class RuleChoice:
    """What the plugin gives a call: NCCL's algorithm and protocol names, channels, chunk bytes."""

    algorithm: str
    protocol: str
    channels: int
    chunk: int


def _library(path: Path | None = None) -> ctypes.CDLL:
    path = path or nccl_tuner.path()
    if path is None:
        raise LiveTableError(nccl_tuner.UNAVAILABLE)
    lib = ctypes.CDLL(str(path))  # the instance NCCL loaded, when it loaded this file
    lib.lagom_tuner_live_reload.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.lagom_tuner_live_reload.restype = ctypes.c_int
    u64, out_int = ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)
    lib.lagom_tuner_lookup.argtypes = [ctypes.c_int, u64, u64, u64, out_int, out_int, out_int, ctypes.POINTER(u64)]
    lib.lagom_tuner_lookup.restype = ctypes.c_int
    return lib


def body(rules_text: str, world_size: int) -> str:
    """A live table from rules text (``lagom.emit.tuner_rules``); empty text is a table of no rules, which
    leaves every call to NCCL."""
    return rules_text if rules_text.strip() else f"{HEADER}\nworld {world_size}\n"


class LiveTable:
    """One session's live table; ``close`` removes its file and directory."""

    def __init__(self, world_size: int, directory: Path, lib: ctypes.CDLL) -> None:
        self.world_size, self.directory, self._lib = world_size, directory, lib
        self.path = directory / "live.lagom"
        self.generation = 0

    @classmethod
    def create(cls, world_size: int, directory: Path | None = None, library: Path | None = None) -> LiveTable:
        """A private directory (0700; made under ``directory``, else the system's temporary one). ``library``:
        the plugin to talk to (default: this install's, the one NCCL is pointed at)."""
        lib = _library(library)
        made = Path(tempfile.mkdtemp(prefix=f"lagom-live-{os.getpid()}-", dir=directory))
        os.chmod(made, 0o700)
        return cls(world_size, made, lib)

    def put(self, rules_text: str) -> None:
        """Write the table (atomically, 0600) and put it in force in this process's plugin."""
        tmp = self.directory / f".live.{self.generation + 1}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(body(rules_text, self.world_size))
        os.replace(tmp, self.path)
        self.generation += 1
        self.reload()

    def reload(self) -> None:
        """Ask the plugin to read the file as it is now; LiveTableError when it refuses it."""
        reason = ctypes.create_string_buffer(512)
        if self._lib.lagom_tuner_live_reload(str(self.path).encode(), self.world_size, reason, len(reason)) != 0:
            raise LiveTableError(reason.value.decode(errors="replace"))

    def lookup(self, collective: str, nbytes: int, nranks: int, nnodes: int) -> RuleChoice | None:
        """The rule the plugin gives such a call now, or None (NCCL decides)."""
        algo, proto, channels, chunk = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_uint64()
        found = self._lib.lagom_tuner_lookup(COLLECTIVES[collective], nbytes, nranks, nnodes, ctypes.byref(algo),
                                             ctypes.byref(proto), ctypes.byref(channels), ctypes.byref(chunk))
        if not found:
            return None
        return RuleChoice(ALGORITHMS[algo.value], PROTOCOLS[proto.value], channels.value, chunk.value)

    def close(self) -> None:
        """Remove the file and the directory (idempotent). The plugin keeps the rules it read."""
        shutil.rmtree(self.directory, ignore_errors=True)
