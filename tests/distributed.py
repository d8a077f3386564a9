"""Run a function on several real processes joined by torch.distributed (gloo), for tests.

Each call picks a free port, so tests running side by side do not collide. A failure on any rank
re-raises in the test with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on this host, for MASTER_PORT of ranks a test spawns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, results: Any) -> None:
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
    mp.spawn(_entry, args=(world_size, free_port(), fn, args, results), nprocs=world_size, join=True)
    out = []
    for rank in range(world_size):
        status, value = results[rank]
        if status == "error":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        out.append(value)
    return out
