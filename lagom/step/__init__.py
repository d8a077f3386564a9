"""What a training step is: the workload (``workload``: model, parallel layout, framework knobs), its compute
segments and overlap points (``points``), and the calls it issues and their tuning keys (``calls``: the key a
collective is planned and measured under, which the step's points carry).

May import: the base modules only (``lagom.errors``, ``lagom.hardware``, ``lagom.config_file``, ...). The
machine is an input of the step (groups span nodes, GEMMs tile to its SMs), so ``hardware`` sits below it.
"""
