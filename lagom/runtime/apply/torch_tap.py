"""Every collective issued through torch.distributed, recorded under its plan group name.

Transformer Engine's layers, parts of Megatron (embedding and layer-norm gradient all-reduces, the
non-sequence-parallel backward all-reduce, MoE all-to-all) and user code call ``torch.distributed``
directly, past the framework layers the adapters wrap. This tap sees them where every
``torch.distributed`` function ends up: the ``ProcessGroup`` it runs on. torch (2.14, 2.15) calls a
group's pre-hook with the tensors of each operation before issuing it and its post-hook with the
work handle right after, on the calling thread. So all_reduce, all_gather_into_tensor /
_all_gather_base / all_gather_single, all_gather, reduce_scatter_tensor / _reduce_scatter_base /
reduce_scatter_single, reduce_scatter, all_to_all_single, all_to_all, broadcast, reduce, send,
recv, isend, irecv and batch_isend_irecv are all seen, whichever module imported them and however
(an alias captured at import time included), and no torch function is replaced: torch compares
``isend``/``irecv`` and the coalesced operations by identity, which a wrapper would break. The
work the caller gets is the one torch made, untouched.

Hooks are put on every group that exists when the first subscription arrives and on every group
registered afterwards (``distributed_c10d._register_pg_in_world``, the one place torch registers a
new group: ``init_process_group``, ``new_group``, ``split_group``); the last subscription out
removes them all and puts the registration function back.

[Note: hooks never outlive Python] A hook is a Python function held by the C++ group. torch's C++
registry of groups outlives the interpreter, so a group still hooked when Python finalises is freed
by C++ later, and dropping the hook then takes the GIL of a finalised interpreter: SIGSEGV or abort at
exit, after a run that passed (Megatron's ``pretrain`` never destroys its groups). So the tap takes
its hooks off (1) when the last subscription leaves, (2) at ``atexit``, before finalisation, whether
or not a session is still open, and (3) from a group torch destroys itself: every path
(``destroy_process_group`` of one group or of all, ``_abort_process_group``, shrinking) ends in
``_unregister_process_group`` or ``_unregister_all_process_groups``, looked up in
``distributed_c10d`` at call time, and the tap observes both. It holds each hooked group strongly
until then: the default group's destruction clears torch's map before unregistering, and a group
known only weakly could lose its Python object there while C++ keeps it, hooks and all.

Which layer records a call (never two): the adapters' own layers (megatron-core's mappings and DDP
bucket groups in ``lagom_megatron.intercept``, ``deepspeed.comm`` in ``lagom_deepspeed.comm``) keep
recording what passes through them, because they know more there (a DDP bucket group's one
coalesced work, a call they decompose with Flash-Overlap, which DeepSpeed engine issued it). They
issue those calls inside ``with claimed:``, and the tap leaves every call made inside that block
to them. It records the rest, and only while a receiving recorder is inside a step: Lagom's own
agreement all-reduce and plan broadcasts, made between steps, are not the job's traffic. Where NCCL
loaded Lagom's profiler plugin, the collectives of a group matched to its communicator come from NCCL's
own records (``lagom.runtime.apply.nccl_calls``): the pre-hook leaves them at once, and the tap goes on
recording what those records do not carry there (all-to-all; sends and receives until NCCL has reported one of
the group's, and again after its first all-to-all) and every group on another backend.

Bytes follow Lagom's point convention: the gathered output of an all-gather, the unreduced input of
a reduce-scatter, the buffer of an all-reduce, broadcast and reduce, what this rank sends for
all-to-all and send; a receive is ``recv``. A coalesced all-reduce, all-gather or reduce-scatter
(one operation over several tensors, as ``_coalescing_manager`` issues it) is recorded as NCCL runs
it: one record per aggregate of ``calls.nccl_aggregates`` (tensors of one data type, any type for an
all-gather, which NCCL counts in bytes), with their total bytes and how many tensors, all ending with
the one work. Calls on groups of one rank move nothing and are not recorded.

torch's functional collectives (``torch.distributed._functional_collectives``) run on the same
groups and are seen too. Not seen: Transformer Engine's userbuffers (``--tp-comm-overlap``), which
move data by CUDA IPC rather than as collectives of a group, and an operation issued inside NCCL's
own coalescing (``batch_isend_irecv`` on NCCL) if its post-hook gets no work to time (then it is
left out rather than recorded as taking no time; not checked on a GPU yet).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from lagom.runtime.apply.nccl_calls import NcclGroup
from lagom.step.calls import nccl_aggregates

log = logging.getLogger("lagom.runtime")

HOOK_ID = 0x4C41474F  # "LAGO": the id this tap's hooks carry on each group
GroupNamer = Callable[[Any], str]  # a process group -> its name in the plan


class _Claims(threading.local):
    """``with claimed:``: calls made inside are an adapter layer's to record, not the tap's.

    Thread-local depth, so nested claims and other threads' calls are counted right.
    """

    depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


claimed = _Claims()


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.nbytes


@dataclass(frozen=True, slots=True)
class Kind:
    """How one hooked operation is recorded."""

    collective: str
    counted: str  # "input_tensors" or "output_tensors": the tensors whose bytes the record carries
    per_tensor: bool = False  # a coalesced operation: one record per NCCL aggregate (when the sides pair up)


# Keyed by torch's ``HookOpName`` names. torch 2.15 names the single-tensor and coalesced forms apart
# (``_allgather_base``, ``allreduce_coalesced``...) where 2.14 reported them as the plain operation;
# names this torch lacks are skipped when the tap is built.
KINDS: dict[str, Kind] = {
    "ALLREDUCE": Kind("all_reduce", "input_tensors", per_tensor=True),
    "ALLREDUCE_COALESCED": Kind("all_reduce", "input_tensors", per_tensor=True),
    "ALLGATHER": Kind("all_gather", "output_tensors", per_tensor=True),
    "ALLGATHER_BASE": Kind("all_gather", "output_tensors"),
    "ALLGATHER_COALESCED": Kind("all_gather", "output_tensors", per_tensor=True),
    "ALLGATHER_INTO_TENSOR_COALESCED": Kind("all_gather", "output_tensors", per_tensor=True),
    "REDUCE_SCATTER": Kind("reduce_scatter", "input_tensors", per_tensor=True),
    "REDUCE_SCATTER_BASE": Kind("reduce_scatter", "input_tensors"),
    "REDUCE_SCATTER_TENSOR_COALESCED": Kind("reduce_scatter", "input_tensors", per_tensor=True),
    "ALLTOALL": Kind("all_to_all", "input_tensors"),
    "ALLTOALL_BASE": Kind("all_to_all", "input_tensors"),
    "BROADCAST": Kind("broadcast", "input_tensors"),
    "REDUCE": Kind("reduce", "input_tensors"),
    "SEND": Kind("send_recv", "input_tensors"),
    "RECV": Kind("recv", "output_tensors"),
}


def call_sizes(kind: Kind, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(bytes, tensors) of each call NCCL makes of one hooked operation.

    All-gather and reduce-scatter in list form have one side per rank (one call); coalesced, they
    have one input per output (one call per NCCL aggregate). A coalesced all-reduce has inputs only.
    """
    return _sizes(kind, lambda side: inputs if side == "input_tensors" else outputs)


def _sizes(kind: Kind, side: Callable[[str], list[torch.Tensor]]) -> list[tuple[int, int]]:
    """``call_sizes`` reading each side only when needed: every side read from a hook's arguments
    builds a Python list of tensors, and this runs on every recorded call."""
    counted = side(kind.counted)
    if len(counted) == 1:  # the usual case
        return [(counted[0].nbytes, 1)]
    other = side("output_tensors" if kind.counted == "input_tensors" else "input_tensors")
    if not counted:  # broadcast and reduce carry the buffer on whichever side the backend fills
        counted, other = other, counted
    if kind.per_tensor and (not other or len(counted) == len(other)):
        return coalesced(kind.collective, counted)
    return [(sum(nbytes(t) for t in counted), 1)]


def coalesced(collective: str, tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(bytes, tensors) of each call NCCL makes of one coalesced operation: aggregates per data type,
    except all-gather, which NCCL runs as bytes whatever the type."""
    by_type: dict[Any, list[int]] = {}
    for t in tensors:
        by_type.setdefault(None if collective == "all_gather" else t.dtype, []).append(nbytes(t))
    return [call for sizes in by_type.values() for call in nccl_aggregates(sizes)]


def available() -> bool:
    """Whether this torch has process-group hooks (torch >= 2.14)."""
    return hasattr(dist.ProcessGroup, "register_pre_hook") and hasattr(distributed_c10d, "_register_pg_in_world")


_UNNAMED = object()  # not looked up yet (None is a looked-up group of one rank)


class Subscription:
    """One session on the process's tap: its recorder and how it names groups."""

    def __init__(self, tap: TorchTap, names: GroupNamer, recorder: Any) -> None:
        self.tap, self.recorder = tap, recorder
        self._names = names
        # id(group) -> name or None. Keyed by id so no group is kept alive by Lagom and a lookup costs
        # no weak reference; the tap forgets an id when a new group is hooked under it (ids are reused).
        self._cache: dict[int, str | None] = {}
        self.closed = False

    def name(self, group: Any) -> str | None:
        """The group's plan name; None for a group of one rank (nothing to record)."""
        name = self._cache.get(id(group), _UNNAMED)
        if name is _UNNAMED:
            name = self._cache[id(group)] = None if group.size() == 1 else self._names(group)
        return name  # type: ignore[return-value]

    def forget(self, group_id: int) -> None:
        self._cache.pop(group_id, None)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Calls made inside go to this session only (several sessions may share a process)."""
        self.tap.active.append(self)
        try:
            yield
        finally:
            if self in self.tap.active:  # closed inside the block: already gone
                self.tap.active.remove(self)

    def close(self) -> None:
        """Leave the tap (idempotent); the last subscription out removes the hooks."""
        if not self.closed:
            self.closed = True
            self.tap.remove(self)


# What a pre-hook saw, for the post-hook of the same operation: op id, group, collective, sizes,
# receivers (a plain tuple: built on every recorded call).
_Issued = tuple[int, Any, str, list[tuple[int, int]], tuple[Subscription, ...]]


class _Pending(threading.local):
    """This thread's operation between its pre-hook and its post-hook."""

    call: _Issued | None = None


class TorchTap:
    """The hooks on every process group of this process, shared by every subscribed session."""

    def __init__(self) -> None:
        from torch._C._distributed_c10d import HookOpName

        # indexed by the operation's enum value: a pybind enum hashes in Python, an int indexes a list
        self._kinds: list[Kind | None] = [None] * (1 + max(int(op.value) for op in HookOpName.__members__.values()))
        for op, kind in KINDS.items():
            if hasattr(HookOpName, op):
                self._kinds[int(getattr(HookOpName, op).value)] = kind
        self.subscriptions: list[Subscription] = []
        self.active: list[Subscription] = []  # innermost last
        # id -> group carrying this tap's hooks, held until they are taken off (see [Note: hooks never outlive Python])
        self._hooked: dict[int, Any] = {}
        self._issued = _Pending()
        # distributed_c10d name -> (torch's function, the tap's wrapper) while installed
        self._wrapped: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}
        self._failed = False
        self._install()
        atexit.register(self._uninstall)

    # -- subscriptions ----------------------------------------------------------------------------
    def add(self, subscription: Subscription) -> None:
        self.subscriptions.append(subscription)

    def remove(self, subscription: Subscription) -> None:
        global _tap
        if subscription in self.subscriptions:
            self.subscriptions.remove(subscription)
        if subscription in self.active:
            self.active.remove(subscription)
        if not self.subscriptions:
            self._uninstall()
            if _tap is self:
                _tap = None

    # -- hooks ------------------------------------------------------------------------------------
    def _install(self) -> None:
        for group in list(distributed_c10d._world.pg_map):
            self._hook(group)
        self._wrap("_register_pg_in_world", lambda original: self._registering(original))
        self._wrap("_unregister_process_group", lambda original: self._unregistering_one(original))
        self._wrap("_unregister_all_process_groups", lambda original: self._unregistering_all(original))

    def _wrap(self, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(distributed_c10d, name)
        wrapper = make(original)
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        self._wrapped[name] = (original, wrapper)
        setattr(distributed_c10d, name, wrapper)

    def _registering(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def register_pg_in_world(pg: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(pg, *args, **kwargs)
            self._hook(pg)
            return out
        return register_pg_in_world

    def _unregistering_one(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """A group torch destroys loses its hooks before torch lets it go (it is shut down already)."""
        def unregister_process_group(group_name: str) -> Any:
            for group in [g for g in self._hooked.values() if g.group_name == group_name]:
                self._unhook(group)
            return original(group_name)
        return unregister_process_group

    def _unregistering_all(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The default group's destruction: every group loses its hooks (torch's map is already cleared)."""
        def unregister_all_process_groups() -> Any:
            for group in list(self._hooked.values()):
                self._unhook(group)
            return original()
        return unregister_all_process_groups

    def _uninstall(self) -> None:
        """Put torch's functions back and take every hook off (idempotent; also run at ``atexit``)."""
        atexit.unregister(self._uninstall)
        for name, (original, wrapper) in self._wrapped.items():
            if getattr(distributed_c10d, name) is wrapper:
                setattr(distributed_c10d, name, original)
            else:
                log.warning("torch.distributed's %s was replaced after Lagom wrapped it; left as it is", name)
        self._wrapped.clear()
        for group in list(self._hooked.values()):
            self._unhook(group)

    def _unhook(self, group: Any) -> None:
        self._hooked.pop(id(group), None)
        try:
            group.unregister_pre_hook(HOOK_ID)
            group.unregister_post_hook(HOOK_ID)
        except RuntimeError as err:  # not expected: torch keeps a destroyed group's hooks until it frees it
            log.debug("could not unhook group %s: %s", getattr(group, "group_name", "?"), err)

    def _hook(self, group: Any) -> None:
        if id(group) in self._hooked or not isinstance(group, dist.ProcessGroup):
            return  # a non-member's placeholder, or a group already hooked
        for subscription in self.subscriptions:  # a new group may reuse a destroyed one's id
            subscription.forget(id(group))
        group.register_pre_hook(HOOK_ID, self._pre_hook(group))
        group.register_post_hook(HOOK_ID, self._post_hook(group))
        self._hooked[id(group)] = group

    def hooked(self, group: Any) -> bool:
        return id(group) in self._hooked

    # The hooks hold their group weakly: torch keeps them inside the group, so a strong reference would be
    # a cycle through C++ that Python's collector cannot see. The tap's own reference (``_hooked``) is
    # dropped whenever the hooks come off, which every destruction of the group does first.
    def _pre_hook(self, group: Any) -> Callable[[Any], None]:
        issued, subscriptions, active, kinds = self._issued, self.subscriptions, self.active, self._kinds
        group_ref = weakref.ref(group)

        def pre_hook(args: Any) -> None:
            if claimed.depth or not subscriptions:
                return
            try:
                kind = kinds[args.name.value]  # barriers, gather and scatter are not recorded
                if kind is None:
                    return
                # who records it: the active session, else every session; each only inside a step, and not
                # where NCCL's own records carry the group's collectives (its profiler plugin is Lagom's)
                candidates = active[-1:] if active else subscriptions
                hooked = group_ref()
                receivers = tuple([s for s in candidates if s.recorder is not None and s.recorder.in_step
                                   and not (s.recorder.nccl is not None and hooked is not None
                                            and s.recorder.from_nccl(s.name(hooked), kind.collective))])
                if receivers:
                    sizes = _sizes(kind, lambda side: getattr(args, side))
                    issued.call = (args.op_id, hooked, kind.collective, sizes, receivers)
            except Exception as err:  # noqa: BLE001 - recording must never fail the job's call
                self._fail(err)

        return pre_hook

    def _post_hook(self, group: Any) -> Callable[[Any], None]:
        """Times the operation the pre-hook saw. A blocking call on a host recorder (gloo, CPU) is waited for
        here: torch waits for it as soon as this hook returns, so waiting first changes nothing for the
        caller and gives its end without a completion callback (which gloo's thread runs under the GIL).
        Any other call is handed to the recorder with its work (CUDA events, or the work's future)."""
        issued, group_ref, now = self._issued, weakref.ref(group), time.perf_counter

        def post_hook(args: Any) -> None:
            call = issued.call
            if call is None:
                return
            issued.call = None
            op_id, group, collective, sizes, receivers = call
            if op_id != args.op_id or group is None or group is not group_ref():
                return
            try:
                work = args.work
                if work is None:  # inside NCCL's own coalescing the operation has no work to time: not a call yet
                    return
                if not args.async_op and not any(sub.recorder.cuda for sub in receivers):
                    start = now()
                    try:
                        work.wait()
                    except Exception:  # noqa: BLE001 - the caller's own wait, next, raises it; nothing to time
                        return
                    end = now()
                    for sub in receivers:
                        name = sub.name(group)
                        if name is not None:
                            for size, tensors in sizes:
                                sub.recorder.ended(name, collective, size, start, end, tensors)
                    return
                for sub in receivers:
                    name = sub.name(group)
                    if name is not None:
                        for size, tensors in sizes:  # a work without a future ends with the step (exact=False)
                            sub.recorder.track(name, collective, size, work, tensors)
            except Exception as err:  # noqa: BLE001 - recording must never fail the job's call
                self._fail(err)

        return post_hook

    def _fail(self, err: Exception) -> None:
        if not self._failed:
            self._failed = True
            log.warning("Lagom's torch.distributed recorder skipped a call it could not read (%r); the call ran "
                        "as issued", err)


_tap: TorchTap | None = None


def nccl_groups(recorder: Any, backend: str = "nccl") -> list[NcclGroup]:
    """The process groups on ``backend`` that exist now, named as the session recording into ``recorder`` names
    them (groups of one rank left out), with torch's own names for each: what NCCL's communicators are matched to
    (``lagom.runtime.apply.nccl_calls``). Empty where no subscription records into ``recorder``."""
    tap = _tap
    subscription = next((s for s in tap.subscriptions if s.recorder is recorder), None) \
        if tap is not None and recorder is not None else None
    if tap is None or subscription is None:
        return []
    out = []
    for group in list(tap._hooked.values()):
        try:
            if backend not in str(dist.get_backend(group)).lower():
                continue
            name = subscription.name(group)
        except (RuntimeError, ValueError):  # a group this rank is not in, or one torch has shut down
            continue
        if name is not None:
            aliases = tuple(a for a in (getattr(group, "group_name", ""), getattr(group, "group_desc", "")) if a)
            out.append(NcclGroup(name, group.size(), aliases))
    return out


def current_tap() -> TorchTap | None:
    """The process's tap while any session is subscribed."""
    return _tap


def subscribe(names: GroupNamer, recorder: Any) -> Subscription | None:
    """Record every torch.distributed call of this process into ``recorder`` (see the module docstring).

    ``names`` gives a process group's plan name; ``recorder`` may be set later (``subscription.recorder``),
    nothing is recorded for the session before. Returns None, after one warning, where this torch has
    no process-group hooks. ``close`` the subscription when the session ends.
    """
    global _tap
    if not available():
        log.warning("this torch (%s) has no process-group hooks: collectives issued outside the adapters' layers "
                    "(Transformer Engine's among them) are not recorded", torch.__version__)
        return None
    if _tap is None:
        _tap = TorchTap()
    subscription = Subscription(_tap, names, recorder)
    _tap.add(subscription)
    return subscription
