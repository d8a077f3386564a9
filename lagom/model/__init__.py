"""What a step costs: the cost model of compute and communication together, the model scaled to a job's
measurements (``calibrated``), and what prices a step under given settings.

May import: ``lagom.plan`` (the settings it prices), ``lagom.step`` and the base modules. Never the search, the
runtime or the CLI.
"""
