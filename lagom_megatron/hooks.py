"""Where Lagom enters Megatron: ``setup(args)`` after argument parsing, and the launcher's wrappers.

The patched ``megatron/training/arguments.py`` calls ``setup(args)`` at the end of
``parse_and_validate_args``; the launcher (``lagom_megatron.run``) wraps the same functions of an
unpatched install, so both paths register the same flags and start the same session.
``setup`` is idempotent for one args object, so a patched install run through the launcher is fine.
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable
from typing import Any

from lagom.errors import ConfigError
from lagom_megatron.arguments import add_lagom_arguments, options_from_args
from lagom_megatron.session import Session

log = logging.getLogger("lagom.megatron")
_session: Session | None = None


def current() -> Session | None:
    """The session of this process, if ``--lagom`` is on."""
    return _session


def setup(args: argparse.Namespace) -> Session | None:
    """Start Lagom for these parsed Megatron arguments (a no-op without ``--lagom``)."""
    global _session
    if _session is not None and _session.args is args:
        return _session
    options = options_from_args(args)
    if _session is not None:
        _session.close()
        _session = None
    if options is None:
        return None
    try:
        _session = Session.start_for(args, options)
    except ConfigError:  # the user's flags or files: the same on every rank, and theirs to fix
        raise
    except Exception as err:  # noqa: BLE001 - Lagom's own failure must not fail a job Megatron accepts
        log.error("Lagom switched itself off at start-up (%s: %s). Megatron runs with its own settings.",
                  type(err).__name__, err)
        return None
    _wrap_train_step(_session)
    return _session


def _wrap_train_step(session: Session) -> None:
    """Time and record every ``train_step`` of megatron.training.training.train (looked up by name there)."""
    from megatron.training import training

    original = training.train_step

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        session.step_begin(kwargs.get("iteration"))
        out = original(*args, **kwargs)
        session.step_end()
        return out

    session._swap(training, "train_step", train_step)


def _wrapped(original: Callable, wrapper: Callable) -> Callable:
    wrapper = functools.wraps(original)(wrapper)
    wrapper.__lagom_original__ = original  # type: ignore[attr-defined]
    return wrapper


def install_launcher_hooks() -> None:
    """Make an unpatched megatron/training accept the flags and start Lagom after parsing.

    ``add_megatron_arguments`` is wrapped rather than ``parse_args``, so a script's own
    extra_args_provider still runs on a parser that already knows the lagom flags.
    """
    from megatron.training import arguments

    if hasattr(arguments.add_megatron_arguments, "__lagom_original__"):
        return
    add_megatron_arguments = arguments.add_megatron_arguments
    parse_and_validate_args = arguments.parse_and_validate_args

    def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_lagom_arguments(add_megatron_arguments(parser))

    def parse_and_validate(*args: Any, **kwargs: Any) -> argparse.Namespace:
        parsed = parse_and_validate_args(*args, **kwargs)
        setup(parsed)
        return parsed

    arguments.add_megatron_arguments = _wrapped(add_megatron_arguments, add_arguments)
    arguments.parse_and_validate_args = _wrapped(parse_and_validate_args, parse_and_validate)


def remove_launcher_hooks() -> None:
    from megatron.training import arguments

    for name in ("add_megatron_arguments", "parse_and_validate_args"):
        original = getattr(getattr(arguments, name), "__lagom_original__", None)
        if original is not None:
            setattr(arguments, name, original)
