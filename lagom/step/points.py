"""Every overlap point of one training step, derived from a workload and a machine.

A step is a list of phases (a phase repeats, e.g. identical gradient-accumulation micro-batches).
A phase holds, per device (one representative GPU per pipeline stage), the compute segments in
compute-stream order, and the overlap points: collectives that are released when one segment ends
(``after``) and that another segment waits for (``before``; ``None`` means the end of the phase).
Whatever runs between the two is the compute the collective can hide under.

The graph's data types are ``lagom.step.graph``'s and the frameworks' bucket rules ``lagom.step.buckets``'; what
is left here (about 860 lines) is one builder: the layers' arithmetic, the micro-batch and pipeline schedules and
where each framework's collectives fall all write into the same per-device streams, so they stay together. The
streams write each phase's columns (``PhaseColumns``) as they go, a stamped block's as its template's rows, so
that the model's index does not read hundreds of thousands of objects back.
"""

from __future__ import annotations

import gc
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import numpy as np

from lagom.hardware import Hardware
from lagom.step.buckets import Bucket, ParamTensor, deepspeed_buckets, megatron_buckets
from lagom.step.graph import (
    COLLECTIVE_ID,
    NO_SEGMENT,
    NOT_A_SEGMENT,
    Collective,
    ComputeSegment,
    Group,
    OverlapPoint,
    Phase,
    PhaseColumns,
    StepGraph,
    make_groups,
)
from lagom.step.workload import DTYPE_BYTES, Workload

# ---------------------------------------------------------------------------------------------
# Process groups



# ---------------------------------------------------------------------------------------------
# Building a phase


@dataclass
class _Pending:
    point: OverlapPoint
    wait: int  # how many more segments until the one that waits for it
    at: int  # the point's place in its stream


@dataclass
class _Block:
    """One micro-batch's forward or backward on one stage: its first and last segments, by name and by index."""

    first: str
    last: str
    first_at: int
    last_at: int


@dataclass
class _Template:
    """A block as recorded once per stage and kind, to stamp for every other micro-batch: its segments and
    collectives (names under ``prefix``), each collective's after, before and fused segment by where a
    stamp finds them, collectives still waiting at its end (index, segments to go), and the layers whose
    gradients it completes (offsets of their last segments)."""

    prefix: str
    segments: list[ComputeSegment]
    points: list[OverlapPoint]
    refs: list[tuple[int, int, int]]  # per collective: its after, before and fused segment, as ``stamp`` finds them
    pending: list[tuple[int, int]]
    ready: dict[int | str, int]
    rows: tuple[np.ndarray, np.ndarray]  # its segments and collectives as columns' rows (``_Columns.template``)


NEXT = -3  # a point's fused segment is the one that waits for it, not known yet (``fuse="next"``)


class _Columns:
    """A stream's segments and points as ``PhaseColumns`` will hold them, written as the stream is built (a row per
    segment or point, a template's rows per stamped block) rather than read off the objects afterwards. Rows come
    in chunks: the loose rows since the last stamp, and each stamp's template rows, whose segment references
    (``after``, ``before``, ``fuse``: >= 0) count from the stamp's base. Points still waiting when they were added
    get their ``before`` in ``waited``; groups are numbered per stream (``groups``)."""

    def __init__(self) -> None:
        self.segments: list[np.ndarray] = []  # chunks of rows: flops, bytes, CTAs
        self.points: list[np.ndarray] = []  # chunks of rows: after, before, fuse, collective, bytes, group
        self.bases: list[int] = []  # per chunk of points
        self.waited: dict[int, int] = {}  # a point's place in the stream -> the index of the segment waiting for it
        self.groups: dict[Group, int] = {}
        self._segment_rows: list[tuple[float, float, int]] = []
        self._point_rows: list[tuple[int, int, int, int, int, int]] = []

    def segment(self, flops: float, bytes_: float, ctas: int) -> None:
        self._segment_rows.append((flops, bytes_, ctas))

    def point(self, after: int, fuse: int, collective: Collective, nbytes: int, group: Group) -> None:
        """A collective released after segment ``after`` (an index) whose waiting segment is not known yet."""
        self._point_rows.append((after, NO_SEGMENT, fuse, COLLECTIVE_ID[collective], nbytes,
                                 self.groups.setdefault(group, len(self.groups))))

    def template(self, segments: list[ComputeSegment], points: list[OverlapPoint],
                 refs: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """A recorded block's rows: its segments, and its points with their references as ``refs`` has them."""
        return (np.asarray([(seg.flops, seg.bytes, seg.ctas) for seg in segments], dtype=np.float64).reshape(-1, 3),
                np.asarray([(after, before, NEXT if fuse == -2 else fuse, COLLECTIVE_ID[pt.collective], pt.bytes,
                             self.groups.setdefault(pt.group, len(self.groups)))
                            for pt, (after, before, fuse) in zip(points, refs)], dtype=np.int64).reshape(-1, 6))

    def stamp(self, rows: tuple[np.ndarray, np.ndarray], base: int) -> None:
        self._flush()
        self.segments.append(rows[0])
        self.points.append(rows[1])
        self.bases.append(base)

    def _flush(self) -> None:
        if self._segment_rows:
            self.segments.append(np.asarray(self._segment_rows, dtype=np.float64))
            self._segment_rows = []
        if self._point_rows:
            self.points.append(np.asarray(self._point_rows, dtype=np.int64))
            self.bases.append(0)
            self._point_rows = []

    def arrays(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        """(segment rows, point rows) with every reference a global segment id, the stream's device's segments
        numbered from ``offset``."""
        self._flush()
        segments = np.concatenate(self.segments) if self.segments else np.zeros((0, 3))
        if not self.points:
            return segments, np.zeros((0, 6), dtype=np.int64)
        points = np.concatenate(self.points)
        refs = points[:, :3]  # a view: written in place
        base = np.repeat(np.asarray(self.bases, dtype=np.int64), [len(chunk) for chunk in self.points])
        refs += (refs >= 0) * base[:, None]  # -1 where a block at the stream's start refers to the one before
        if self.waited:
            refs[list(self.waited), 1] = list(self.waited.values())
        # a NEXT fuse is the segment that waits (none waiting: as on the objects, a name no segment has)
        refs[:, 2] = np.where(refs[:, 2] == NEXT, np.where(refs[:, 1] >= 0, refs[:, 1], NOT_A_SEGMENT), refs[:, 2])
        refs += (refs >= 0) * offset
        return segments, points


class _DeviceStream:
    """Appends segments in compute order and wires collectives to the segments around them."""

    def __init__(self, device: int, phase: str, prefix: str) -> None:
        self.device, self.phase, self.prefix = device, phase, prefix
        self.segments: list[ComputeSegment] = []
        self.points: list[OverlapPoint] = []
        self._pending: list[_Pending] = []
        # the same as columns (None once a reference could not be placed: the phase's columns are read off the
        # objects then), and the index of every segment a later collective may name (each one that was the last)
        self.columns: _Columns | None = _Columns()
        self._index: dict[str | None, int] = {None: NO_SEGMENT}

    @property
    def last(self) -> str | None:
        return self.segments[-1].name if self.segments else None

    def seg(self, name: str, flops: float, bytes_: float, ctas: float) -> str:
        full = f"{self.prefix}{name}"
        self.segments.append(ComputeSegment(full, flops, bytes_, max(1, int(ctas)), self.device))
        at = self._index[full] = len(self.segments) - 1
        if self.columns is not None:
            self.columns.segment(flops, bytes_, max(1, int(ctas)))
        still = []
        for pend in self._pending:
            pend.wait -= 1
            if pend.wait == 0:
                pend.point.before = full
                if pend.point.fuse_with == "next":
                    pend.point.fuse_with = full
                if self.columns is not None:
                    self.columns.waited[pend.at] = at
            else:
                still.append(pend)
        self._pending = still
        return full

    def comm(self, name: str, coll: Collective, group: Group, nbytes: float, *, wait: int | None,
             fuse: str | None = None, after: str | None = "last") -> OverlapPoint | None:
        """Release a collective now (after the last segment); ``wait``: the wait-th next segment needs it.

        ``fuse``: "next" (all-gather feeding the next GEMM) or "prev" (reduce-scatter of the last GEMM).
        Groups of one rank need no communication and add nothing.
        """
        if group.size <= 1 or nbytes <= 0:
            return None
        point = OverlapPoint(
            name=f"{self.prefix}{name}", collective=coll, group=group, bytes=int(nbytes),
            after=self.last if after == "last" else after, before=None, device=self.device,
            fuse_with=(self.last if fuse == "prev" else fuse), phase=self.phase,
        )
        self.points.append(point)
        if wait is not None:
            self._pending.append(_Pending(point, wait, len(self.points) - 1))
        c = self.columns
        if c is not None:
            if point.after not in self._index:  # a name this stream does not index: no columns from the builder
                self.columns = None
                return point
            c.point(self._index[point.after], NEXT if fuse == "next" else len(self.segments) - 1 if fuse == "prev"
                    else NO_SEGMENT, coll, point.bytes, group)
        return point

    def record(self, build: Callable[[], _Block], ready: dict[int | str, str]) -> tuple[_Block, _Template | None]:
        """Run ``build`` (one block appended to this stream) and keep it as a template for ``stamp``; None
        where it refers to a segment before the one that precedes it (a stamp could not place that)."""
        a, pa = len(self.segments), len(self.points)
        before_ready = dict(ready)
        block = build()
        # where a stamp finds each name: [the segment before the block, the block's segments, "next", None]
        index: dict[str | None, int] = {seg.name: n - a + 1 for n, seg in enumerate(self.segments[max(0, a - 1):], max(0, a - 1))}
        index.update({"next": -2, None: -1})
        first: dict[str | None, int] = {None: 0} if a == 0 else {}  # released before any segment: after "the one before the block"
        pending = {id(pend.point): pend.wait for pend in self._pending}
        refs = [(first.get(pt.after, index.get(pt.after)), index.get(pt.before), index.get(pt.fuse_with))
                for pt in self.points[pa:]]
        marks = {key: index.get(name, 0) - 1 for key, name in ready.items() if before_ready.get(key) != name}
        if any(after is None or after < 0 or before is None or fuse is None for after, before, fuse in refs) \
                or any(offset < 0 for offset in marks.values()):
            return block, None
        left = [(n, pending[id(pt)]) for n, pt in enumerate(self.points[pa:]) if id(pt) in pending]
        c = self.columns
        if c is None:
            return block, None
        rows = c.template(self.segments[a:], self.points[pa:], refs)  # type: ignore[arg-type]
        return block, _Template(self.prefix, self.segments[a:], self.points[pa:], refs, left, marks, rows)  # type: ignore[arg-type]

    def stamp(self, t: _Template, ready: dict[int | str, str]) -> _Block:
        """Append a copy of a recorded block under this stream's prefix: the same segments and collectives,
        every reference moved to the copy (collectives still waiting from earlier blocks are wired as
        ``seg`` wires them)."""
        a, cut, prefix, device, phase = len(self.segments), len(t.prefix), self.prefix, self.device, self.phase
        segs = [ComputeSegment(prefix + s.name[cut:], s.flops, s.bytes, s.ctas, device) for s in t.segments]
        names = [self.segments[-1].name if a else None] + [s.name for s in segs] + ["next", None]
        self.segments.extend(segs)
        c = self.columns
        still = []
        for pend in self._pending:
            if pend.wait < len(names) - 2:
                pend.point.before = names[pend.wait]
                if pend.point.fuse_with == "next":
                    pend.point.fuse_with = pend.point.before
                if c is not None:
                    c.waited[pend.at] = a - 1 + pend.wait
            else:
                pend.wait -= len(segs)
                still.append(pend)
        new = [OverlapPoint(prefix + pt.name[cut:], pt.collective, pt.group, pt.bytes, names[after], names[before],
                            device, None, names[fuse], phase)
               for pt, (after, before, fuse) in zip(t.points, t.refs)]
        pa = len(self.points)
        self.points.extend(new)
        self._pending = still + [_Pending(new[n], wait, pa + n) for n, wait in t.pending]
        if c is not None:
            c.stamp(t.rows, a - 1)
        ready.update((key, segs[offset].name) for key, offset in t.ready.items())
        self._index.update((segs[offset].name, a + offset) for offset in (*t.ready.values(), len(segs) - 1))
        return _Block(segs[0].name, segs[-1].name, a, a + len(segs) - 1)


class _StepBuilder:
    """Knows the model's arithmetic: FLOPs, bytes and collectives of each layer."""

    def __init__(self, wl: Workload, hw: Hardware) -> None:
        self.wl, self.hw = wl, hw
        self.groups = make_groups(wl, hw)
        m, p = wl.model, wl.parallel
        self.b = wl.dtype_bytes
        self.grad_b = DTYPE_BYTES[wl.training.grad_dtype]
        self.seq = m.seq_len  # the sequence the layers being built see
        self.tokens = wl.training.micro_batch * m.seq_len // p.cp  # tokens per rank before TP/SP split
        self.kv = m.kv_heads or m.heads
        self.head_dim = m.hidden // m.heads
        self.deepspeed_buckets: dict[int, list[tuple[int | str, dict[str, float]]]] = {}  # per stage, built once

    # -- arithmetic helpers
    def _tiles(self, rows: float, cols: float) -> int:
        tm, tn = self.hw.gpu.gemm_tile
        return math.ceil(rows / tm) * math.ceil(cols / tn)

    def _gemm(self, s: _DeviceStream, name: str, rows: float, inner: float, cols: float, passes: int = 1) -> str:
        """``passes`` = 2 in backward (input gradient and weight gradient in one segment)."""
        flops = 2.0 * rows * inner * cols * passes
        nbytes = self.b * (rows * inner + inner * cols + rows * cols) * passes
        return s.seg(name, flops, nbytes, self._tiles(rows, cols))

    def _elementwise(self, s: _DeviceStream, name: str, elems: float, rw: float = 2.0) -> str:
        return s.seg(name, 0.0, elems * self.b * rw, elems / 1024)

    # -- tensor-parallel linears (megatron-core ColumnParallelLinear / RowParallelLinear)
    def column_linear(self, s: _DeviceStream, name: str, in_f: int, out_f: int, backward: bool) -> None:
        tp, sp = self.groups["tp"], self.wl.parallel.sequence_parallel
        T, act = self.tokens, self.tokens * in_f * self.b
        cols = out_f / tp.size
        if not backward:
            if sp:
                s.comm(f"{name}.ag", Collective.ALL_GATHER, tp, act, wait=1, fuse="next")
            self._gemm(s, name, T, in_f, cols)
            return
        if sp:  # re-gather the input for the weight gradient while the input gradient is computed
            s.comm(f"{name}.bwd.ag", Collective.ALL_GATHER, tp, act, wait=2)
        self._gemm(s, f"{name}.dgrad", T, cols, in_f)
        coll = Collective.REDUCE_SCATTER if sp else Collective.ALL_REDUCE
        s.comm(f"{name}.bwd.{'rs' if sp else 'ar'}", coll, tp, act, wait=2, fuse="prev" if sp else None)
        self._gemm(s, f"{name}.wgrad", in_f, T, cols)

    def row_linear(self, s: _DeviceStream, name: str, in_f: int, out_f: int, backward: bool) -> None:
        tp, sp = self.groups["tp"], self.wl.parallel.sequence_parallel
        T, act = self.tokens, self.tokens * out_f * self.b
        rows_in = in_f / tp.size
        if not backward:
            self._gemm(s, name, T, rows_in, out_f)
            coll = Collective.REDUCE_SCATTER if sp else Collective.ALL_REDUCE
            s.comm(f"{name}.{'rs' if sp else 'ar'}", coll, tp, act, wait=1, fuse="prev" if sp else None)
            return
        if sp:
            s.comm(f"{name}.bwd.ag", Collective.ALL_GATHER, tp, act, wait=1, fuse="next")
        self._gemm(s, f"{name}.grad", T, out_f, rows_in, passes=2)

    # -- blocks
    def norm(self, s: _DeviceStream, name: str, backward: bool) -> None:
        sp_div = self.groups["tp"].size if self.wl.parallel.sequence_parallel else 1
        self._elementwise(s, f"{name}{'.bwd' if backward else ''}", self.tokens * self.wl.model.hidden / sp_div,
                          rw=4.0 if backward else 2.0)

    def attention(self, s: _DeviceStream, name: str, backward: bool, causal: bool, kv_len: int | None = None,
                  cross: bool = False) -> None:
        m, tp, cp = self.wl.model, self.groups["tp"].size, self.groups["cp"]
        h, T = m.hidden, self.tokens
        q_out = h
        kv_out = 2 * self.kv * self.head_dim
        order = [("qkv", q_out + (0 if cross else kv_out))] + ([("kv", kv_out)] if cross else [])
        if not backward:
            for lin, width in order:
                self.column_linear(s, f"{name}.{lin}", h, width, backward)
        else:
            self.row_linear(s, f"{name}.proj", h, h, backward)
        frac = 0.5 if causal else 1.0  # every query of a sequence attends to (half of) its keys
        core_flops = 4.0 * T * (kv_len or self.seq) * h / tp * frac * (2.5 if backward else 1.0)
        core_bytes = self.b * (T * 3 + T) * h / tp * (2 if backward else 1)
        ctas = self.wl.training.micro_batch * (m.heads // tp) * math.ceil(T / self.wl.training.micro_batch / 128)
        if cp.size > 1 and not cross:  # ring attention: K/V blocks travel around the cp ring
            kv_block = T * kv_out / tp * self.b
            for step in range(cp.size - 1):
                s.comm(f"{name}.cp{step}{'.bwd' if backward else ''}", Collective.SEND_RECV, cp,
                       kv_block * (2 if backward else 1), wait=1)
                s.seg(f"{name}.core{step}{'.bwd' if backward else ''}", core_flops / cp.size, core_bytes / cp.size, ctas)
            s.seg(f"{name}.core{cp.size - 1}{'.bwd' if backward else ''}", core_flops / cp.size, core_bytes / cp.size, ctas)
        else:
            s.seg(f"{name}.core{'.bwd' if backward else ''}", core_flops, core_bytes, ctas)
        if backward:
            for lin, width in reversed(order):
                self.column_linear(s, f"{name}.{lin}", h, width, backward)
        else:
            self.row_linear(s, f"{name}.proj", h, h, backward)

    def mlp(self, s: _DeviceStream, name: str, backward: bool, ffn: int | None = None) -> None:
        m = self.wl.model
        ffn = ffn or m.ffn
        up = ffn * (2 if m.gated_mlp else 1)
        act_elems = self.tokens * ffn / self.groups["tp"].size
        if not backward:
            self.column_linear(s, f"{name}.fc1", m.hidden, up, False)
            self._elementwise(s, f"{name}.act", act_elems, rw=3.0 if m.gated_mlp else 2.0)
            self.row_linear(s, f"{name}.fc2", ffn, m.hidden, False)
        else:
            self.row_linear(s, f"{name}.fc2", ffn, m.hidden, True)
            self._elementwise(s, f"{name}.act.bwd", act_elems, rw=4.0)
            self.column_linear(s, f"{name}.fc1", m.hidden, up, True)

    def moe(self, s: _DeviceStream, name: str, backward: bool) -> None:
        """Token dispatch and combine all-to-all over ep; shared experts run beside the dispatch."""
        m, ep = self.wl.model, self.groups["ep"]
        tp = self.groups["tp"].size
        routed = self.tokens * m.top_k
        a2a_bytes = routed * m.hidden * self.b / tp
        expert_flops = 2.0 * routed * m.hidden * m.moe_ffn * (3 if m.gated_mlp else 2) / tp * (2 if backward else 1)
        expert_bytes = self.b * (routed * (m.hidden + m.moe_ffn) * 2 + m.experts // ep.size * m.hidden * m.moe_ffn * 3 / tp)
        tag = ".bwd" if backward else ""
        if not backward:
            self._elementwise(s, f"{name}.router", self.tokens * m.hidden, rw=1.0)
        s.comm(f"{name}.dispatch{tag}", Collective.ALL_TO_ALL, ep, a2a_bytes, wait=2 if m.shared_experts else 1)
        if m.shared_experts:
            sh = m.shared_experts * m.moe_ffn
            self._gemm(s, f"{name}.shared{tag}", self.tokens, m.hidden, sh * (3 if m.gated_mlp else 2) / tp,
                       passes=2 if backward else 1)
        s.seg(f"{name}.experts{tag}", expert_flops, expert_bytes, self._tiles(routed, m.moe_ffn / tp) * 2)
        s.comm(f"{name}.combine{tag}", Collective.ALL_TO_ALL, ep, a2a_bytes, wait=1)
        s.seg(f"{name}.unpermute{tag}", 0.0, routed * m.hidden * self.b * 2 / tp, routed * m.hidden / tp / 1024)

    @contextmanager
    def sequence(self, seq_len: int) -> Iterator[None]:
        """Build with another sequence length (the T5 decoder's), then restore the encoder's."""
        saved = self.seq, self.tokens
        self.seq, self.tokens = seq_len, self.wl.training.micro_batch * seq_len // self.wl.parallel.cp
        try:
            yield
        finally:
            self.seq, self.tokens = saved

    def layer(self, s: _DeviceStream, idx: int, kind: str, backward: bool) -> None:
        """kind: enc (bidirectional), dec (causal), xdec (causal + cross-attention: t5 decoder)."""
        m = self.wl.model
        blocks = ["ln1", "attn"] + (["lnx", "xattn"] if kind == "xdec" else [])
        blocks += ["ln2", "moe" if self.is_moe(idx) else "mlp"]
        with self.sequence(m.decoder_seq_len or m.seq_len) if kind == "xdec" else nullcontext():
            for block in reversed(blocks) if backward else blocks:
                full = f"L{idx}.{block}"
                if block.startswith("ln"):
                    self.norm(s, full, backward)
                elif block == "attn":
                    self.attention(s, full, backward, causal=kind != "enc")
                elif block == "xattn":  # decoder queries against the encoder's keys and values
                    self.attention(s, full, backward, causal=False, kv_len=m.seq_len, cross=True)
                elif block == "moe":
                    self.moe(s, full, backward)
                else:
                    self.mlp(s, full, backward)

    def is_moe(self, idx: int) -> bool:
        m = self.wl.model
        return m.architecture == "moe" and idx % m.moe_every == m.moe_every - 1

    def norm_tensors(self) -> list[float]:
        """A norm's parameters: LayerNorm's weight and bias, RMSNorm's weight."""
        return [self.wl.model.hidden] * (1 if self.wl.model.rms_norm else 2)

    def _linear(self, out_f: float, in_f: float, column: bool, expert: bool = False) -> list[tuple[float, bool]]:
        """Weight (and bias) of a column-parallel (output split over tp) or row-parallel (input split) linear."""
        tp = self.groups["tp"].size
        bias = out_f / tp if column else out_f
        return [(out_f * in_f / tp, expert)] + ([(bias, expert)] if self.wl.model.linear_bias else [])

    def layer_tensors(self, kind: str, idx: int) -> list[tuple[float, bool]]:
        """(elements one rank holds, expert) of each parameter tensor of a layer, in the order megatron-core
        registers them (local spec): norm, attention (proj, then qkv), [norm, cross-attention (proj, q,
        kv)], norm, then the MLP (fc1, fc2) or the MoE (router, each local expert's fc1 and fc2, shared experts)."""
        m = self.wl.model
        h, up = m.hidden, 2 if m.gated_mlp else 1
        kv = 2 * self.kv * self.head_dim
        norm = [(n, False) for n in self.norm_tensors()]
        tensors = norm + self._linear(h, h, column=False) + self._linear(h + kv, h, column=True)
        if kind == "xdec":
            tensors += norm + self._linear(h, h, column=False) + self._linear(h, h, column=True)
            tensors += self._linear(kv, h, column=True)
        tensors += norm
        if not self.is_moe(idx):
            return tensors + self._linear(m.ffn * up, h, column=True) + self._linear(h, m.ffn, column=False)
        tensors.append((m.experts * h, False))  # the router: dense, replicated over tp
        for _ in range(m.experts // self.wl.parallel.ep):
            tensors += self._linear(m.moe_ffn * up, h, column=True, expert=True)
            tensors += self._linear(h, m.moe_ffn, column=False, expert=True)
        if m.shared_experts:
            shared = m.shared_experts * m.moe_ffn
            tensors += self._linear(shared * up, h, column=True) + self._linear(h, shared, column=False)
        return tensors

    def layer_params(self, kind: str, idx: int) -> tuple[float, float]:
        """(dense, expert) parameters of one layer held by one rank (after tp and ep sharding)."""
        tensors = self.layer_tensors(kind, idx)
        return sum(n for n, expert in tensors if not expert), sum(n for n, expert in tensors if expert)

    def embedding(self, s: _DeviceStream, backward: bool) -> None:
        self._elementwise(s, f"embed{'.bwd' if backward else ''}", self.tokens * self.wl.model.hidden, rw=2.0)

    def head(self, s: _DeviceStream, backward: bool) -> None:
        m, tp = self.wl.model, self.groups["tp"].size
        seq = (m.decoder_seq_len or m.seq_len) if m.architecture == "t5" else m.seq_len  # t5: the decoder's output
        T = self.wl.training.micro_batch * seq // self.wl.parallel.cp
        if not backward:
            if self.wl.parallel.sequence_parallel:
                s.comm("head.ag", Collective.ALL_GATHER, self.groups["tp"], T * m.hidden * self.b, wait=1, fuse="next")
            self._gemm(s, "head", T, m.hidden, m.vocab / tp)
            self._elementwise(s, "loss", T * m.vocab / tp, rw=3.0)
        else:
            self._gemm(s, "head.grad", T, m.vocab / tp, m.hidden, passes=2)
            if self.wl.parallel.sequence_parallel:
                s.comm("head.bwd.rs", Collective.REDUCE_SCATTER, self.groups["tp"], T * m.hidden * self.b, wait=1)
            elif self.groups["tp"].size > 1:
                s.comm("head.bwd.ar", Collective.ALL_REDUCE, self.groups["tp"], T * m.hidden * self.b, wait=1)


def rank_params(wl: Workload) -> int:
    """Parameters one tensor-parallel rank holds over all pipeline stages (layers by the step graph's own
    per-layer count, plus the embedding): what a framework counts on its model, to check a description."""
    builder = _StepBuilder(wl, Hardware())  # the per-layer count reads the layout, not the machine
    layers = sum(sum(builder.layer_params(kind, idx))
                 for stage in range(wl.parallel.pp) for idx, kind in _stage_layers(wl, stage))
    return round(layers + wl.model.vocab * wl.model.hidden / wl.parallel.tp)


def _stage_layers(wl: Workload, stage: int) -> list[tuple[int, str]]:
    """(layer index, kind) of the layers a pipeline stage holds, in forward order."""
    m = wl.model
    if m.architecture == "t5":
        kinds = ["enc"] * m.layers + ["xdec"] * m.decoder_layers
    else:
        kinds = ["enc" if m.architecture == "bert" else "dec"] * m.layers
    per = len(kinds) // wl.parallel.pp
    return [(i, kinds[i]) for i in range(stage * per, (stage + 1) * per)]


def _dp_group(b: _StepBuilder) -> Group:
    """The group dense gradients are reduced over (and the distributed optimizer shards over)."""
    return b.groups["dp_cp" if b.wl.parallel.cp > 1 else "dp"]



def stage_tensors(b: _StepBuilder, stage: int) -> list[ParamTensor]:
    """The parameter tensors a pipeline stage holds, in megatron-core's registration order (GPTModel):
    word and position embeddings (first stage), the layers, the final norm and the output layer (last
    stage; its own weight when untied, the tied copy when the stages differ)."""
    m, p = b.wl.model, b.wl.parallel
    word = m.vocab * m.hidden / b.groups["tp"].size
    tied_across_stages = p.pp > 1 and not m.untied_embeddings
    listed: list[tuple[float, int | str, bool, bool]] = []  # (numel, ready, expert, shared_embedding)
    if stage == 0:
        listed.append((word, "embed", False, tied_across_stages))
        if m.position_embeddings:
            listed.append((m.position_embeddings * m.hidden, "embed", False, False))
    for idx, kind in _stage_layers(b.wl, stage):
        listed += [(numel, idx, expert, False) for numel, expert in b.layer_tensors(kind, idx)]
    if stage == p.pp - 1:
        listed += [(numel, "head", False, False) for numel in b.norm_tensors()]
        if m.untied_embeddings or p.pp > 1:
            listed.append((word, "head", False, tied_across_stages))
    return [ParamTensor(math.ceil(numel), seq, ready, expert, shared)
            for seq, (numel, ready, expert, shared) in enumerate(listed)]



def _megatron_buckets(b: _StepBuilder, stage: int) -> list[tuple[Group, str, Bucket]]:
    """Every gradient bucket of a stage in the order backward completes them: (group, name suffix, bucket).

    Dense gradients reduce over dp (dp_cp); with ep > 1 expert gradients have a buffer of their own,
    reduced over expt_dp. Megatron keeps one bucket when it does not overlap the reduction and on
    every pipeline stage but the first.
    """
    wl, p = b.wl, b.wl.parallel
    one_bucket = not wl.framework.overlap_grad_reduce or stage > 0
    bucket_elems = None if one_bucket else wl.ddp_bucket_elems
    tensors = stage_tensors(b, stage)
    split = p.ep > 1
    buffers = [(_dp_group(b), "", [t for t in tensors if not (split and t.expert)])]
    if split:
        buffers.append((b.groups["expt_dp"], ".expert", [t for t in tensors if t.expert]))
    out = [(group, suffix, bucket) for group, suffix, held in buffers if held
           for bucket in megatron_buckets(held, bucket_elems, group.size, p.distributed_optimizer,
                                          wl.framework.pad_buckets_for_high_nccl_busbw)]
    return sorted(out, key=lambda item: -item[2].seq)


def _data_parallel(b: _StepBuilder, s: _DeviceStream, stage: int, ready: dict[int | str, str]) -> None:
    """Gradient buckets released as backward completes them (reverse order), needed by the optimizer.

    ``ready``: the last segment of each layer's (and the head's and embedding's) backward.
    """
    wl, p = b.wl, b.wl.parallel
    if wl.framework.name == "megatron":
        coll = Collective.REDUCE_SCATTER if p.distributed_optimizer else Collective.ALL_REDUCE
        for n, (group, suffix, bucket) in enumerate(_megatron_buckets(b, stage)):
            s.comm(f"grad.bucket{n}{suffix}", coll, group, bucket.numel * b.grad_b, wait=None,
                   after=ready[bucket.ready] if wl.framework.overlap_grad_reduce else s.last)
        return
    # DeepSpeed 0.19 all-reduces the stage 0-2 gradient buckets (seen on its communication backend)
    for n, (ready_at, parts) in enumerate(_deepspeed_buckets(b, stage)):
        for part, elems in parts.items():
            group = b.groups.get("expt_dp", _dp_group(b)) if part == "expert" else _dp_group(b)
            s.comm(f"grad.bucket{n}{'.expert' if part == 'expert' else ''}", Collective.ALL_REDUCE, group,
                   elems * b.grad_b, wait=None, after=ready[ready_at] if wl.framework.overlap_comm else s.last)



def _deepspeed_buckets(b: _StepBuilder, stage: int) -> list[tuple[int | str, dict[str, float]]]:
    if stage not in b.deepspeed_buckets:
        b.deepspeed_buckets[stage] = _cut_deepspeed_buckets(b, stage)
    return b.deepspeed_buckets[stage]


def _cut_deepspeed_buckets(b: _StepBuilder, stage: int) -> list[tuple[int | str, dict[str, float]]]:
    """A stage's DeepSpeed gradient buckets in backward order: the backward block that completes each, and its
    elements per process group ("dense" over dp, "expert" over expt_dp: DeepSpeed reduces a mixed bucket with one
    call per group).

    The gradients are the job's own (``framework.grad_tensors``, read off the model by lagom_deepspeed) where the
    workload has them for this stage, else the modelled tensors of ``stage_tensors``. A bucket is placed where the
    modelled backward has produced the same share of the stage's gradient elements as the bucket closes at (ZeRO-1
    without overlap_comm reduces after backward, and its buckets are placed there by ``_data_parallel``).
    """
    wl = b.wl
    modelled = list(reversed(stage_tensors(b, stage)))  # backward produces gradients in reverse registration order
    real = wl.framework.grad_tensors if wl.parallel.pp == 1 else None
    numels = list(real) if real else [t.numel for t in modelled]
    if wl.parallel.zero_stage <= 1 and not wl.framework.overlap_comm:  # no hooks: reduced after backward, in
        modelled, numels = modelled[::-1], numels[::-1]  # registration order (stage_1_and_2's reduce_gradients)
    total, modelled_total = float(sum(numels)), float(sum(t.numel for t in modelled))
    out: list[tuple[int | str, dict[str, float]]] = []
    at, done, closed = 0, 0.0, 0.0  # the modelled tensor reached, modelled elements before it, real elements closed
    for elems in deepspeed_buckets(numels, b.wl.framework.reduce_bucket_size):
        closed += elems
        parts: dict[str, float] = {}
        while at < len(modelled):  # the modelled tensors up to the share of elements this bucket closes at
            t = modelled[at]
            part = "expert" if t.expert else "dense"
            parts[part] = parts.get(part, 0.0) + t.numel
            done += t.numel
            at += 1
            if done >= closed / total * modelled_total * (1 - 1e-12):
                break
        if not parts:  # the modelled tensors ran out before the real ones (rounding): it closes with the last
            parts = {"dense": float(elems)}
        share = elems / sum(parts.values())  # the real bucket's elements, split as the modelled tensors it spans
        out.append((modelled[at - 1].ready, {part: n * share for part, n in parts.items()}))
    return out


def _optimizer(b: _StepBuilder, s: _DeviceStream, stage: int, stage_params: float) -> None:
    p, f = b.wl.parallel, b.wl.framework
    dp = _dp_group(b)
    shard = dp.size if (p.distributed_optimizer or p.zero_stage >= 1 or p.fsdp) else 1
    if p.zero_stage:  # DeepSpeed sums the squared gradient norm over dp before stepping: fp32 (ZeRO-1/2), fp64 (3)
        s.comm("grad_norm", Collective.ALL_REDUCE, dp, 8 if p.zero_stage == 3 else 4, wait=None)
    s.seg("optimizer", 0.0, stage_params / shard * 16 * 2, stage_params / shard / 1024)
    if p.distributed_optimizer:  # megatron gathers the updated parameters bucket by bucket
        for n, (group, suffix, bucket) in enumerate(_megatron_buckets(b, stage)):
            s.comm(f"param.ag{n}{suffix}", Collective.ALL_GATHER, group, bucket.numel * b.b, wait=None)
    elif p.zero_stage in (1, 2):  # DeepSpeed 0.19 gathers the whole partitioned buffer in one call
        gathered = sum(f.grad_tensors) if f.grad_tensors and p.pp == 1 else stage_params
        s.comm("param.ag0", Collective.ALL_GATHER, dp, gathered * b.b, wait=None)


def points_for(wl: Workload, hw: Hardware, *, stamped: bool = True) -> StepGraph:
    """Derive the compute segments and every overlap point of one training step.

    A pipeline stage's forwards (and backwards) are the same block for every micro-batch: ``stamped``
    builds each kind once per stage and copies it for the other micro-batches, so the cost of the model's
    arithmetic does not grow with them. ``stamped=False`` builds every block from the arithmetic (the
    same graph, slower: what the stamped one is tested against).

    A pipeline of many micro-batches also gets its twin (``Phase.derived["twin"]``): the same phase built for
    ``twin_micro_batches`` of them. Its steady 1F1B stretch is shorter and everything else the same, so the
    simulator prepares and runs the twin, jumping over the periods it lacks as over its own
    (``lagom.model.simulator``): preparing a phase costs as much as its micro-batches, the run does not."""
    with collector_paused():
        graph = _points_for(wl, hw, stamped)
        fewer = twin_micro_batches(wl)
        if fewer is not None:
            twin = _points_for(wl.with_microbatches(fewer), hw, stamped)
            for phase, short in zip(graph.phases, twin.phases):
                if phase.name == short.name and len(short.points) < len(phase.points):
                    phase.derived["twin"] = short
        return graph


TWIN_MICRO_BATCHES = 16  # the fewest micro-batches of a twin: its pipeline fills, settles and repeats
# A twin is built where the phase has this many times its micro-batches. Building it costs about its share of
# the phase's build, and the search's windows index the phase itself anyway: a twin of a quarter (a 1,024-GPU
# Llama's 64 of 256) made its tune 0.5 s slower and 70 MB larger; one of an eighth (gpt3-13b-pp4's 16 of 128)
# takes its first step from 80 to 16 ms and its tune no slower.
TWIN_SHARE = 8


def twin_micro_batches(wl: Workload) -> int | None:
    """The micro-batches of a pipeline's twin, or None where the job is no pipeline or has too few micro-batches
    for a twin to pay. A whole number of rounds of the stages (every schedule accepts it), and at least as many
    rounds as stages: a deeper pipeline takes longer to settle (a 1,024-GPU Llama's 8 stages take 38
    micro-batches; a twin too short for the jump is tried once, then the phase runs itself)."""
    pp = wl.parallel.pp
    fewer = pp * max(pp, -(-TWIN_MICRO_BATCHES // pp))
    return fewer if pp > 1 and wl.microbatches >= TWIN_SHARE * fewer else None


@contextmanager
def collector_paused() -> Iterator[None]:
    """Building a step graph, its index, a phase's lowering or the search's sets of keys sharing compute
    allocates hundreds of thousands of small objects that stay alive until the build ends; the cyclic
    garbage collector would rescan the growing heap again and again (a third of the time of a
    128-micro-batch graph, nearly half of a 1,024-GPU job's index, 5 s of a 1,024-GPU tune's lowerings
    and search sets) for nothing to free. Paused only while building, and only if it was on."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextmanager
def collector_paused_for_search() -> Iterator[None]:
    """A search allocates millions of short-lived objects (settings, estimates, step results) that reference
    counting frees, and each collector pass they trigger rescans the step graphs and indexes the search
    holds (millions of objects at cluster scale): 16% of a 1,024-GPU tune, for the same peak memory. So the
    collector is paused for the whole search, but only on the main thread: it is the whole process's, and a
    search beside a training job (a thread of its own) must not hold back the job's cyclic garbage, tensors
    among it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with collector_paused():
        yield


def _points_for(wl: Workload, hw: Hardware, stamped: bool) -> StepGraph:
    b = _StepBuilder(wl, hw)
    p = wl.parallel
    sharded_params = p.fsdp or p.zero_stage == 3
    per_micro_grads = sharded_params or p.zero_stage == 2
    m = wl.microbatches
    phases: list[Phase] = []

    def micro(s: _DeviceStream, stage: int, backward: bool, with_grads: bool, ready: dict[int | str, str]) -> _Block:
        """One micro-batch's forward or backward on a stage; ``ready`` gets the last segment of each layer
        (and, in backward, of the head and the embedding): where the gradients of their tensors are complete."""
        layers = _stage_layers(wl, stage)
        first_idx = len(s.segments)
        seq = list(reversed(layers)) if backward else layers
        if stage == p.pp - 1 and backward:
            b.head(s, True)
            ready["head"] = s.last  # type: ignore[assignment]
            if sharded_params and with_grads:
                reduce_scatter(s, stage, "head", 0.0)
        if stage == 0 and not backward:
            b.embedding(s, False)
        release = s.last  # ZeRO-3 prefetch: a layer's gather is released when the layer before it starts
        for idx, kind in seq:
            params = sum(b.layer_params(kind, idx))
            if sharded_params:
                s.comm(f"L{idx}.{'bwd.' if backward else ''}param_ag", Collective.ALL_GATHER, b.groups["dp"],
                       params * b.b, wait=1, after=release)
            release = s.last
            b.layer(s, idx, kind, backward)
            ready[idx] = s.last  # type: ignore[assignment]
            if sharded_params and backward and with_grads:
                reduce_scatter(s, stage, idx, params)
        if stage == p.pp - 1 and not backward:
            b.head(s, False)
        if stage == 0 and backward:
            b.embedding(s, True)
            ready["embed"] = s.last  # type: ignore[assignment]
            if sharded_params and with_grads:
                reduce_scatter(s, stage, "embed", 0.0)
        return _Block(s.segments[first_idx].name, s.last, first_idx, len(s.segments) - 1)  # type: ignore[arg-type]

    def reduce_scatter(s: _DeviceStream, stage: int, done: int | str, params: float) -> None:
        """Sharded gradients once the backward block ``done`` is complete: DeepSpeed's ZeRO-3 buckets that close
        there, or one reduce-scatter per layer (megatron's FSDP)."""
        if wl.framework.name != "deepspeed":
            if isinstance(done, int):
                s.comm(f"L{done}.grad_rs", Collective.REDUCE_SCATTER, b.groups["dp"], params * b.grad_b, wait=None)
            return
        for n, (ready_at, parts) in enumerate(_deepspeed_buckets(b, stage)):
            if ready_at == done:
                s.comm(f"grad.bucket{n}", Collective.REDUCE_SCATTER, b.groups["dp"], sum(parts.values()) * b.grad_b,
                       wait=None)

    def stage_params(stage: int) -> float:
        return float(sum(t.numel for t in stage_tensors(b, stage)))

    if p.pp == 1:
        ready: dict[int | str, str] = {}

        def one_micro(name: str, grads: bool, repeat: int) -> None:
            s = _DeviceStream(0, name, f"{name}.")
            micro(s, 0, False, grads, ready)
            micro(s, 0, True, grads, ready)
            if grads and not sharded_params:
                _data_parallel(b, s, 0, ready)
            if name == "last":
                _optimizer(b, s, 0, stage_params(0))
            phases.append(_phase(name, repeat, [s]))

        if m > 1:
            one_micro("micro", per_micro_grads, m - 1)
        one_micro("last", True, 1)
    else:
        phases.append(_pipeline_phase(b, wl, micro, stage_params, stamped))
    for phase in phases:
        names = [pt.name for pt in phase.points]
        assert len(names) == len(set(names)), f"duplicate point names in phase {phase.name}"
    return StepGraph(wl.name, hw.name, p.pp, phases, b.groups)


def _pipeline_phase(b: _StepBuilder, wl: Workload, micro, stage_params, stamped: bool) -> Phase:
    """The 1F1B schedule of every stage, with activation and gradient send/recv between neighbours; with
    ``stamped``, each kind of block is built once per stage and stamped for the other micro-batches."""
    p, m = wl.parallel, wl.microbatches
    pp = b.groups["pp"]
    act_bytes = b.tokens * wl.model.hidden * b.b / (b.groups["tp"].size if p.sequence_parallel else 1)
    link = Group("pp", 2, 1 if pp.ranks_per_node == 1 else 2, 2 if pp.ranks_per_node == 1 else 1)
    streams = [_DeviceStream(st, "step", f"s{st}.") for st in range(p.pp)]
    fwd: dict[tuple[int, int], _Block] = {}
    bwd: dict[tuple[int, int], _Block] = {}
    for st, s in enumerate(streams):
        warm = min(p.pp - st - 1, m)
        order = [("F", i) for i in range(warm)]
        f_next, b_next = warm, 0
        while b_next < m:
            if f_next < m:
                order.append(("F", f_next))
                f_next += 1
            order.append(("B", b_next))
            b_next += 1
        ready: dict[int | str, str] = {}
        templates: dict[tuple[bool, bool], _Template | None] = {}
        for kind, i in order:
            s.prefix = f"s{st}.mb{i}."
            backward = kind == "B"
            grads = (backward and i == m - 1) or p.fsdp or p.zero_stage >= 2
            template = templates.get((backward, grads))
            if template is not None:
                block = s.stamp(template, ready)
            elif stamped and (backward, grads) not in templates:
                block, templates[(backward, grads)] = s.record(partial(micro, s, st, backward, grads, ready), ready)
            else:
                block = micro(s, st, backward, grads, ready)
            (fwd if kind == "F" else bwd)[(st, i)] = block
        s.prefix = f"s{st}."
        if not (p.fsdp or p.zero_stage == 3):  # sharded parameters reduce-scatter per layer instead
            _data_parallel(b, s, st, ready)
        _optimizer(b, s, st, stage_params(st))
    sends: list[_Send] = []
    for st in range(p.pp - 1):
        for i in range(m):
            for (src, dst), blocks, way in (((st, st + 1), fwd, "fwd"), ((st + 1, st), bwd, "bwd")):
                sent, needed = blocks[(src, i)], blocks[(dst, i)]
                sends.append(_Send(OverlapPoint(f"s{src}.mb{i}.send_{way}", Collective.SEND_RECV, link, int(act_bytes),
                                                after=sent.last, before=needed.first, device=src, peer_device=dst,
                                                phase="step"), sent.last_at, needed.first_at))
    return _phase("step", 1, streams, sends)


@dataclass
class _Send:
    """A pipeline send/recv: the point, and the indices of its after and before segments on its device and its peer."""

    point: OverlapPoint
    after: int
    before: int


def _phase(name: str, repeat: int, streams: list[_DeviceStream], sends: list[_Send] | None = None) -> Phase:
    """The phase of these streams (devices in their order) and sends, with its columns as the streams wrote them."""
    sends = sends or []
    phase = Phase(name, repeat, {s.device: s.segments for s in streams},
                  [pt for s in streams for pt in s.points] + [send.point for send in sends])
    columns = [s.columns for s in streams if s.columns is not None]
    if len(columns) < len(streams):
        return phase  # its columns are read off the objects (``phase_columns``)
    offset = np.cumsum([0, *(len(s.segments) for s in streams)]).tolist()
    rows = [c.arrays(first) for c, first in zip(columns, offset)]
    where = dict(zip([s.device for s in streams], offset))
    send = np.asarray([(where[x.point.device] + x.after, where[x.point.peer_device or 0] + x.before, NO_SEGMENT,
                        COLLECTIVE_ID[Collective.SEND_RECV], x.point.bytes, 0) for x in sends], dtype=np.int64).reshape(-1, 6)
    points = np.concatenate([pts for _, pts in rows] + [send])
    # groups: a stream numbers its own as they first appear in its rows, and the phase's rows are the streams' one
    # after another, then the sends', so numbering the streams' groups in that order (equal groups once) numbers
    # them by first appearance in the phase
    registry: dict[Group, int] = {}
    numbers = [np.asarray([registry.setdefault(g, len(registry)) for g in c.groups], dtype=np.int64) for c in columns]
    group = np.concatenate([of[pts[:, 5]] for of, (_, pts) in zip(numbers, rows)] +
                           [np.asarray([registry.setdefault(x.point.group, len(registry)) for x in sends], dtype=np.int64)])
    segments = np.concatenate([segs for segs, _ in rows])
    phase.derived["columns"] = PhaseColumns(
        segments[:, 0].copy(), segments[:, 1].copy(), segments[:, 2].copy(),
        points[:, 0].copy(), points[:, 1].copy(), points[:, 2].copy(),
        np.concatenate([np.full(len(s.points), s.device) for s in streams] + [[x.point.device for x in sends]]).astype(np.int64),
        np.concatenate([np.full(len(s.points), NO_SEGMENT) for s in streams] + [[x.point.peer_device for x in sends]]).astype(np.int64),
        points[:, 3].copy(), points[:, 4].copy(), group, list(registry))
    return phase
