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

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lagom_deepspeed.groups import GroupNames

log = logging.getLogger("lagom.deepspeed")


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
    group: str = "group"
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


def _arg(spec: Spec, name: str, args: tuple, kwargs: dict, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    i = spec.params.index(name)
    return args[i] if i < len(args) else default


Decomposer = Callable[[str, str, Any, int, tuple, dict], Callable[[], Any] | None]
"""(method, group name, group, bytes, args, kwargs) -> what to run instead of the collective, or None."""


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
            setattr(backend, method, self._wrap(method, SPECS[method], original))
        batch = getattr(backend, "batch_isend_irecv", None)
        if batch is not None:
            self.originals["batch_isend_irecv"] = batch
            backend.batch_isend_irecv = self._wrap_batch(batch)

    def _wrap(self, method: str, spec: Spec, original: Callable[..., Any]) -> Callable[..., Any]:
        track, names = self.recorder.track, self.names
        twin = self.originals.get(ASYNC_TWIN.get(method, ""))

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            group = _arg(spec, spec.group, args, kwargs)
            name = names(group) if group is not None or spec.async_param else names.p2p
            size = spec.count(_arg(spec, spec.data, args, kwargs))
            if self.decompose is not None:
                run = self.decompose(method, name, group, size, args, kwargs)
                if run is not None:
                    handle = Handle()
                    track(name, spec.collective, size, handle)
                    run()
                    handle.finish()
                    return handle if _arg(spec, "async_op", args, kwargs, False) else None
            if twin is not None:  # blocking send/recv: the async twin, then wait
                work = track(name, spec.collective, size, twin(*args, **kwargs))
                work.wait()
                return _arg(spec, "src", args, kwargs) if method == "recv" else None
            if not spec.async_param:  # isend / irecv: async by contract
                return track(name, spec.collective, size, original(*args, **kwargs))
            sync = not _arg(spec, "async_op", args, kwargs, False)
            if sync:
                kwargs = {**kwargs, "async_op": True}
                args = args[:spec.params.index("async_op")]
            work = original(*args, **kwargs)
            if not hasattr(work, "wait"):  # DeepSpeed's comm-off switches return Noop, other ranks None
                track(name, spec.collective, size, None)
                return work
            work = track(name, spec.collective, size, work)  # the work, or a proxy timing its wait()
            if sync:
                work.wait()
                return None
            return work

        wrapped.__wrapped__ = original  # type: ignore[attr-defined]
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
