"""Lagom for Megatron-LM: ``--lagom`` on a Megatron launch (patch or launcher), plans pushed into
megatron-core (bucket size, per-group NCCL options, TE userbuffers), every overlap point recorded,
online tuning, Flash-Overlap for the TP+SP points a plan decomposes, and a report.

Entry points: ``lagom patch megatron`` (lagom_megatron.patching), ``python -m lagom_megatron.run``
(the launcher), ``lagom_megatron.hooks.setup(args)`` (what both call after Megatron parses its
arguments) and ``lagom_megatron.hooks.current()`` (the session, for custom training loops).
"""
