"""The online loop of one tuned job: the session both adapters subclass (``session``: the start plan, the
per-step hooks, the agreement, the report in ``report``), the calibrated search beside the steps (``tuner``),
live trials on the job's own steps (``live``) and the drift monitor (``monitor``).

May import: ``lagom.runtime.apply``, ``lagom.runtime.measure``, ``lagom.tune`` and everything below them.
"""
