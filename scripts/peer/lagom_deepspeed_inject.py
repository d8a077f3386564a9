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
With ``LAGOM_PEER_LOG`` set, every call appends a JSON line there (process, where the config came
from, whether the section was added, whether the engine carries a Lagom session, or the error), so
a run shows that Lagom was really on in the ranks, not only in the pytest process.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any

ENV = "LAGOM_PEER_INJECT"
LOG_ENV = "LAGOM_PEER_LOG"  # optional: a file that gets one line per deepspeed.initialize call
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


def _config_slot(arguments: dict[str, Any]) -> tuple[str, str | None]:
    """Where DeepSpeed reads the config from: ("config" | "config_params" | "args", args attribute)."""
    for name in ("config", "config_params"):
        if arguments.get(name) is not None:
            return name, None
    for attr in ARGS_CONFIG_ATTRS:
        if getattr(arguments.get("args"), attr, None) is not None:
            return "args", attr
    return "", None


def _log(entry: dict[str, Any]) -> None:
    """One JSON line per call in ``$LOG_ENV`` (appends are atomic for lines this short)."""
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"pid": os.getpid(), **entry}) + "\n")


def add_section(initialize: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``initialize`` so the config DeepSpeed would read gets the lagom section."""
    signature = inspect.signature(initialize)

    @functools.wraps(initialize)
    def initialize_with_lagom(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        slot, attr = _config_slot(bound.arguments)
        added = False
        if attr is not None:
            ds_args = copy.copy(bound.arguments["args"])
            source = getattr(ds_args, attr)
            setattr(ds_args, attr, _with_section(source))
            added = getattr(ds_args, attr) is not source
            bound.arguments["args"] = ds_args
        elif slot:
            source = bound.arguments[slot]
            bound.arguments[slot] = _with_section(source)
            added = bound.arguments[slot] is not source
        where = f"args.{attr}" if attr else slot or "none"
        try:
            out = initialize(*bound.args, **bound.kwargs)
        except BaseException as err:
            message = f"{type(err).__name__}: {err}".splitlines()[0][:300] if str(err) else type(err).__name__
            _log({"config": where, "section_added": added, "error": message})
            raise
        _log({"config": where, "section_added": added, "lagom_session": getattr(out[0], "lagom", None) is not None})
        return out

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


def summarize(log_path: str) -> str:
    """What the calls in a ``LAGOM_PEER_LOG`` file came to: engines with a session, or errors."""
    with open(log_path) as log:
        calls = [json.loads(line) for line in log]
    outcomes = Counter(call.get("error") or ("engine with a Lagom session" if call["lagom_session"]
                                             else "engine without a Lagom session") for call in calls)
    lines = [f"deepspeed.initialize calls with Lagom injected: {len(calls)} in "
             f"{len({call['pid'] for call in calls})} processes "
             f"({sum(call['section_added'] for call in calls)} got the lagom section)"]
    lines += [f"  {count:4d}  {outcome}" for outcome, count in outcomes.most_common()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
