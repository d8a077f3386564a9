"""A plan in force in one process: the NCCL environment, process-group options and tuner rules it sets
(``runtime``), the recorder of every collective a step issues (``recorder``, fed by ``torch_tap``), the step's
clock (``step_clock``), Lagom's own collectives under a timeout (``control``) and the launchers' shared part
(``launch``).

May import: ``lagom.plan.plan``, ``lagom.model``, ``lagom.step`` and the base modules. Not the online loop or the
measurements, which build on it.
"""
