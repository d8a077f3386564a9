"""The cost model scaled to one job's measurements (``CalibratedModel``): what the online loop fits after the first
steps, and what its searches are priced with. The fit itself (which scales, from which calls) is the online tuner's
(``lagom.runtime.online.tuner``); this module is only the model it fits.
"""

from __future__ import annotations

from lagom.hardware import Hardware
from lagom.model.cost_model import CostModel, RunningComm
from lagom.plan.capability import Capability
from lagom.plan.comm_config import CommConfig
from lagom.step.calls import TuningKey
from lagom.step.graph import Collective, ComputeSegment, Group


class CalibratedModel(CostModel):
    """The cost model scaled to a job's measurements: comm time per tuning key, compute overall.

    A Flash-Overlap P2P step has no key of its own: it takes the mean scale of its group's keys.
    The physical bound (``comm_peak_time``) is not scaled.
    """

    def __init__(self, hw: Hardware, capability: Capability | None = None) -> None:
        super().__init__(hw, capability)
        self.comm_scale: dict[str, float] = {}
        self.compute_scale = 1.0
        self._group_scale: dict[str, float] = {}

    def set_comm_scale(self, scales: dict[str, float]) -> None:
        self.comm_scale = dict(scales)
        by_group: dict[str, list[float]] = {}
        for key, s in scales.items():
            by_group.setdefault(TuningKey.parse(key).group, []).append(s)
        self._group_scale = {g: sum(v) / len(v) for g, v in by_group.items()}

    def comm_time(self, coll: Collective, group: Group, nbytes: int, cfg: CommConfig, compute_hbm_util: float = 0.0,
                  nic_share: float = 1.0) -> float:
        scale = self.comm_scale.get(str(TuningKey(group.name, coll.value, int(nbytes))), 1.0)
        return super().comm_time(coll, group, nbytes, cfg, compute_hbm_util, nic_share) * scale

    def p2p_step_time(self, group: Group, nbytes: float, cfg: CommConfig, compute_hbm_util: float = 0.0,
                      nic_share: float = 1.0) -> float:
        return super().p2p_step_time(group, nbytes, cfg, compute_hbm_util, nic_share) * self._group_scale.get(group.name, 1.0)

    def compute_solo(self, seg: ComputeSegment) -> float:
        return super().compute_solo(seg) * self.compute_scale

    def compute_time(self, seg: ComputeSegment, running: tuple[RunningComm, ...] = ()) -> float:
        if not running:
            return self.compute_solo(seg)
        return super().compute_time(seg, running) * self.compute_scale
