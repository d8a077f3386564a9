"""Errors a user can act on: each names the offending key and the fix."""

from __future__ import annotations

from typing import Any


def _restore(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """Rebuild a pickled Lagom error without calling its ``__init__`` (see ``LagomError.__reduce__``)."""
    err = cls.__new__(cls, *args)  # BaseException.__new__ keeps args: str(err) is the message again
    err.__dict__.update(state)
    return err


class LagomError(Exception):
    """Base class for every error Lagom raises on purpose.

    Errors cross process boundaries (a rank of a multiprocessing pool raises, the parent re-raises), so
    every subclass must survive pickle. Python's default rebuilds an exception as ``cls(*self.args)``,
    which breaks as soon as a subclass's ``__init__`` takes other arguments than its message; this
    rebuilds from the message and the attributes instead, whatever the subclass's signature.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _restore, (type(self), self.args, dict(self.__dict__))


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
