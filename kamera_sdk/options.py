"""Option models: the pydantic base of every user-facing configuration (``WindowConfig``,
``EnvelopeConfig``).

Options are frozen, a misspelled name is refused rather than silently ignored (a typo would otherwise
run the defaults), and a bad value raises ``InvalidInputError`` naming the option, like every other
Kamera input check.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from kamera_engine import InvalidInputError


def describe(exc: ValidationError, what: str) -> str:
    """One line naming each offending option of ``what`` and what was wrong with it."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(options)"
        if err["type"] == "extra_forbidden":
            msg = "unknown option"
        elif err["type"] == "value_error" and isinstance(err.get("ctx", {}).get("error"), InvalidInputError):
            msg = str(err["ctx"]["error"])  # a nested option model's own message
        else:
            msg = err["msg"]
        parts.append(f"{loc}: {msg}")
    return f"invalid {what} option " + "; ".join(parts)


class Options(BaseModel):
    """Frozen, closed option set; bad input raises ``InvalidInputError``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise InvalidInputError(describe(exc, type(self).__name__)) from None
