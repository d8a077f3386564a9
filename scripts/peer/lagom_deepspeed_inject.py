"""pytest plugin: DeepSpeed's own tests run with Lagom turned on in every ``deepspeed.initialize``.

Loaded with ``-p lagom_deepspeed_inject`` (``scripts/peer`` on PYTHONPATH). In this process and in
every Python process started from it (DeepSpeed's DistributedTest runs ranks in forkserver pool
workers; ``sitecustomize.py`` beside this file reads ``LAGOM_PEER_INJECT``), as soon as deepspeed is
imported:

- ``lagom_deepspeed.patch()`` makes ``deepspeed.initialize`` honour a ``"lagom"`` section;
- ``deepspeed.initialize`` is wrapped once more so the config it reads (``config``, else
  ``config_params``, else ``args.deepspeed_config``/``args.deepscale_config``; a dict, a JSON path
  or base64 JSON) carries ``SECTION``. A config that already has a ``"lagom"`` key, or that
  DeepSpeed itself cannot read, is passed on untouched so DeepSpeed's own error stays the same.

The section is the smallest one a user can write: no hardware, no workload, no plan.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import tempfile
from typing import Any, Callable

ENV = "LAGOM_PEER_INJECT"
SECTION: dict[str, Any] = {"enabled": True}
ARGS_CONFIG_ATTRS = ("deepspeed_config", "deepscale_config")


def _with_section(source: Any) -> Any:
    """``source`` (dict, JSON path or base64 JSON) with the lagom section, in the same form."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    try:
        loaded = load_ds_config(source)
    except Exception:  # DeepSpeed reports its own error for a config it cannot read
        return source
    if not isinstance(loaded, dict) or "lagom" in loaded:
        return source
    config = {**loaded, "lagom": copy.deepcopy(SECTION)}
    if isinstance(source, dict):
        return config
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="lagom-peer-", delete=False) as out:
        json.dump(config, out)
    return out.name


def add_section(initialize: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``initialize`` so the config DeepSpeed would read gets the lagom section."""

    @functools.wraps(initialize)
    def initialize_with_lagom(args: Any = None, model: Any = None, *rest: Any, **kwargs: Any) -> Any:
        if kwargs.get("config") is not None:
            kwargs["config"] = _with_section(kwargs["config"])
        elif kwargs.get("config_params") is not None:
            kwargs["config_params"] = _with_section(kwargs["config_params"])
        else:
            for attr in ARGS_CONFIG_ATTRS:
                if getattr(args, attr, None) is not None:
                    args = copy.copy(args)
                    setattr(args, attr, _with_section(getattr(args, attr)))
                    break
        return initialize(args, model, *rest, **kwargs)

    initialize_with_lagom.__lagom_peer__ = True  # type: ignore[attr-defined]
    return initialize_with_lagom


def inject() -> None:
    """Turn Lagom on for every later ``deepspeed.initialize`` call in this process (idempotent)."""
    import deepspeed

    import lagom_deepspeed

    if getattr(deepspeed.initialize, "__lagom_peer__", False):
        return
    lagom_deepspeed.patch()
    deepspeed.initialize = add_section(deepspeed.initialize)


def pytest_configure(config: Any) -> None:
    """As a pytest plugin: this process, and (through the environment) every process it starts."""
    os.environ[ENV] = "deepspeed"
    inject()
