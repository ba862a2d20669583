"""A pytest plugin for vLLM's own suite on the kit's CPU machines.

Loaded with ``-p kit.vllm_tree.suite_plugin`` by kit/vllm_tree/upstream_suite.py.

- Every case gets a wall-clock limit. A case that waits on something this machine
  lacks (a hub download, a library's server) would otherwise stall the whole
  suite; with the limit it fails as one case, named in the junit file, and the
  run goes on. ``KIT_SUITE_TIMEOUT_S`` sets it (default 300 s). SIGALRM
  interrupts a blocking call in the main thread (PEP 475 runs the handler, whose
  exception ends the call); standard library only, so no dependency joins the lock.
- ``--kit-exclude NAME`` (repeatable) deselects a case by its exact node id, or
  every parameter set of it when NAME has no ``[...]``. pytest's own
  ``--deselect`` matches prefixes, so excluding ``test_bind_kv_cache`` would
  also drop ``test_bind_kv_cache_keeps_scheduler_block_views_for_runner``.
- Every case is marked ``skip_global_cleanup``, the marker vLLM's own
  tests/conftest.py offers. Its per-case cleanup tears down a distributed
  environment these cases never start and frees accelerator memory the CPU does
  not have; what is left is a full garbage collection after every case, which
  costs 0.5-2 s each on a heap that grows over a thousand cases (most of the
  suite's time here). Nothing a case checks depends on it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

DEFAULT_S = 300


class SuiteTimeout(Exception):
    """The case ran past its limit."""


def limit_s() -> int:
    return int(os.environ.get("KIT_SUITE_TIMEOUT_S", DEFAULT_S))


def _expire(signum: int, _frame: object) -> None:
    raise SuiteTimeout(f"ran past the suite's per-test limit of {limit_s()} s")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--kit-exclude", action="append", default=[], metavar="NAME")


def excluded(nodeid: str, names: set[str]) -> bool:
    return nodeid in names or nodeid.split("[", 1)[0] in names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    names = set(config.getoption("kit_exclude"))
    dropped = [item for item in items if excluded(item.nodeid, names)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not excluded(item.nodeid, names)]
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Setup, call and teardown together: a fixture can hang as well as a test.
    previous = signal.signal(signal.SIGALRM, _expire)
    signal.alarm(limit_s())
    try:
        return (yield)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
