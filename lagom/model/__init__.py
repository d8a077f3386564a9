"""What a step costs under given settings: the cost model of compute and communication together
(``cost_model``), the contention fit (``contention``), the model scaled to a job's measurements (``calibrated``),
what NCCL itself would run (``choices``), the step lowered into tasks (``phase_index``, ``lowering``, and as arrays ``phase_arrays``) and
simulated (``simulator``, on the C loop ``compiled``), the window estimate the search ranks with (``windows``), the lower bound on a step (``bound``)
and the model made to match the calls a job really issued (``reconcile``).

May import: ``lagom.plan``, ``lagom.step`` and the base modules. Never the search, the runtime or the commands.
"""
