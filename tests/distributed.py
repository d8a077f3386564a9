"""Run a function on several real processes joined by torch.distributed (gloo), for tests.

Each call picks a free port, so tests running side by side do not collide. A failure on any rank
re-raises in the test with that rank's traceback.

The ranks are forked from a fork server (one per test process, started at the first call) that has
imported torch and nothing else, instead of starting as new interpreters that each import torch
again: that import was seconds of every rank's start, and the suite starts a few dozen worlds. A rank
is still a fresh process for what the tests check: the server is a new interpreter whose only imports
are the torch modules below, and each rank takes the caller's environment, working folder, sys.path
and stdout/stderr as they are at the call (the server's are those of its start), as a spawned rank
does. Lagom, DeepSpeed, Megatron and the test module are imported by each rank, as before.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback
from collections.abc import Callable
from multiprocessing.reduction import DupFd
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

START_METHOD = "forkserver"
# torch's own modules, read once by the fork server: torch._inductor is what most of Megatron's import
# costs (about 4 s a rank of its 5); no module here patches another or depends on what a test sets
multiprocessing.get_context(START_METHOD).set_forkserver_preload(
    ["torch", "torch.distributed", "torch.multiprocessing", "torch._inductor.compile_fx"])


class _Inherited:
    """One of the caller's file descriptors, handed to a rank as it starts (a fork server's child
    would otherwise write to the server's stdout/stderr, not to the calling test's capture)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _received, (DupFd(self.fd),)  # pickled while a rank starts: the descriptor goes with it


def _received(dup: Any) -> int:
    return dup.detach()


def free_port() -> int:
    """A free TCP port on this host, for MASTER_PORT of ranks a test spawns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, results: Any,
           env: dict[str, str], stdio: tuple[int, int]) -> None:
    os.environ.clear()
    os.environ.update(env)
    for fd, inherited in zip((1, 2), stdio, strict=True):
        os.dup2(inherited, fd)
        os.close(inherited)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - carried back to the test process
        results[rank] = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result."""
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(_entry, args=(world_size, free_port(), fn, args, results, dict(os.environ),
                                     (_Inherited(1), _Inherited(2))),
                       nprocs=world_size, join=True, start_method=START_METHOD)
    out = []
    for rank in range(world_size):
        status, value = results[rank]
        if status == "error":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        out.append(value)
    return out
