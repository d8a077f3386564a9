"""Errors a user can act on: each names the offending key and the fix."""

from __future__ import annotations


class LagomError(Exception):
    """Base class for every error Lagom raises on purpose."""


class ConfigError(LagomError):
    """Bad user input: a config key, a flag, a plan or an environment variable.

    The CLI prints ``str(err)`` as one line and exits with code 2, so the message must stand alone.
    """

    def __init__(self, key: str, problem: str, fix: str = "") -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        msg = f"{key}: {problem}"
        if fix:
            msg += f" ({fix})"
        super().__init__(msg)
