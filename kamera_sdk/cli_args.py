"""Argument types and option groups the ``kamera`` commands share.

One grammar per kind of value, so that ``kamera store prune --max-bytes 2G`` and ``kamera serve
--kv-budget 2G`` read a size the same way, and one set of batching flags, so that ``kamera serve`` and
``kamera fleet up`` configure a server's scheduler alike and refuse the same contradictions.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from fractions import Fraction
from functools import partial
from typing import TYPE_CHECKING, Any

from kamera_engine.errors import InvalidInputError, UnsupportedModelError

if TYPE_CHECKING:
    from kamera_engine import Engine


def whole(value: str) -> int:
    """A whole number written in ASCII digits (``"12"``; not ``"1e3"``, ``"0x10"`` or ``"²"``)."""
    if not re.fullmatch(r"\s*[0-9]+\s*", value):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}")
    return int(value)


def positive(value: str) -> int:
    """A whole number of at least 1."""
    n = whole(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def port(value: str) -> int:
    """A TCP port, 0 for a free one."""
    n = whole(value)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {n}")
    return n


# k, M, G, T are powers of 1000; Ki, Mi, Gi, Ti powers of 1024; a trailing B is optional; any case
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SCALE |= {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([kmgt]i?)b?|b)?\s*", flags=re.IGNORECASE | re.ASCII)


def byte_count(value: str) -> int:
    """A size in bytes: ``"500000"``, ``"500M"``, ``"2G"``, ``"1.5GiB"``, ``"512 MiB"``; it must come to a
    whole number of bytes (``"1.5"`` does not)."""
    found = _SIZE.fullmatch(value)
    if found is None:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 500000, 500M, 2G or 1.5GiB, got {value!r}")
    size = Fraction(found.group(1)) * _SCALE[(found.group(2) or "").lower()]  # exact, however many digits
    if size.denominator != 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of bytes")
    return int(size)


def nonzero_byte_count(value: str) -> int:
    """A size in bytes (``byte_count``) of at least 1."""
    n = byte_count(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {value!r}")
    return n


#: the batching flags -> ``create_app``'s keyword for each
_BATCHING = {"kv_budget": "kv_budget_bytes", "step_tokens": "step_tokens", "max_batch_rows": "max_batch_rows"}


def add_batching_flags(parser: argparse.ArgumentParser) -> None:
    """``--no-batch``, ``--kv-budget``, ``--step-tokens`` and ``--max-batch-rows`` (read them back with
    ``batching_options``)."""
    parser.add_argument(
        "--no-batch",
        dest="batch",
        action="store_false",
        help="one answer at a time on one worker thread instead of every session's work in shared batched steps",
    )
    parser.add_argument(
        "--kv-budget",
        type=nonzero_byte_count,
        default=None,
        metavar="BYTES",
        help="KV the answers being decoded may hold (e.g. 2GiB); past it new answers wait, then get 429 with "
        "Retry-After (default: no limit)",
    )
    parser.add_argument(
        "--step-tokens",
        type=positive,
        default=None,
        metavar="N",
        help="most tokens one batched step runs; longer prompts are prefilled in chunks (default: 512)",
    )
    parser.add_argument(
        "--max-batch-rows",
        type=positive,
        default=None,
        metavar="N",
        help="most rows (answers and window forwards) in one batched step (default: 64)",
    )


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """``--max-held-tokens`` (read it back with ``limit_options``)."""
    parser.add_argument(
        "--max-held-tokens",
        type=positive,
        default=None,
        metavar="N",
        help="tokens all sessions may hold together (placed, and content seen); content past it gets 429 "
        "(default: no limit)",
    )


def limit_options(args: argparse.Namespace) -> dict[str, Any]:
    """``create_app``'s server-wide limits given on the command line."""
    return {} if args.max_held_tokens is None else {"max_held_tokens": args.max_held_tokens}


def batching_flags_given(args: argparse.Namespace) -> list[str]:
    """The scheduler flags on the command line (``--kv-budget`` ...), in the order ``--help`` lists them."""
    return ["--" + name.replace("_", "-") for name in _BATCHING if getattr(args, name) is not None]


def batching_refused(given: list[str], why: str) -> InvalidInputError:
    """The error for scheduler flags that nothing would use: ``given`` flags, ``why`` (``"--no-batch turns
    off"``, ``"this model does not do (...)"``)."""
    verb = "configures" if len(given) == 1 else "configure"
    return InvalidInputError(f"{', '.join(given)} {verb} batching, which {why}")


def batching_options(args: argparse.Namespace) -> dict[str, Any]:
    """``create_app``'s ``batch`` and the scheduler options given (those left out keep its defaults).
    InvalidInputError when ``--no-batch`` comes with a scheduler flag: nothing would use it."""
    given = batching_flags_given(args)
    if not args.batch and given:
        raise batching_refused(given, "--no-batch turns off")
    options: dict[str, Any] = {"batch": args.batch}
    options |= {key: getattr(args, name) for name, key in _BATCHING.items() if getattr(args, name) is not None}
    return options


#: the vision flags -> ``VisionEngine.load``'s keyword for each
_VISION = {"vision_memory": "vision_memory_bytes", "vision_cache": "cache_dir"}


def add_vision_flags(parser: argparse.ArgumentParser) -> None:
    """``--vision-memory`` and ``--vision-cache``: where a vision-language model keeps its tower outputs (read
    them back with ``vision_options``)."""
    parser.add_argument(
        "--vision-memory",
        type=nonzero_byte_count,
        default=None,
        metavar="BYTES",
        help="vision-language models: tower outputs kept in memory (e.g. 512MiB); older ones go to disk and are "
        "read back when a forward needs them (default: 1GiB)",
    )
    parser.add_argument(
        "--vision-cache",
        default=None,
        metavar="DIR",
        help="vision-language models: also write tower outputs here, for a later process to read (default: a "
        "temporary directory of the server's own, removed when it stops)",
    )


def vision_options(args: argparse.Namespace) -> dict[str, Any]:
    """``VisionEngine.load``'s keywords given on the command line (none for a command without the flags)."""
    return {key: getattr(args, name) for name, key in _VISION.items() if getattr(args, name, None) is not None}


def engine_loader(args: argparse.Namespace) -> Callable[[], Engine]:
    """A picklable call that loads ``--model`` on ``--device`` in ``--dtype`` (a Ray replica runs it too); with
    a vision flag, as a vision-language engine so configured."""
    return partial(load_model, args.model, args.device, args.dtype, vision_options(args))


def load_model(model: str | None, device: str | None, dtype: str | None, vision: dict[str, Any]) -> Engine:
    """``Engine.load`` of ``model``, or ``VisionEngine.load`` with ``vision``'s keywords when there are any: a
    model that is not vision-language is then refused (InvalidInputError naming the flags) before its weights
    are read."""
    from kamera_engine import Engine
    from kamera_engine.vision import VisionEngine

    if not vision:
        return Engine.load(model, device=device, dtype=dtype)
    try:
        return VisionEngine.load(model, device=device, dtype=dtype, **vision)  # type: ignore[arg-type]
    except UnsupportedModelError as exc:
        flags = ", ".join("--" + name.replace("_", "-") for name, key in _VISION.items() if key in vision)
        verb = "configures" if len(vision) == 1 else "configure"
        raise InvalidInputError(f"{flags} {verb} a vision-language model's tower outputs: {exc}") from exc
