"""Interception of megatron-core's overlap points: every call is recorded, TP+SP linears may be decomposed.

Where each point is caught, and why there:

- DDP gradient buckets and parameter all-gather (``param_and_grad_buffer``): the methods
  ``_ParamAndGradBucketGroup.start_grad_sync`` / ``start_param_sync``. Their collectives run inside
  ``torch.distributed._coalescing_manager``, which issues one work for the whole bucket group when
  the block ends, so only the method sees the work to time; NCCL runs the buckets of a group as one
  call per aggregate (``calls.nccl_aggregates``), and so they are recorded; it also covers the all-reduce that is
  called as ``torch.distributed.all_reduce`` and the reduce-scatter that megatron swaps for its
  fp32-accumulating variant by reassigning the module global.
- Tensor parallel (``tensor_parallel.mappings`` and ``.layers``): the module globals
  ``dist_all_gather_func`` / ``dist_reduce_scatter_func`` of both modules and ``mappings._reduce``;
  ``layers.linear_with_grad_accumulation_and_async_allreduce`` and ``RowParallelLinear.forward``
  route to Flash-Overlap where the plan decomposes the point.
- Pipeline send/recv (``pipeline_parallel.p2p_communication``): the module functions
  ``_batched_p2p_ops`` and ``_p2p_ops`` that ``P2PCommunicator._communicate`` dispatches to.

The calls recorded here are issued inside ``torch_tap.claimed``, so the torch.distributed tap
(``lagom.runtime.apply.torch_tap``, subscribed by ``install``) does not record them again; it records the
collectives that bypass these functions: Transformer Engine's layers, the embedding and layer-norm
gradient all-reduces, the backward all-reduce of a linear without sequence parallel, MoE all-to-all.

Interception never changes what is computed: a recorded call runs the original function with the
original arguments; a decomposed linear computes the same product with the same reduction per
element (Flash-Overlap), which matches up to floating-point summation order.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from lagom.flash_overlap import all_gather_matmul, matmul_reduce_scatter
from lagom.runtime.apply import torch_tap
from lagom.runtime.online.state import FlashRouter
from lagom.step.calls import nccl_aggregates
from lagom_megatron.groups import GroupNames

log = logging.getLogger("lagom.megatron")


def nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else torch_tap.nbytes(tensor)


class _Pending:
    """The work handed to the recorder for a call whose start this module times itself.

    Its future completes when the call does: right after a synchronous call returns, with the
    real work's future, or (works without one) when megatron waits for the work.
    """

    def __init__(self) -> None:
        self._future: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self._future

    def done(self) -> None:
        if not self._future.done():
            self._future.set_result(None)

    def follow(self, works: list[Any]) -> bool:
        """Signal when the last of ``works`` completes (they run in order on one communicator).

        False when that work has no future (gloo send/recv and reduce-scatter): the caller then
        hands megatron a proxy that signals when megatron waits for it.
        """
        if not works:
            self.done()
            return True
        try:
            future = works[-1].get_future()
        except (AttributeError, RuntimeError):  # no future: gloo p2p/reduce-scatter, megatron's own handles
            return False
        future.add_done_callback(lambda _: self.done())  # on GPU: runs with streams that wait for the work
        return True


class _WaitSignals:
    """Proxy for a work megatron will ``wait()`` on: counts the wait down when it returns."""

    def __init__(self, work: Any, countdown: _Countdown) -> None:
        self._work, self._countdown = work, countdown

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        self._countdown.done()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class Interceptor:
    """Installs the wrappers on megatron-core; ``uninstall`` puts every original back."""

    def __init__(self, recorder: Any, router: FlashRouter | None = None) -> None:
        self.recorder = recorder
        self.router = router or FlashRouter(enabled=False)
        self.names = GroupNames()
        self._saved: list[tuple[Any, str, Any]] = []
        self._skipped: set[str] = set()
        self._torch_tap: torch_tap.Subscription | None = None

    # -- recording
    def _start(self, group: Any, collective: str, size: int, tensors: int = 1, by_lagom: bool = False) -> _Pending:
        """A pending record for a call about to be issued; a size-1 group moves nothing and is not recorded.
        ``tensors``: how many coalesced tensors NCCL runs as this one call of ``size`` bytes; ``by_lagom``: a
        Flash-Overlap call, which NCCL's own records never show as this collective."""
        pending = _Pending()
        if not self.names.trivial(group):
            self.recorder.track(self.names.name(group), collective, size, pending, tensors, by_lagom=by_lagom)
        return pending

    def _start_coalesced(self, group: Any, collective: str, tensors: list[torch.Tensor]) -> list[_Pending]:
        """Pending records for a bucket group's collectives, issued in one coalescing block: one per call NCCL
        makes of them (``torch_tap.coalesced``), as its tuner and the plan's sizes see them."""
        return [self._start(group, collective, size, count) for size, count in torch_tap.coalesced(collective, tensors)]

    def _sync(self, group: Any, collective: str, size: int, call: Callable[[], Any], by_lagom: bool = False) -> Any:
        pending = self._start(group, collective, size, by_lagom=by_lagom)
        try:
            with torch_tap.claimed:
                return call()
        finally:
            pending.done()

    # -- install / uninstall
    def _swap(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.attr``; the wrapper carries the original's attributes (megatron keeps a
        ``warned`` flag on linear_with_grad_accumulation_and_async_allreduce and reads it by name)."""
        original = getattr(owner, attr)
        self._saved.append((owner, attr, original))
        setattr(owner, attr, functools.wraps(original)(make(original)))

    def install(self) -> Interceptor:
        from megatron.core.distributed import param_and_grad_buffer as pgb
        from megatron.core.pipeline_parallel import p2p_communication as p2p
        from megatron.core.tensor_parallel import layers, mappings

        bucket_group = pgb._ParamAndGradBucketGroup
        self._swap(bucket_group, "start_grad_sync", self._grad_sync)
        self._swap(bucket_group, "start_param_sync", self._param_sync)
        for module in (mappings, layers):
            self._swap(module, "dist_all_gather_func", lambda f: self._collective(f, "all_gather", out_arg=0))
            self._swap(module, "dist_reduce_scatter_func", lambda f: self._collective(f, "reduce_scatter", out_arg=1))
        self._swap(mappings, "_reduce", self._tp_all_reduce)
        self._swap(layers, "linear_with_grad_accumulation_and_async_allreduce", self._column_linear)
        self._swap(layers.RowParallelLinear, "forward", self._row_forward)
        self._swap(p2p, "_batched_p2p_ops", self._p2p)
        self._swap(p2p, "_p2p_ops", self._p2p)
        self._torch_tap = torch_tap.subscribe(self.names.name, self.recorder)
        return self

    def uninstall(self) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()
        if self._torch_tap is not None:
            self._torch_tap.close()
            self._torch_tap = None

    # -- data parallel
    def _grad_sync(self, original: Callable) -> Callable:
        def start_grad_sync(bucket_group: Any, force_all_reduce: bool | None = False) -> None:
            if bucket_group.is_first_batch and bucket_group.grad_reduce_handle is not None:
                return original(bucket_group, force_all_reduce=force_all_reduce)  # megatron's no-op case
            cfg = bucket_group.ddp_config
            scatter = cfg.use_distributed_optimizer and not force_all_reduce
            group = (bucket_group.intra_distributed_optimizer_instance_group if cfg.use_distributed_optimizer
                     else bucket_group.data_parallel_group)
            grads = [b.grad_data for b in bucket_group.buckets]
            pendings = self._start_coalesced(group, "reduce_scatter" if scatter else "all_reduce", grads)
            if cfg.use_distributed_optimizer and cfg.num_distributed_optimizer_instances > 1:  # each rank's shard
                shards = [nbytes(g) // bucket_group.intra_distributed_optimizer_instance_size for g in grads]
                pendings += [self._start(bucket_group.inter_distributed_optimizer_instance_group, "all_reduce", size,
                                         count) for size, count in nccl_aggregates(shards)]
            with torch_tap.claimed:
                original(bucket_group, force_all_reduce=force_all_reduce)
            self._settle(pendings, bucket_group, "grad_reduce_handle")
        return start_grad_sync

    def _param_sync(self, original: Callable) -> Callable:
        def start_param_sync(bucket_group: Any, force_sync: bool = False) -> None:
            cfg = bucket_group.ddp_config
            finishing = force_sync and bucket_group.param_gather_handle is not None  # waits, issues nothing
            if finishing or not cfg.use_distributed_optimizer and bucket_group.intra_distributed_optimizer_instance_size == 1:
                return original(bucket_group, force_sync=force_sync)
            group = bucket_group.intra_distributed_optimizer_instance_group
            if cfg.use_distributed_optimizer:
                pendings = self._start_coalesced(group, "all_gather", [b.param_data for b in bucket_group.buckets])
            else:  # layer-wise optimizer: variable-size all_gather of each rank's parameters
                sizes = [sum(b.layerwise_param_flat_sizes) * b.params_list[0].element_size()
                         for b in bucket_group.buckets if max(b.layerwise_param_flat_sizes) > 0]
                pendings = [self._start(group, "all_gather", size, count) for size, count in nccl_aggregates(sizes)]
            with torch_tap.claimed:
                original(bucket_group, force_sync=force_sync)
            self._settle(pendings, bucket_group, "param_gather_handle")
        return start_param_sync

    def _settle(self, pendings: list[_Pending], bucket_group: Any, handle_attr: str) -> None:
        """Completion of a bucket group's records: now when synchronous, else with its handle."""
        handle = getattr(bucket_group, handle_attr)
        works = [] if handle is None else [w for w in getattr(handle, "works", [handle]) if w is not None]
        if all(p.follow(works) for p in pendings):
            return
        setattr(bucket_group, handle_attr, _WaitSignals(handle, _Countdown(pendings, 1)))

    # -- tensor parallel
    def _collective(self, original: Callable, collective: str, out_arg: int) -> Callable:
        """``dist_all_gather_func(out, in, group=, async_op=)`` and the reduce-scatter twin.

        The recorded size is the whole buffer: the gathered output, the unreduced input.
        """
        def wrapped(output: torch.Tensor, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[0] if args else None)
            size = nbytes(output if out_arg == 0 else input_)
            if not kwargs.get("async_op", False):
                return self._sync(group, collective, size, lambda: original(output, input_, *args, **kwargs))
            with torch_tap.claimed:
                work = original(output, input_, *args, **kwargs)
            if self.names.trivial(group):
                return work
            # timed from issue to completion; a work without a future comes back as a proxy timed at its wait
            return self.recorder.track(self.names.name(group), collective, size, work)
        return wrapped

    def _tp_all_reduce(self, original: Callable) -> Callable:
        def _reduce(input_: torch.Tensor, group: Any) -> torch.Tensor:
            if group is None or group.size() == 1:
                return original(input_, group)
            return self._sync(group, "all_reduce", nbytes(input_), lambda: original(input_, group))
        return _reduce

    def _flash_blocked(self, why: str) -> None:
        if why not in self._skipped:
            self._skipped.add(why)
            log.warning("Flash-Overlap not used for a decomposed TP point: %s; it runs as a collective", why)

    def _column_linear(self, original: Callable) -> Callable:
        """Column-parallel GEMM with sequence parallel: all_gather_matmul where the plan says p2p.

        Arguments are read by name from megatron's own signature, so releases that add or drop
        parameters of linear_with_grad_accumulation_and_async_allreduce still route correctly.
        """
        signature = inspect.signature(original)

        def linear(*args: Any, **kwargs: Any) -> torch.Tensor:
            if not self.router.active:
                return original(*args, **kwargs)
            a = signature.bind(*args, **kwargs).arguments
            tp_group = a.get("tp_group")
            if not a.get("sequence_parallel") or tp_group is None or tp_group.size() == 1:
                return original(*args, **kwargs)
            name, size = self.names.name(tp_group), nbytes(a["input"]) * tp_group.size()
            decided = self.router.decision(name, "all_gather", size)
            if decided is None:
                return original(*args, **kwargs)
            key, cfg = decided
            if a.get("gradient_accumulation_fusion") or a.get("grad_output_buffer") is not None \
                    or a.get("gtp_remat_size", 1) > 1:
                self._flash_blocked("gradient-accumulation fusion, deferred wgrad or GTP is on")
                return original(*args, **kwargs)
            self.router.count(key)
            out = self._sync(tp_group, "all_gather", size,
                             lambda: all_gather_matmul(a["input"], a["weight"], tp_group, config=cfg), by_lagom=True)
            return out if a.get("bias") is None else out + a["bias"]
        return linear

    def _row_forward(self, original: Callable) -> Callable:
        """Row-parallel GEMM + reduce-scatter: matmul_reduce_scatter where the plan says p2p."""
        interceptor = self

        def forward(layer: Any, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            if (not interceptor.router.active or not layer.sequence_parallel or layer.explicit_expert_comm
                    or layer.tp_group.size() == 1):
                return original(layer, input_)
            size = input_.shape[:-1].numel() * layer.weight.shape[0] * input_.element_size()
            name = interceptor.names.name(layer.tp_group)
            decided = interceptor.router.decision(name, "reduce_scatter", size)
            if decided is None:
                return original(layer, input_)
            key, cfg = decided
            if (layer.gradient_accumulation_fusion or getattr(layer, "gtp_remat_size", 1) > 1
                    or not layer.weight.requires_grad or getattr(layer.config, "_cpu_offloading_context", None)):
                interceptor._flash_blocked("gradient-accumulation fusion, GTP, a frozen weight or CPU offloading is on")
                return original(layer, input_)
            interceptor.router.count(key)
            out = interceptor._sync(layer.tp_group, "reduce_scatter", size,
                                    lambda: matmul_reduce_scatter(input_, layer.weight, layer.tp_group, config=cfg),
                                    by_lagom=True)
            if layer.skip_bias_add:
                return out, layer.bias
            return (out + layer.bias if layer.bias is not None else out), None
        return forward

    # -- pipeline
    def _p2p(self, original: Callable) -> Callable:
        """Send/recv between stages; the size is what this rank sends (or receives, when it only receives)."""
        def ops(**kwargs: Any) -> Any:
            sent = nbytes(kwargs.get("tensor_send_prev")) + nbytes(kwargs.get("tensor_send_next"))
            got = nbytes(kwargs.get("tensor_recv_prev")) + nbytes(kwargs.get("tensor_recv_next"))
            if not sent and not got:
                return original(**kwargs)
            pending = self._start(kwargs["group"], "send_recv", sent or got)
            with torch_tap.claimed:
                reqs = original(**kwargs)
            works = list(reqs.values()) if isinstance(reqs, dict) else list(reqs)
            if pending.follow(works):
                return reqs
            countdown = _Countdown([pending], len(works))  # megatron waits for each request
            if isinstance(reqs, dict):
                return {k: _WaitSignals(w, countdown) for k, w in reqs.items()}
            return [_WaitSignals(w, countdown) for w in reqs]
        return ops


class _Countdown:
    """Signals its pending records once ``left`` waits have returned."""

    def __init__(self, pendings: list[_Pending], left: int) -> None:
        self.pendings, self.left = pendings, left

    def done(self) -> None:
        self.left -= 1
        if self.left == 0:
            for p in self.pendings:
                p.done()
