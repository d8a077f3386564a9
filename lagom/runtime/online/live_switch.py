"""Live NCCL settings in one session: the tuner plugin's live table, switched on every rank together in two
phases (staged, agreed, published or discarded), and the live trials that drive it."""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from typing import Any

import torch.distributed as dist

from lagom.plan import emit
from lagom.plan.plan import Plan
from lagom.runtime.online.live import ROUTED_FIELDS, LiveSearch, Trial, describe_live
from lagom.runtime.online.state import buffsize_in_force, plugin_counters, rank
from lagom.step.calls import KeyIndex, mean_per_call

log = logging.getLogger("lagom.session")
# Whether a live tuner table of a session is in force in this process's plugin (the table is process-wide and
# outlives the session that published it when that session closed mid-tuning).
_live_table_published = False


class LiveSwitching:
    """``TuningSession``'s live table and live trials: what every rank switches together, at agreed steps."""

    def _restore_start_rules(self) -> None:
        """A live table an earlier session of this process left in force (it closed mid-tuning, or switched
        off without an agreement) would override this session's rules: every rank puts the start rules back,
        agreed, before this session's first step."""
        from lagom.nccl_tuner.live import LiveTable, LiveTableError

        if not self.control.any([_live_table_published], "whether a live tuner table is in force")[0]:
            return
        table = self.live_table
        try:
            table = table or LiveTable.create(self.world_size)
        except (LiveTableError, OSError):
            table = None  # no plugin in this process: no table was ever in force here; the peers stage alone
        try:
            if self._switch_table(None, "the start rules in place of an earlier session's live table", table):
                self.event("an earlier session's live tuner table was still in force: the start rules are back")
        finally:
            if table is not None and table is not self.live_table:
                table.close()

    def _open_live_table(self) -> Any:
        """The tuner plugin's live table for this session (private to this user), or None where it cannot be had."""
        from lagom import nccl_tuner

        try:
            from lagom.nccl_tuner.live import LIVE_TABLE_ENV, LiveTable

            table = LiveTable.create(self.world_size)
        except Exception as err:  # noqa: BLE001 - no plugin, no table: live tuning still switches Flash-Overlap
            self.event(f"no live tuner table ({err if nccl_tuner.path() is not None else nccl_tuner.UNAVAILABLE}): "
                       "algorithm, protocol, channels and chunk are tried on the model only", level=logging.WARNING)
            return None
        if not self.runtime.export(LIVE_TABLE_ENV, str(table.path)):
            self.event(f"{LIVE_TABLE_ENV} is set in the environment: this session's live table is not the one NCCL "
                       "reads, so live tuning does not change NCCL's settings", level=logging.WARNING)
        return table

    def _nccl_backend(self) -> bool:
        """Whether the job's collectives run on NCCL (only there can the tuner plugin change anything)."""
        return dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()

    def _nccl_consulted(self) -> bool:
        """Whether NCCL called the tuner plugin's getCollInfo in this process since calibration began."""
        now = plugin_counters()
        return now is not None and self._counters_at is not None and now.since(self._counters_at).coll_infos > 0

    def plugin_calls(self) -> dict[str, Any] | None:
        """What NCCL asked the tuner plugin in this process since the plan was put in force, per step, for the
        report (None without the plugin)."""
        now = plugin_counters()
        if now is None or self._counters_start is None:
            return None
        since, steps = now.since(self._counters_start), max(1, self.steps_seen)
        return {"communicators": since.inits, "coll_infos_per_step": since.coll_infos / steps,
                "applied_per_step": since.applied / steps, "consulted_while_calibrating": self.nccl_listens}

    def _drop_live_table(self, why: str) -> None:
        if self.live_table is not None:
            self.live_table.close()
            self.live_table = None
            self.event(why, level=logging.WARNING)

    def _start_live(self, only: set[str] | None = None) -> None:
        """Try settings on the next steps, every step an agreed one; rank 0 runs the search (``lagom.runtime.online.live``)
        over every key, or over ``only`` (keys that drifted) with the others kept as they are."""
        plan = self.plan
        assert plan is not None and self.tuner is not None
        self.live_reference = plan
        self.live_keys = sorted(e.key for e in plan.entries)
        self.live_on = True
        self._next_agreement = self.steps_seen + 1
        if not self._put_live(plan.configs()):  # the reference, on every rank: the noise steps measure what is in force
            return
        budget = self.options.tune_steps - self.calibration_steps
        if rank() == 0 and self.tuner.calibration is not None:
            cal = self.tuner.calibration
            reference = {k: cfg for k, cfg in plan.configs().items() if k in cal.problem.keys}
            # where NCCL never consults the plugin, its settings are not tried: a trial of them would be noise
            fields = ROUTED_FIELDS if self.nccl_listens is False else None
            problem = cal.under_buffsize(buffsize_in_force())  # chunks NCCL would cut are never tried
            self.live = LiveSearch(problem, cal.simulator, reference, max_channels=self._max_channels(),
                                   budget_steps=budget, budget_s=self.options.tune_seconds, only=only,
                                   first_trial=len(self.trials) + 1, fields=fields)
        self.event(f"step {self.iteration}: trying settings on live steps (at most {budget} steps or "
                   f"{self.options.tune_seconds:g} s){self._live_reach()}")

    def _max_channels(self) -> dict[str, int]:
        """Per group whose NCCL communicator got options, the most channels it was made with (NCCL cannot go
        above it live); groups on other backends have no such limit."""
        return {group: int(cfg["max_ctas"]) for group, cfg in self.communicator_configs().items()
                if group in self.runtime.applied_groups and "max_ctas" in cfg}

    def _live_reach(self) -> str:
        """What the live settings reach in this process, for the log and the report."""
        if self.live_table is None:
            return "; NCCL's settings cannot change live here (no tuner plugin table): only Flash-Overlap routing does"
        if self.nccl_listens is False:
            return "; NCCL does not consult the tuner plugin on every rank: only Flash-Overlap routing is tried"
        if not self._nccl_backend():
            return "; this job's backend is not NCCL, so the tuner table changes nothing it runs (the loop is the same)"
        return ""

    @property
    def _judged_step(self) -> int:
        """The step the live loop judges at this step's end: this one on the host, ``clock.lag`` back on a GPU."""
        return self.iteration - (self.clock.lag if self.clock is not None else 0)

    def _live_values(self) -> list[float]:
        """This rank's judged step for the agreement: whether it is not ready (its device time unknown yet, or
        it ran other settings than those in force now), its time and each key's mean seconds per call (0: none)."""
        if not self.live_on:
            return []
        step = self._judged_step
        step_s = self.clock.seconds(step) if self.clock is not None else None
        if step_s is None or self._step_epoch.get(step) != self._epoch or step in self._first_steps:
            return [1.0, 0.0, *(0.0 for _ in self.live_keys)]
        means = mean_per_call(self._step_records.get(step, []), KeyIndex(self.live_keys).match)
        return [0.0, step_s, *(means.get(k, 0.0) for k in self.live_keys)]

    def _live_step(self, values: list[float]) -> Plan | None:
        from lagom.runtime.online.live import Decision

        if values[0] > 0:  # some rank cannot judge its step yet (or it ran the settings before): the next one
            if self.live is not None:
                self.live.unjudged_step()  # a step the search could not use still spends its budget
            self._next_agreement = self.steps_seen + 1
            return None
        decision: Decision | None = None
        if self.live is not None:
            keys = {k: v for k, v in zip(self.live_keys, values[2:]) if v > 0}
            decision = self.live.after_step(self._judged_step, values[1], keys)
        decision = self.control.broadcast(decision, f"the live decision of step {self.iteration}")
        if decision.configs is not None and not self._put_live(decision.configs):
            return None  # not switched on any rank: Lagom is off (``_switch_table`` said why)
        if not decision.done:
            self._next_agreement = self.steps_seen + 1
            return None
        return self._end_live(decision.configs or {})

    def _with_configs(self, configs: dict[str, Any]) -> Plan:
        plan = self.live_reference or self.plan
        assert plan is not None
        return replace(plan, entries=[replace(e, config=configs[e.key]) if e.key in configs else e for e in plan.entries])

    def _put_live(self, configs: dict[str, Any]) -> bool:
        """Every rank, at the same step: the tuner table and the Flash-Overlap routing for ``configs``; False when
        the table could not be switched on every rank (then none switched, and Lagom is off)."""
        plan = self._with_configs(configs)
        if not self._switch_table(emit.tuner_rules(plan), f"the live settings of step {self.iteration}"):
            return False
        self.router.plan = plan
        self._epoch += 1  # the next step is the first that runs them
        # the first step of an algorithm or protocol new to the job pays its connection setup, buffers and kernel
        # loading once: it is not judged, so trials are not biased against new algorithms
        pairs = {(cfg.algorithm, cfg.protocol) for cfg in configs.values()}
        if self._algorithms_run and pairs - self._algorithms_run:
            self._first_steps.add(self.iteration + 1)
        self._algorithms_run |= pairs
        return True

    def _switch_table(self, rules: str | None, what: str, table: Any = None) -> bool:
        """Put ``rules`` (None: the start rules) in force in the tuner plugin on every rank, or on none.

        Two phases: every rank stages the table (writes it, has the plugin parse and hold it), the ranks agree
        that every one of them staged it, then each publishes it, a pointer swap that cannot fail. A rank that
        cannot stage makes every rank discard and switch Lagom off together (back to the start rules, which
        cannot be refused); an agreement that fails leaves every rank on the table it had, which is the same.
        Every rank calls it at the same point, with or without a table of its own (``table``: another than
        the session's, to put the start rules back with).
        """
        global _live_table_published
        from lagom.nccl_tuner.live import LiveTableError

        table, refusal = table or self.live_table, ""
        if table is not None:
            try:
                table.stage(rules)
            except (LiveTableError, OSError) as err:
                refusal = f"{type(err).__name__}: {err}"
                log.error("Lagom on rank %d could not stage %s: %s", rank(), what, refusal)
        try:
            refused = self.control.any([bool(refusal)], f"{what}: staged on every rank")[0]
        except Exception as err:  # noqa: BLE001 - a peer missing: no rank publishes
            if table is not None:
                table.discard()
            self.switch_off(str(err), agreed=False)
            return False
        if refused:
            if table is not None:
                table.discard()
            self.switch_off(f"{what} could not be staged on " + (f"rank {rank()} ({refusal})" if refusal else
                                                                  "another rank (its log says why)"), agreed=True)
            return False
        if table is not None and table.publish():
            _live_table_published = rules is not None
        return True

    def _end_live(self, configs: dict[str, Any]) -> Plan:
        reference = self.live_reference
        assert reference is not None
        final = self._with_configs(configs)
        summary: dict[str, Any] = {}
        if self.live is not None:
            summary = {"why": getattr(self.live, "why", ""), "evaluations": self.live.evaluations,
                       "keys": sorted(self.live.only) if self.live.only is not None else "all",
                       "noise": self.live.noise, "reference_step_s": self.live.reference_step_s,
                       "steps_s": self.live.steps_s, "cost_s": self.live.cost_s(),
                       "steps": self.live.steps_used, "confidence": self.live.confidence(),
                       "clamped": sorted(self.live.clamped), "accepted": self.live.accepted,
                       "refused": self.live.refused, "window_steps": self.live.window, "alpha": self.live.alpha,
                       "trials": [asdict(t) for t in self.live.trials], "refit": self._refit()}
        summary = self.control.broadcast(summary, "the live tuning summary")
        trials = [Trial(**t) for t in summary.pop("trials", [])]
        self.trials += trials  # a drift's re-tune adds its own to the first round's
        final.measured = {"steps": summary.get("steps", 0), "confidence": summary.get("confidence", 1.0),
                          "trials": len(trials)}
        self.live_summary = summary
        self.live_on, self.live = False, None
        now = describe_live(final.configs(), reference.configs())
        self._next_agreement = self.steps_seen + self.options.drift_check_steps
        self.adopt(final, self.iteration, (now, self.next_start))
        if self.tuner is not None:
            self.tuner.plan = final
            self.tuner._save(final)  # noqa: SLF001 - the cache holds the measured plan
        return final
