"""Integration-test hooks: pytest-asyncio's auto mode for the modules that ask for it.

LangChain's standard suite writes its async tests as plain ``async def`` methods (it expects auto mode), and
forbids overriding them. The project runs pytest-asyncio in strict mode, so a module that sets
``ASYNCIO_AUTO = True`` gets the ``asyncio`` mark on each of its coroutine tests here, at collection.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from typing import Any

import pytest


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> Generator[None, Any, None]:
    outcome = yield
    module = getattr(collector, "module", None)
    if not getattr(module, "ASYNCIO_AUTO", False):
        return
    made = outcome.get_result()
    for item in made if isinstance(made, list) else [made]:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            item.add_marker(pytest.mark.asyncio)
