"""Lagom for DeepSpeed: a ``"lagom"`` section in the DeepSpeed config tunes ZeRO and pipeline comms.

    engine, optimizer, loader, scheduler = lagom_deepspeed.initialize(model=..., config=ds_config, ...)

takes exactly ``deepspeed.initialize``'s arguments and returns what it returns; or call
``lagom_deepspeed.patch()`` once and keep calling ``deepspeed.initialize`` (a name bound with
``from deepspeed import initialize`` before ``patch()`` is not affected). Without the section, or
with ``"enabled": false``, DeepSpeed is called with the untouched arguments.
The engine carries the session as ``engine.lagom``; ``engine.lagom.close()`` writes the final
report and removes the wrappers.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import deepspeed

from lagom_deepspeed.config import LagomConfig, parse_section

__all__ = ["LagomConfig", "initialize", "parse_section", "patch", "unpatch"]

log = logging.getLogger("lagom.deepspeed")
_deepspeed_initialize = deepspeed.initialize


def _ds_config(args: Any, config: Any, config_params: Any) -> tuple[Any, str]:
    """The config DeepSpeed would read, and where it came from ("config" or "args")."""
    if config is None and config_params is not None:
        config = config_params
    for attr in ("deepspeed_config", "deepscale_config"):
        if getattr(args, attr, None) is not None and config is None:
            return getattr(args, attr), attr
    return config, "config"


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> tuple:
    """``deepspeed.initialize`` that honours the ``"lagom"`` section (see the module docstring)."""
    passthrough = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                       training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
                       mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                       mesh_param=mesh_param, config_params=config_params)
    source, where = _ds_config(args, config, config_params)
    if source is None or model is None:
        return _deepspeed_initialize(**passthrough)
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    ds_config = load_ds_config(source)
    section = parse_section(ds_config)
    if section is None or not section.enabled:
        if section is not None:
            log.info("lagom section present with enabled: false; DeepSpeed runs unchanged")
        return _deepspeed_initialize(**passthrough)

    from deepspeed import comm as ds_dist
    from deepspeed.accelerator import get_accelerator

    from lagom.errors import ConfigError
    from lagom_deepspeed.session import Session

    ds_dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                             distributed_port=distributed_port, dist_init_required=dist_init_required)
    try:
        session, engine_config = Session.prepare(section, model, mpu, ds_config)
    except ConfigError:  # the user's section or files: the same on every rank, and theirs to fix
        raise
    except Exception as err:  # noqa: BLE001 - Lagom's own failure must not fail a job DeepSpeed accepts
        log.error("Lagom switched itself off at start-up (%s: %s). DeepSpeed runs with its own settings.",
                  type(err).__name__, err)
        return _deepspeed_initialize(**passthrough)
    session.start_runtime()
    if where != "config":  # DeepSpeed refuses a config argument next to args.deepspeed_config
        args = copy.copy(args)
        setattr(args, where, None)
    try:
        out = _deepspeed_initialize(**{**passthrough, "args": args, "config": engine_config, "config_params": None})
    except BaseException:
        session.close()
        raise
    session.attach(out[0])
    return out


def patch() -> None:
    """Make ``deepspeed.initialize`` honour the lagom section (idempotent)."""
    deepspeed.initialize = initialize


def unpatch() -> None:
    deepspeed.initialize = _deepspeed_initialize
