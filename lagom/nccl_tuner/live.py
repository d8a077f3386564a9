"""The tuner plugin's live table: rules a running job puts in force between steps (see plugin.c).

A switch has two phases, so that the ranks of a job never run different tables: ``stage`` writes the
rules into a file of its own (a private directory, mode 0600, replaced atomically) and has the plugin
instance in this process parse and hold them (through ctypes: the library NCCL loaded from the same file
is the same library); once every rank has staged, ``publish`` puts them in force with one pointer swap,
which cannot fail, and a rank whose peers could not stage calls ``discard``. ``stage(None)`` stages the
start rules (the live table out of force). The plugin refuses a file another user owns or that group or
others may write, a malformed one, one for another world size or format version, and keeps the table in
force. ``lookup`` asks the plugin which rule a call gets, with the code getCollInfo uses; ``counters``
how often NCCL called the plugin in this process.
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
class PluginCounters:
    """How often NCCL called the plugin in this process: communicator inits, getCollInfo calls, and the
    getCollInfo calls a rule was applied to. All zero: NCCL never loaded it (or ran no collective)."""

    inits: int
    coll_infos: int
    applied: int

    def since(self, before: PluginCounters) -> PluginCounters:
        return PluginCounters(self.inits - before.inits, self.coll_infos - before.coll_infos,
                              self.applied - before.applied)


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
    for name in ("lagom_tuner_live_reload", "lagom_tuner_live_stage"):
        getattr(lib, name).argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        getattr(lib, name).restype = ctypes.c_int
    lib.lagom_tuner_live_publish.argtypes = []
    lib.lagom_tuner_live_publish.restype = ctypes.c_int
    lib.lagom_tuner_live_discard.argtypes = []
    lib.lagom_tuner_live_discard.restype = None
    lib.lagom_tuner_counters.argtypes = [ctypes.POINTER(ctypes.c_uint64)] * 3
    lib.lagom_tuner_counters.restype = None
    u64, out_int = ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)
    lib.lagom_tuner_lookup.argtypes = [ctypes.c_int, u64, u64, u64, out_int, out_int, out_int, ctypes.POINTER(u64)]
    lib.lagom_tuner_lookup.restype = ctypes.c_int
    return lib


def counters(library: Path | None = None) -> PluginCounters:
    """How often NCCL called the plugin in this process (``library``: default this install's)."""
    return _counters(_library(library))


def _counters(lib: ctypes.CDLL) -> PluginCounters:
    inits, calls, applied = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
    lib.lagom_tuner_counters(ctypes.byref(inits), ctypes.byref(calls), ctypes.byref(applied))
    return PluginCounters(inits.value, calls.value, applied.value)


def body(rules_text: str, world_size: int) -> str:
    """A live table from rules text (``lagom.plan.emit.tuner_rules``); empty text is a table of no rules, which
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

    def _write(self, rules_text: str) -> None:
        """The table's file, replaced atomically (0600)."""
        tmp = self.directory / f".live.{self.generation + 1}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(body(rules_text, self.world_size))
        os.replace(tmp, self.path)
        self.generation += 1

    def _call(self, function: str, path: Path | None) -> None:
        reason = ctypes.create_string_buffer(512)
        if getattr(self._lib, function)(None if path is None else str(path).encode(), self.world_size, reason,
                                        len(reason)) != 0:
            raise LiveTableError(reason.value.decode(errors="replace"))

    def stage_file(self, path: Path | None) -> None:
        """Have the plugin parse and hold the file at ``path`` as it is now (None: the start rules);
        LiveTableError when it refuses it (nothing is staged then)."""
        self._call("lagom_tuner_live_stage", path)

    def stage(self, rules_text: str | None) -> None:
        """Write the table and have the plugin parse and hold it, unpublished (None: stage the start rules).
        LiveTableError or OSError when it cannot; nothing is staged then and the table in force stays."""
        if rules_text is not None:
            try:
                self._write(rules_text)
            except OSError:
                self.discard()
                raise
        self.stage_file(None if rules_text is None else self.path)

    def publish(self) -> bool:
        """Put the staged table in force: a pointer swap that cannot fail. False when nothing was staged."""
        return bool(self._lib.lagom_tuner_live_publish())

    def discard(self) -> None:
        """Drop the staged table; the one in force stays."""
        self._lib.lagom_tuner_live_discard()

    def put(self, rules_text: str) -> None:
        """Stage and publish at once: for a process alone (a job of several ranks stages on every rank first)."""
        self._write(rules_text)
        self._call("lagom_tuner_live_reload", self.path)

    def counters(self) -> PluginCounters:
        """How often NCCL called this process's plugin (see ``PluginCounters``)."""
        return _counters(self._lib)

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
