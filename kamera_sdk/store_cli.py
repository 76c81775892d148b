"""``kamera store``: inspect and repair a disk store (info, check, rebuild-index, prune, clear).

Each subcommand opens the store at ``--path`` (default: ``default_store_path()``), which must already
exist (a mistyped path is an error, not a new empty store); opening it rebuilds a lost or corrupt index,
as any open does. Results print as a table, or as one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kamera_engine.errors import InvalidInputError

from .cli_args import byte_count
from .console import print_result
from .store import DiskBackend, default_store_path


def open_existing(path: str | Path | None) -> DiskBackend:
    """The disk store at ``path`` (default store path when None); InvalidInputError when there is none."""
    root = Path(path).expanduser() if path is not None else default_store_path()
    if not root.is_dir():
        raise InvalidInputError(f"no store at {root} (give --path, or set KAMERA_HOME)")
    return DiskBackend(root)


def store_info(path: str | Path | None = None) -> dict[str, Any]:
    """Entries and bytes in all, by kind, by model fingerprint and by stored dtype."""
    backend = open_existing(path)
    try:
        return backend.info()
    finally:
        backend.close()


def store_check(path: str | Path | None = None, *, fix: bool = False) -> dict[str, Any]:
    """Verify every entry's checksum (``fix``: quarantine bad files, re-index files with no row)."""
    backend = open_existing(path)
    try:
        return backend.check(fix=fix)
    finally:
        backend.close()


def store_rebuild_index(path: str | Path | None = None) -> dict[str, Any]:
    """Rebuild the index from the entry files (the old index is kept under ``index-aside/``)."""
    backend = open_existing(path)
    try:
        if backend.last_rebuild is not None:  # opening found the index lost or broken and rebuilt it
            return backend.last_rebuild.as_dict()
        return backend.rebuild_index().as_dict()
    finally:
        backend.close()


def store_prune(path: str | Path | None = None, *, max_bytes: int) -> dict[str, Any]:
    """Evict least recently used entries until the store holds at most ``max_bytes``."""
    backend = open_existing(path)
    try:
        return backend.prune(max_bytes)
    finally:
        backend.close()


def store_clear(path: str | Path | None = None) -> dict[str, Any]:
    """Delete every entry; the directory stays an (empty) store."""
    backend = open_existing(path)
    try:
        return {"deleted": backend.clear(), "path": str(backend.root)}
    finally:
        backend.close()


def _clear(args: argparse.Namespace) -> dict[str, Any]:
    if not args.yes:
        raise InvalidInputError("clear deletes every stored entry: add --yes to confirm")
    return store_clear(args.path)


#: subcommand -> what it runs on the parsed arguments
_ACTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "info": lambda a: store_info(a.path),
    "check": lambda a: store_check(a.path, fix=a.fix),
    "rebuild-index": lambda a: store_rebuild_index(a.path),
    "prune": lambda a: store_prune(a.path, max_bytes=a.max_bytes),
    "clear": _clear,
}


def _run(args: argparse.Namespace) -> int:

    result = _ACTIONS[args.store_action](args)
    print_result(result, args.json, f"kamera store {args.store_action}")
    failed = args.store_action == "check" and not args.fix and (result["bad"] or result["missing_files"])
    return 1 if failed else 0


def add_store_command(sub: Any) -> None:
    """Register ``kamera store ...`` on the main parser's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--path", default=None, help="store directory (default: $KAMERA_HOME/store)")
    common.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    store = sub.add_parser("store", help="inspect and repair a disk store: info, check, rebuild-index, prune, clear")
    actions = store.add_subparsers(dest="store_action", required=True)
    actions.add_parser("info", parents=[common], help="entries and bytes by kind, model fingerprint and dtype")
    check = actions.add_parser("check", parents=[common], help="verify every entry's checksum (exit 1 if any is bad)")
    check.add_argument("--fix", action="store_true", help="quarantine bad files, re-index verified files with no row")
    actions.add_parser("rebuild-index", parents=[common], help="rebuild the index from the entry files")
    prune = actions.add_parser("prune", parents=[common], help="evict least recently used entries down to a size")
    prune.add_argument("--max-bytes", type=byte_count, required=True, help="bytes to keep at most (e.g. 2G)")
    clear = actions.add_parser("clear", parents=[common], help="delete every entry (needs --yes)")
    clear.add_argument("--yes", action="store_true", help="confirm: delete every stored entry")
    store.set_defaults(func=_run)
