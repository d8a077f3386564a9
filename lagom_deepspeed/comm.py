"""Every collective DeepSpeed issues, seen and timed at ``deepspeed.comm.comm.cdb``, with no added sync.

All of ZeRO's and the pipeline engine's traffic goes through the backend object ``cdb`` (a
``TorchBackend``). One ``BackendTap`` per process replaces its methods on the instance, however
many engines (sessions) run: each session ``subscribe``s with its group names, and later its
Recorder and decomposer, and ``close``s its subscription; the last one out puts the backend back
exactly as it was found. Several wrappers stacked by several engines would instead drop every
other engine's recording when one engine restored what it had captured.

A call is named (lagom group, collective, bytes) and handed to each receiving session's Recorder
together with its async work handle, which ends the record when the work completes. The receivers
are the session whose ``active()`` block is running (its engine's forward, backward or step), else
every subscribed session that records: a shared data-parallel group does not say which engine
called. A synchronous call is issued as the asynchronous one followed by ``wait()``, which is what
torch.distributed does inside a synchronous call anyway, so the stream and host semantics are
unchanged. DeepSpeed's own comms logger is not used: it synchronises after every operation, which
removes the very overlap being measured. ``new_group`` is replaced too: groups DeepSpeed creates
get ``group_desc`` = their lagom name (the newest subscription's names, which belong to the engine
being built), so the plan's per-group NCCL options reach them.

Every call through the backend is issued inside ``torch_tap.claimed``: the torch.distributed tap
(``lagom.runtime.apply.torch_tap``), which each attached session also subscribes to, leaves it to this
layer, and records only what bypasses ``deepspeed.comm`` (Transformer Engine's layers, a model's own
torch.distributed calls), for the same sessions under the same ``active()`` rule.

Byte counts follow lagom's point convention: the gathered output of an all-gather, the unreduced
input of a reduce-scatter, the buffer of an all-reduce / reduce / broadcast, what one rank sends
for all-to-all and send. A receive is recorded as ``recv`` (the other side of a pipeline send).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lagom.runtime.apply import torch_tap
from lagom.runtime.apply.torch_tap import coalesced, nbytes
from lagom_deepspeed.groups import GroupNames

log = logging.getLogger("lagom.deepspeed")


def total(ts: Sequence[torch.Tensor]) -> int:
    return sum(nbytes(t) for t in ts)


def aggregates(collective: str) -> Callable[[Sequence[torch.Tensor]], list[tuple[int, int]]]:
    """(bytes, tensors) of each call NCCL makes of a coalesced operation over these tensors (``torch_tap.coalesced``)."""
    return lambda ts: coalesced(collective, ts)


@dataclass(frozen=True)
class Spec:
    """How to read one backend method's arguments: positions follow TorchBackend's signatures."""

    collective: str
    params: tuple[str, ...]  # parameter names in positional order (after self)
    data: str  # the parameter whose bytes are counted
    count: Callable[[Any], int] = nbytes
    async_param: bool = True  # has async_op; False: a blocking point-to-point call
    # a coalesced operation: NCCL makes one call per aggregate of its tensors, each recorded on its own
    calls: Callable[[Any], list[tuple[int, int]]] | None = None


SPECS: dict[str, Spec] = {
    "all_reduce": Spec("all_reduce", ("tensor", "op", "group", "async_op"), "tensor"),
    "all_reduce_coalesced": Spec("all_reduce", ("tensors", "op", "group", "async_op"), "tensors", total,
                                 calls=aggregates("all_reduce")),
    "reduce": Spec("reduce", ("tensor", "dst", "op", "group", "async_op"), "tensor"),
    "reduce_scatter": Spec("reduce_scatter", ("output", "input_list", "op", "group", "async_op"), "input_list", total),
    "reduce_scatter_tensor": Spec("reduce_scatter", ("output_tensor", "input_tensor", "op", "group", "async_op"),
                                  "input_tensor"),
    "all_gather": Spec("all_gather", ("tensor_list", "tensor", "group", "async_op"), "tensor_list", total),
    "all_gather_into_tensor": Spec("all_gather", ("output_tensor", "input_tensor", "group", "async_op"), "output_tensor"),
    "all_gather_base": Spec("all_gather", ("output_tensor", "input_tensor", "group", "async_op"), "output_tensor"),
    "all_gather_coalesced": Spec("all_gather", ("output_tensors", "input_tensors", "group", "async_op"),
                                 "output_tensors", total, calls=aggregates("all_gather")),
    "broadcast": Spec("broadcast", ("tensor", "src", "group", "async_op"), "tensor"),
    "all_to_all_single": Spec("all_to_all", ("output", "input", "output_split_sizes", "input_split_sizes", "group",
                                             "async_op"), "input"),
    "all_to_all": Spec("all_to_all", ("output_tensor_list", "input_tensor_list", "group", "async_op"),
                       "input_tensor_list", total),
    "gather": Spec("gather", ("tensor", "gather_list", "dst", "group", "async_op"), "tensor"),
    "scatter": Spec("scatter", ("tensor", "scatter_list", "src", "group", "async_op"), "tensor"),
    "send": Spec("send_recv", ("tensor", "dst", "group", "tag"), "tensor", async_param=False),
    "recv": Spec("recv", ("tensor", "src", "group", "tag"), "tensor", async_param=False),
    "isend": Spec("send_recv", ("tensor", "dst", "group", "tag"), "tensor", async_param=False),
    "irecv": Spec("recv", ("tensor", "src", "group", "tag"), "tensor", async_param=False),
}
ASYNC_TWIN = {"send": "isend", "recv": "irecv"}  # blocking p2p issued as its async twin + wait()


class Handle:
    """Work handle of a call the wrapper ran itself (a decomposed collective).

    The P2P steps are issued in order on the caller's stream before the handle is returned, so
    ``wait()`` has nothing left to do; ``finish()`` completes the future, which ends the record.
    """

    def __init__(self) -> None:
        self._future: torch.futures.Future = torch.futures.Future()

    def finish(self) -> None:
        self._future.set_result(None)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


def _get(args: tuple, kwargs: dict, name: str, at: int, default: Any = None) -> Any:
    """Argument ``name`` (positional index ``at``) of a call, whichever way it was passed."""
    if name in kwargs:
        return kwargs[name]
    return args[at] if at < len(args) else default


def argument(spec: Spec, name: str, args: tuple, kwargs: dict, default: Any = None) -> Any:
    """Argument ``name`` of a call to the backend method that ``spec`` describes."""
    return _get(args, kwargs, name, spec.params.index(name), default)


class Decomposer(Protocol):
    """Runs some calls itself (Flash-Overlap): ``methods`` it may take; called with (method, group
    name, group, bytes, args, kwargs), returns what to run instead of the collective, or None."""

    methods: frozenset[str]

    def __call__(self, method: str, name: str, group: Any, size: int, args: tuple,
                 kwargs: dict) -> Callable[[], Any] | None: ...


class Subscription:
    """One session on the process's tap: its group names, and (from ``attach``) its Recorder and decomposer."""

    def __init__(self, tap: BackendTap, names: GroupNames) -> None:
        self.tap = tap
        self.names = names
        self.recorder: Any = None
        self.decompose: Decomposer | None = None
        # calls that bypass deepspeed.comm: recorded from ``attach`` on, under the same active() rule
        self.torch_tap: torch_tap.Subscription | None = torch_tap.subscribe(names, None)
        self.closed = False

    def attach(self, recorder: Any, decompose: Decomposer | None = None) -> None:
        """Start recording (and decomposing) for this session: call once its engine exists."""
        self.recorder, self.decompose = recorder, decompose
        self.tap.follow(_current_backend())
        self.tap.refresh()
        if self.torch_tap is not None:
            self.torch_tap.recorder = recorder

    @contextmanager
    def active(self) -> Iterator[None]:
        """Calls made inside go to this session only (wrap the engine's forward, backward and step)."""
        self.tap.active.append(self)
        try:
            if self.torch_tap is None:
                yield
            else:
                with self.torch_tap.active():
                    yield
        finally:
            self.tap.active.remove(self)

    def close(self) -> None:
        """Leave the tap (idempotent); the last subscription out restores the backend."""
        if not self.closed:
            self.closed = True
            self.tap.remove(self)
            if self.torch_tap is not None:
                self.torch_tap.close()


class BackendTap:
    """The one set of wrappers on DeepSpeed's comm backend in this process, shared by every session."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.subscriptions: list[Subscription] = []
        self.active: list[Subscription] = []  # innermost last
        self._recording: tuple[Subscription, ...] = ()  # subscriptions with a recorder, newest first
        self._found: dict[str, tuple[bool, Any]] = {}  # method -> (was in the instance's __dict__, value there)
        self._originals: dict[str, Callable[..., Any]] = {}  # what the wrappers call
        self._wrappers: dict[str, Callable[..., Any]] = {}
        self._install()

    # -- subscriptions ----------------------------------------------------------------------------
    def add(self, subscription: Subscription) -> None:
        self.subscriptions.append(subscription)
        self.refresh()

    def remove(self, subscription: Subscription) -> None:
        global _tap
        if subscription in self.subscriptions:
            self.subscriptions.remove(subscription)
        self.refresh()
        if not self.subscriptions:
            self._uninstall()
            if _tap is self:
                _tap = None

    def refresh(self) -> None:
        self._recording = tuple(s for s in reversed(self.subscriptions) if s.recorder is not None)

    def follow(self, backend: Any) -> None:
        """Move the wrappers when DeepSpeed replaced its backend object (a new ``init_distributed``)."""
        if backend is not self.backend:
            self._uninstall()
            self.backend = backend
            self._install()

    def receivers(self) -> tuple[Subscription, ...]:
        """Who records the call being made now: the active session, else every recording one."""
        if self.active:
            top = self.active[-1]
            return (top,) if top.recorder is not None else ()
        return self._recording

    # -- installing -------------------------------------------------------------------------------
    def _install(self) -> None:
        backend, own = self.backend, vars(self.backend)
        methods = [m for m in (*SPECS, "batch_isend_irecv", "new_group") if getattr(backend, m, None) is not None]
        for method in methods:
            self._found[method] = (method in own, own.get(method))
            self._originals[method] = getattr(backend, method)
        for method in methods:
            original = self._originals[method]
            if method == "new_group":
                wrapper = self._new_group(original)
            elif method == "batch_isend_irecv":
                wrapper = self._batch(original)
            elif SPECS[method].async_param:
                wrapper = self._collective(method, original)
            else:
                wrapper = self._p2p(method, original)
            wrapper = _claiming(wrapper)
            wrapper.__wrapped__ = original  # type: ignore[attr-defined]
            setattr(backend, method, wrapper)
            self._wrappers[method] = wrapper

    def _uninstall(self) -> None:
        """Put back exactly what was found: the instance attribute, or none (the class's method)."""
        own = vars(self.backend)
        for method, wrapper in self._wrappers.items():
            if own.get(method) is not wrapper:
                log.warning("DeepSpeed's comm backend %s was replaced after Lagom wrapped it; left as it is", method)
                continue
            had, value = self._found[method]
            if had:
                own[method] = value
            else:
                del own[method]
        self._found.clear()
        self._originals.clear()
        self._wrappers.clear()

    # -- recording --------------------------------------------------------------------------------
    @staticmethod
    def _track(receivers: tuple[Subscription, ...], group: Any, collective: str, size: int, work: Any,
               p2p: bool = False, calls: list[tuple[int, int]] | None = None, by_lagom: bool = False) -> Any:
        """Hand the call to each receiver's recorder; returns the work the caller gets (maybe a timing proxy).
        ``calls``: the (bytes, tensors) of each call NCCL makes of a coalesced operation (default: one of ``size``);
        ``by_lagom``: a decomposed call, which NCCL's own records never show as this collective."""
        for sub in receivers:
            name = sub.names.p2p if p2p and group is None else sub.names(group)
            for call_bytes, tensors in calls or [(size, 1)]:
                work = sub.recorder.track(name, collective, call_bytes, work, tensors, by_lagom=by_lagom)
        return work

    @staticmethod
    def _decomposed(receivers: tuple[Subscription, ...], method: str, group: Any, size: int, args: tuple,
                    kwargs: dict) -> Callable[[], Any] | None:
        for sub in receivers:
            if sub.decompose is not None and method in sub.decompose.methods:
                run = sub.decompose(method, sub.names(group), group, size, args, kwargs)
                if run is not None:
                    return run
        return None

    def _collective(self, method: str, original: Callable[..., Any]) -> Callable[..., Any]:
        """A call with ``async_op``: synchronous calls are issued async, tracked, then waited for."""
        spec = SPECS[method]
        coll, count, data, split = spec.collective, spec.count, spec.data, spec.calls
        data_at, group_at, async_at = (spec.params.index(n) for n in (data, "group", "async_op"))
        receivers, track, decomposed = self.receivers, self._track, self._decomposed

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            now = receivers()
            if not now:
                return original(*args, **kwargs)
            group = _get(args, kwargs, "group", group_at)
            tensors = _get(args, kwargs, data, data_at)
            size = count(tensors)
            calls = split(tensors) if split is not None else None
            is_async = _get(args, kwargs, "async_op", async_at, False)
            run = decomposed(now, method, group, size, args, kwargs)
            if run is not None:
                handle = Handle()
                track(now, group, coll, size, handle, by_lagom=True)
                run()
                handle.finish()
                return handle if is_async else None
            if not is_async:
                kwargs = {**kwargs, "async_op": True}
                args = args[:async_at]
            work = original(*args, **kwargs)
            if not hasattr(work, "wait"):  # DeepSpeed's comm-off switches return Noop, other ranks None
                track(now, group, coll, size, None, calls=calls)
                return work
            work = track(now, group, coll, size, work, calls=calls)  # the work, or a proxy that times its wait()
            if is_async:
                return work
            work.wait()
            return None

        return wrapped

    def _p2p(self, method: str, original: Callable[..., Any]) -> Callable[..., Any]:
        """send/recv (blocking: issued as isend/irecv, tracked, waited for) and isend/irecv."""
        spec = SPECS[method]
        coll, group_at = spec.collective, spec.params.index("group")
        twin = self._originals.get(ASYNC_TWIN.get(method, ""))
        receivers, track = self.receivers, self._track

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            now = receivers()
            if not now:
                return original(*args, **kwargs)
            group = _get(args, kwargs, "group", group_at)
            size = nbytes(_get(args, kwargs, "tensor", 0))
            if twin is None:  # isend / irecv: async by contract
                return track(now, group, coll, size, original(*args, **kwargs), p2p=True)
            track(now, group, coll, size, twin(*args, **kwargs), p2p=True).wait()
            return _get(args, kwargs, "src", 1) if method == "recv" else None

        return wrapped

    def _batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        receivers, track = self.receivers, self._track

        def wrapped(p2p_op_list: list[Any]) -> Any:
            now = receivers()
            if not now:
                return original(p2p_op_list)
            out = []
            for op, work in zip(p2p_op_list, original(p2p_op_list)):
                kind = "send_recv" if "send" in str(getattr(op.op, "__name__", op.op)) else "recv"
                out.append(track(now, op.group, kind, nbytes(op.tensor), work, p2p=True))
            return out

        return wrapped

    def _new_group(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Groups made while a session is building its engine carry that session's lagom name."""

        def wrapped(ranks: Any) -> Any:
            owner = self.active[-1] if self.active else self.subscriptions[-1] if self.subscriptions else None
            if owner is None:
                return original(ranks)
            ranks = sorted(int(r) for r in ranks)
            return dist.new_group(ranks, group_desc=owner.names.name_of_ranks(tuple(ranks)))

        return wrapped


def _claiming(wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper, run inside ``torch_tap.claimed``: what goes through deepspeed.comm is this layer's to record."""
    claimed = torch_tap.claimed

    def claiming(*args: Any, **kwargs: Any) -> Any:
        with claimed:
            return wrapper(*args, **kwargs)

    return claiming


_tap: BackendTap | None = None


def _current_backend() -> Any:
    import deepspeed.comm.comm as ds_comm

    if ds_comm.cdb is None:
        raise RuntimeError("deepspeed.comm has no backend yet: call deepspeed.comm.init_distributed first")
    return ds_comm.cdb


def current_tap() -> BackendTap | None:
    """The process's tap while any session is subscribed."""
    return _tap


def subscribe(names: GroupNames) -> Subscription:
    """Join the process's tap on DeepSpeed's backend (``deepspeed.comm.comm.cdb``), installing it for
    the first subscriber. Call before the engine is built, so that its groups get lagom names;
    ``attach`` the recorder once the engine exists; ``close`` when done."""
    global _tap
    backend = _current_backend()
    if _tap is None:
        _tap = BackendTap(backend)
    else:
        _tap.follow(backend)
    subscription = Subscription(_tap, names)
    _tap.add(subscription)
    return subscription
