"""Terminal output: results on stdout, progress and chatter on stderr (so ``--json`` stays parseable)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
