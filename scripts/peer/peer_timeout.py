"""pytest plugin: ``--peer-timeout SECONDS`` fails a test phase that runs longer, instead of hanging the run.

DeepSpeed's harness runs each distributed test in pool workers and waits for them up to
``DS_UNITTEST_TIMEOUT`` (600 s), then ends the whole session with ``pytest.exit``. A worker whose
exception cannot be unpickled, or a rank stuck in a collective, would stop every test after it.
Here SIGALRM fires first: every process this pytest process started (pool workers, spawned ranks,
compilers) is killed, so the harness's wait returns, and the phase fails with ``PeerTimeout``.
multiprocessing's own helpers (the forkserver and the resource tracker) are spared: a pool's worker
thread needs the forkserver to replace the killed workers when the harness closes the pool.
After the first expiry the alarm repeats every ``REPEAT_S`` seconds until the phase ends, so a
cleanup that waits on the killed workers (DeepSpeed closes its pool in a ``finally``) fails too.
A test blocked inside C code (no Python bytecode runs) is only interrupted when it returns to Python.
A pool whose result thread died (a worker's exception that cannot be unpickled) also hangs the
interpreter's exit in multiprocessing's finalizers; so once a phase has expired, the session ends
with ``os._exit`` after every other plugin has finished (junit XML and the summary are written).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPEAT_S = 30.0
MULTIPROCESSING_HELPERS = (b"multiprocessing.forkserver", b"multiprocessing.resource_tracker")


_session: dict[str, Any] = {"expired": False, "exitstatus": 0}


class PeerTimeout(Exception):
    """A test phase ran past ``--peer-timeout``."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--peer-timeout", type=float, default=0.0, metavar="SECONDS",
                     help="fail a test phase (setup, call, teardown) after this long and kill its child processes")


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, read from /proc."""
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended while we looked
            continue
        ppid = int(text.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(stat.parent.name))
    return tree


def _is_multiprocessing_helper(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return any(name in cmdline for name in MULTIPROCESSING_HELPERS)


def _kill_descendants() -> list[int]:
    """SIGKILL every descendant of this process but its multiprocessing helpers.

    The helpers are this process's own children; the pool workers the forkserver forked carry the
    forkserver's command line too, but they are its children and are killed.
    """
    tree = _children()
    own = tree.get(os.getpid(), [])
    killed, todo = [], [pid for pid in own if not _is_multiprocessing_helper(pid)]
    todo += [child for pid in own if _is_multiprocessing_helper(pid) for child in tree.get(pid, [])]
    while todo:
        pid = todo.pop()
        todo.extend(tree.get(pid, []))
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    seconds = item.config.getoption("--peer-timeout")
    if not seconds:
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        _session["expired"] = True
        killed = _kill_descendants()
        raise PeerTimeout(f"{item.nodeid} ran past --peer-timeout {seconds:g} s; killed child processes {killed}")

    previous = signal.signal(signal.SIGALRM, expired)
    try:
        yield
    finally:
        _disarm()
        signal.signal(signal.SIGALRM, previous)


def _arm(item: pytest.Item) -> None:
    seconds = item.config.getoption("--peer-timeout")
    if seconds:
        signal.setitimer(signal.ITIMER_REAL, seconds, REPEAT_S)


def _disarm() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _arm(item)
    yield
    _disarm()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _arm(item)
    yield
    _disarm()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    _arm(item)
    yield
    _disarm()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _session["exitstatus"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if not _session["expired"]:
        return
    _kill_descendants()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_session["exitstatus"])
