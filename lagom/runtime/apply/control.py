"""Lagom's own collectives: issued by every rank or by none, on a group of Lagom's own, under a timeout.

Lagom talks between ranks only to agree: rank 0's hardware choice and start plan, whether any rank
saw drift or failed, and what the online tuner decided. Each of these is one call of this module,
made at a point every rank reaches in the same order (start-up inside the framework's own
initialisation, or a step boundary whose number every rank knows). The calls run on a gloo group
made for Lagom alone, created the first time it is needed:

- it is never a group the framework may destroy or abort under Lagom;
- its timeout (``timeout_s``) is the watchdog: a rank that does not arrive (an exception on that rank,
  a rank gone) turns the others' wait into a ``ControlError`` after ``timeout_s`` instead of a hang;
- after one failure the group is never used again (a timed-out gloo collective leaves its peers out of
  step), so the caller switches Lagom off and the framework runs on its own settings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lagom.errors import LagomError
from lagom.runtime.apply import torch_tap

log = logging.getLogger("lagom.runtime")

DEFAULT_TIMEOUT_S = 600.0  # NCCL's own default watchdog: rank 0's start-up search runs inside it
GROUP_DESC = "lagom_control"


class ControlError(LagomError):
    """A collective of Lagom's own failed or timed out on this rank; Lagom must switch itself off."""


class Control:
    """The agreement channel of one session; ``close`` destroys its group."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.group: Any = None
        self.broken: str | None = None  # why the channel may not be used again
        self.calls = 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _group(self) -> Any:
        if self.group is None:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s),
                                        group_desc=GROUP_DESC)
        return self.group

    def _run(self, what: str, call: Callable[[Any], Any]) -> Any:
        if self.broken is not None:
            raise ControlError(f"Lagom's agreement channel is closed ({self.broken}); not running {what}")
        self.calls += 1
        try:
            with torch_tap.claimed:  # Lagom's own traffic is never recorded as the job's
                return call(self._group())
        except ControlError:
            raise
        except Exception as err:  # noqa: BLE001 - a timeout or a peer gone: no rank may wait on this again
            self.broken = f"{what} failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            self._destroy()
            raise ControlError(f"{what}: a collective of Lagom's own failed or timed out after {self.timeout_s:g} s "
                               f"on rank {self.rank()} ({type(err).__name__}: {err})") from err

    def broadcast(self, value: Any, what: str) -> Any:
        """Rank 0's ``value`` on every rank (``value`` is ignored elsewhere)."""
        if not self.distributed:
            return value

        def call(group: Any) -> Any:
            box = [value if self.rank() == 0 else None]
            dist.broadcast_object_list(box, group=group, group_src=0)
            return box[0]

        return self._run(what, call)

    def on_rank0(self, build: Callable[[], Any], what: str) -> Any:
        """``build()`` run on rank 0 and its result on every rank; a LagomError it raises is raised everywhere."""
        result: Any = None
        if self.rank() == 0:
            try:
                result = build()
            except LagomError as err:
                result = err
            except Exception as err:  # noqa: BLE001 - every rank must hear of it, or the others wait
                result = LagomError(f"{what} failed on rank 0: {type(err).__name__}: {err}")
        result = self.broadcast(result, what)
        if isinstance(result, LagomError):
            raise result
        return result

    def max(self, values: list[float], what: str) -> list[float]:
        """Each value's maximum over the ranks (one small all-reduce)."""
        if not self.distributed:
            return list(values)

        def call(group: Any) -> list[float]:
            tensor = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
            return [float(v) for v in tensor.tolist()]

        return self._run(what, call)

    def any(self, flags: list[bool], what: str) -> list[bool]:
        """For each flag, whether any rank raised it."""
        return [v > 0 for v in self.max([float(f) for f in flags], what)]

    def _destroy(self) -> None:
        group, self.group = self.group, None
        if group is not None and dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except Exception as err:  # noqa: BLE001 - the default group may be gone already
                log.debug("Lagom's agreement group was not destroyed cleanly: %s", err)

    def close(self) -> None:
        """Destroy the group (idempotent); the channel cannot be used afterwards."""
        self.broken = self.broken or "closed"
        self._destroy()
