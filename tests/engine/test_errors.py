"""The exception tree drawn in ``kamera_engine.errors``' docstring is the module's real class tree: every class
appears once, under its actual parent, and the tree names nothing else."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

from kamera_engine import errors

_NODE = re.compile(r"^(?P<indent>(?:[│ ] {3})*)(?:[├└]── )?(?P<name>[A-Z]\w*)\b")


def _drawn_tree() -> dict[str, str | None]:
    """Class name -> parent name, read off the docstring's drawing (depth from the box-drawing indent)."""
    doc = errors.__doc__ or ""
    block = doc.split("::", 1)[1].strip("\n").split("\n\n", 1)[0]
    parents: dict[str, str | None] = {}
    stack: list[str] = []
    for line in block.splitlines():
        match = _NODE.match(line.strip("\n")[4:])  # the drawing is indented by four spaces
        assert match, f"not a tree line: {line!r}"
        depth = len(match["indent"]) // 4 + (1 if "──" in line else 0)
        del stack[depth:]
        name = match["name"]
        assert name not in parents, f"{name} drawn twice"
        parents[name] = stack[-1] if stack else None
        stack.append(name)
    return parents


def test_the_docstring_tree_is_the_class_tree() -> None:
    classes = {
        name: cls
        for name, cls in vars(errors).items()
        if inspect.isclass(cls) and issubclass(cls, Exception) and cls.__module__ == errors.__name__
    }
    drawn = _drawn_tree()
    assert set(drawn) == set(classes), f"missing: {set(classes) - set(drawn)}, extra: {set(drawn) - set(classes)}"
    for name, cls in classes.items():
        ours = [b.__name__ for b in cls.__bases__ if b.__module__ == errors.__name__]
        assert drawn[name] == (ours[0] if ours else None), f"{name} is drawn under {drawn[name]}, subclasses {ours}"
    assert set(errors.__all__) == set(classes)


def test_positive_int_takes_whole_numbers_of_at_least_one_and_names_the_argument() -> None:
    assert errors.positive_int("n", 3) == 3
    assert errors.positive_int("n", np.int64(7)) == 7 and type(errors.positive_int("n", np.int64(7))) is int
    assert errors.positive_int("limit", None, optional=True) is None
    for bad in (0, -2, True, 2.0, "3", None):
        with pytest.raises(errors.InvalidInputError, match=rf"^n must be an int >= 1, got {re.escape(repr(bad))}$"):
            errors.positive_int("n", bad)
    with pytest.raises(errors.InvalidInputError, match=r"^limit must be an int >= 1 or None, got False$"):
        errors.positive_int("limit", False, optional=True)
