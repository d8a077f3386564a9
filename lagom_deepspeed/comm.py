"""Every collective DeepSpeed issues, seen and timed at ``deepspeed.comm.comm.cdb``, with no added sync.

All of ZeRO's and the pipeline engine's traffic goes through the backend object ``cdb`` (a
``TorchBackend``). Its methods are replaced on the instance: each call is named (lagom group,
collective, bytes) and handed to the runtime Recorder together with its async work handle, which
ends the record when the work completes. A synchronous call is issued as the asynchronous one
followed by ``wait()``, which is what torch.distributed does inside a synchronous call anyway, so
the stream and host semantics are unchanged. DeepSpeed's own comms logger is not used: it
synchronises after every operation, which removes the very overlap being measured.

Byte counts follow lagom's point convention: the gathered output of an all-gather, the unreduced
input of a reduce-scatter, the buffer of an all-reduce / reduce / broadcast, what one rank sends
for all-to-all and send. A receive is recorded as ``recv`` (the other side of a pipeline send).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lagom_deepspeed.groups import GroupNames

def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def total(ts: Sequence[torch.Tensor]) -> int:
    return sum(nbytes(t) for t in ts)


@dataclass(frozen=True)
class Spec:
    """How to read one backend method's arguments: positions follow TorchBackend's signatures."""

    collective: str
    params: tuple[str, ...]  # parameter names in positional order (after self)
    data: str  # the parameter whose bytes are counted
    count: Callable[[Any], int] = nbytes
    async_param: bool = True  # has async_op; False: a blocking point-to-point call


SPECS: dict[str, Spec] = {
    "all_reduce": Spec("all_reduce", ("tensor", "op", "group", "async_op"), "tensor"),
    "all_reduce_coalesced": Spec("all_reduce", ("tensors", "op", "group", "async_op"), "tensors", total),
    "reduce": Spec("reduce", ("tensor", "dst", "op", "group", "async_op"), "tensor"),
    "reduce_scatter": Spec("reduce_scatter", ("output", "input_list", "op", "group", "async_op"), "input_list", total),
    "reduce_scatter_tensor": Spec("reduce_scatter", ("output_tensor", "input_tensor", "op", "group", "async_op"),
                                  "input_tensor"),
    "all_gather": Spec("all_gather", ("tensor_list", "tensor", "group", "async_op"), "tensor_list", total),
    "all_gather_into_tensor": Spec("all_gather", ("output_tensor", "input_tensor", "group", "async_op"), "output_tensor"),
    "all_gather_base": Spec("all_gather", ("output_tensor", "input_tensor", "group", "async_op"), "output_tensor"),
    "all_gather_coalesced": Spec("all_gather", ("output_tensors", "input_tensors", "group", "async_op"),
                                 "output_tensors", total),
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


class WrappedBackend:
    """Installs the timing wrappers on one backend object; ``close()`` puts the originals back."""

    def __init__(self, backend: Any, recorder: Any, names: GroupNames, decompose: Decomposer | None = None) -> None:
        self.backend = backend
        self.recorder = recorder
        self.names = names
        self.decompose = decompose
        self.originals: dict[str, Callable[..., Any]] = {
            m: getattr(backend, m) for m in SPECS if getattr(backend, m, None) is not None}
        for method, original in self.originals.items():
            spec = SPECS[method]
            wrapper = self._collective(method, spec, original) if spec.async_param else self._p2p(method, spec, original)
            wrapper.__wrapped__ = original  # type: ignore[attr-defined]
            setattr(backend, method, wrapper)
        batch = getattr(backend, "batch_isend_irecv", None)
        if batch is not None:
            self.originals["batch_isend_irecv"] = batch
            backend.batch_isend_irecv = self._wrap_batch(batch)

    def _collective(self, method: str, spec: Spec, original: Callable[..., Any]) -> Callable[..., Any]:
        """A call with ``async_op``: synchronous calls are issued async, tracked, then waited for."""
        track, names, coll, count = self.recorder.track, self.names, spec.collective, spec.count
        data, data_at = spec.data, spec.params.index(spec.data)
        group_at, async_at = spec.params.index("group"), spec.params.index("async_op")
        decompose = self.decompose if self.decompose is not None and method in self.decompose.methods else None

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            group = _get(args, kwargs, "group", group_at)
            name = names(group)
            size = count(_get(args, kwargs, data, data_at))
            is_async = _get(args, kwargs, "async_op", async_at, False)
            if decompose is not None:
                run = decompose(method, name, group, size, args, kwargs)
                if run is not None:
                    handle = Handle()
                    track(name, coll, size, handle)
                    run()
                    handle.finish()
                    return handle if is_async else None
            if not is_async:
                kwargs = {**kwargs, "async_op": True}
                args = args[:async_at]
            work = original(*args, **kwargs)
            if not hasattr(work, "wait"):  # DeepSpeed's comm-off switches return Noop, other ranks None
                track(name, coll, size, None)
                return work
            work = track(name, coll, size, work)  # the work, or a proxy that times its wait()
            if is_async:
                return work
            work.wait()
            return None

        return wrapped

    def _p2p(self, method: str, spec: Spec, original: Callable[..., Any]) -> Callable[..., Any]:
        """send/recv (blocking: issued as isend/irecv, tracked, waited for) and isend/irecv."""
        track, names, coll = self.recorder.track, self.names, spec.collective
        group_at = spec.params.index("group")
        twin = self.originals.get(ASYNC_TWIN.get(method, ""))

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            group = _get(args, kwargs, "group", group_at)
            name = names(group) if group is not None else names.p2p
            size = nbytes(_get(args, kwargs, "tensor", 0))
            if twin is None:  # isend / irecv: async by contract
                return track(name, coll, size, original(*args, **kwargs))
            track(name, coll, size, twin(*args, **kwargs)).wait()
            return _get(args, kwargs, "src", 1) if method == "recv" else None

        return wrapped

    def _wrap_batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        track, names = self.recorder.track, self.names

        def wrapped(p2p_op_list: list[Any]) -> Any:
            out = []
            for op, work in zip(p2p_op_list, original(p2p_op_list)):
                name = names(op.group) if op.group is not None else names.p2p
                kind = "send_recv" if "send" in str(getattr(op.op, "__name__", op.op)) else "recv"
                out.append(track(name, kind, nbytes(op.tensor), work))
            return out

        return wrapped

    def close(self) -> None:
        for method, original in self.originals.items():
            setattr(self.backend, method, original)
        self.originals.clear()
