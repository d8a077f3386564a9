"""pytest plugin: Megatron-LM's own tests run with Lagom's interception of megatron-core installed.

Loaded with ``-p lagom_megatron_intercept`` in the 'with Lagom' run (the Megatron checkout on
PYTHONPATH is then a copy patched by ``lagom patch megatron --path``). For the whole session,
``Interceptor(Recorder()).install()`` wraps the overlap points a Lagom session wraps in a training
job (DDP bucket syncs, tensor-parallel collectives and linears, pipeline send/recv), so every
collective megatron-core issues in a test goes through Lagom's wrappers and is timed by its
recorder. Each test is one recorder step; the session's end prints how many calls were recorded
per group and collective, which shows the wrappers were really on the path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

_state: dict[str, Any] = {}


def pytest_configure(config: pytest.Config) -> None:
    from lagom.runtime.apply.recorder import Recorder
    from lagom_megatron.intercept import Interceptor

    recorder = Recorder()
    _state["recorder"] = recorder
    _state["interceptor"] = Interceptor(recorder).install()
    _state["calls"] = Counter()
    _state["step"] = 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    recorder = _state["recorder"]
    _state["step"] += 1
    recorder.begin_step(_state["step"])
    yield
    for record in recorder.end_step():
        _state["calls"][f"{record.group}/{record.collective}"] += 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    calls = _state.get("calls", Counter())
    recorder = _state.get("recorder")
    pending = recorder.pending if recorder is not None else 0
    terminalreporter.write_line(f"lagom interception: {sum(calls.values())} collective calls recorded"
                                f" ({pending} still open)")
    for key, count in sorted(calls.items()):
        terminalreporter.write_line(f"  {key}: {count}")


def pytest_unconfigure(config: pytest.Config) -> None:
    interceptor = _state.pop("interceptor", None)
    if interceptor is not None:
        interceptor.uninstall()
