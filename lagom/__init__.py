"""Lagom: tune communication so it hides under computation without slowing it."""

__version__ = "0.1.0"
