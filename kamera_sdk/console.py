"""Terminal output: results on stdout, progress and chatter on stderr (so ``--json`` stays parseable)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

T = TypeVar("T")

out = Console()
err = Console(stderr=True)


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """A progress bar on stderr over ``items``."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(description, total=total if total is not None else len(items))  # type: ignore[arg-type]
        for item in items:
            yield item
            progress.advance(task)


def finite(data: Any) -> Any:
    """``data`` with NaN / infinities as null: strict JSON has no spelling for them."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(v) for v in data]
    return data


def write_json(data: Any) -> None:
    """One strict JSON document on stdout (what ``--json`` promises)."""
    sys.stdout.write(json.dumps(finite(data), indent=2, default=str, allow_nan=False) + "\n")


def _flatten(data: Any, prefix: str = "") -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            rows += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(data, float):
        rows.append((prefix, f"{data:.6g}"))
    else:
        rows.append((prefix, str(data)))
    return rows


def print_result(result: dict[str, Any], as_json: bool, title: str) -> None:
    """JSON on stdout with ``--json``; a readable table otherwise."""
    if as_json:
        write_json(result)
        return
    table = Table(title=title)
    table.add_column("key")
    table.add_column("value", justify="right")
    for k, v in _flatten(result):
        table.add_row(k, v)
    out.print(table)
