"""Measuring a machine: ``lagom calibrate`` (links, collectives, contention: ``calibrate``,
``contention_bench``, ``comm_kernel``) and the hardware a job starts on (``probe``).

May import: ``lagom.runtime.apply`` and everything below it. Not the online loop, which uses these.
"""
