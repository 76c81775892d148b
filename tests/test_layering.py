"""Import layering: the contracts in pyproject.toml (``[tool.importlinter]``, also run by ``make test`` as
``lint-imports``) hold on the code, each one breaks on an import planted against it, and the modules import
each other without cycles beyond the ones issue 22 is removing.

See docs/architecture.md ("Import layering") for what each contract means.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import grimp
import networkx as nx
import pytest
from importlinter.application.use_cases import read_user_options
from importlinter.configuration import configure
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.private_modules import PrivateModulesContract
from importlinter.domain.contract import Contract

ROOT = Path(__file__).resolve().parents[1]
configure()  # what the lint-imports command does first: the config readers and graph builder it uses
OPTIONS = read_user_options(str(ROOT / "pyproject.toml"))
CONTRACTS: list[dict[str, Any]] = OPTIONS.contracts_options
CONTRACT_TYPES: dict[str, type[Contract]] = {"forbidden": ForbiddenContract, "private_modules": PrivateModulesContract}

#: For each contract, one import that breaks it (importer, imported). A contract added without an entry
#: here fails ``test_every_contract_has_a_planted_violation``.
PLANTED: dict[str, tuple[str, str]] = {
    "the engine never imports the SDK or an integration": ("kamera_engine.kv", "kamera_sdk.window"),
    "integrations import only kamera_sdk's public names (the package, not its modules, not the engine)": (
        "kamera_langchain.chat_models",
        "kamera_sdk.chat_format",
    ),
    "a private module (_name) is imported only inside its own package (the store's backends, ...)": (
        "kamera_sdk.server.app",
        "kamera_sdk.store._disk",
    ),
    "the SDK uses the engine's public API, not its internals": ("kamera_sdk.bench.operator", "kamera_engine.rope"),
    "the SDK's core does not import its front ends (server, benches, CLI, demo)": (
        "kamera_sdk.executor",
        "kamera_sdk.server.client",
    ),
    "policies decide plans: they do not import the window, the executor or storage": (
        "kamera_sdk.policies.kamera",
        "kamera_sdk.window",
    ),
    "the store holds bytes: it imports nothing of the SDK above it": ("kamera_sdk.store._entry", "kamera_sdk.window"),
}

#: Import cycles that exist today and are being removed by issue 22 (items 2 and 4). A cycle not inside one of
#: these fails; once they are gone, empty this.
KNOWN_CYCLES: list[frozenset[str]] = []


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(
        *OPTIONS.session_options["root_packages"], cache_dir=None, exclude_type_checking_imports=True
    )  # imports under TYPE_CHECKING never run


def _contract(options: dict[str, Any]) -> Contract:
    cls = CONTRACT_TYPES[options["type"]]
    return cls(name=options["name"], session_options=dict(OPTIONS.session_options), contract_options=options)


def _names() -> list[str]:
    return [c["name"] for c in CONTRACTS]


def test_every_contract_has_a_planted_violation() -> None:
    assert set(_names()) == set(PLANTED)
    assert {c["type"] for c in CONTRACTS} <= set(CONTRACT_TYPES)


@pytest.mark.parametrize("name", _names())
def test_contract_is_kept(graph: grimp.ImportGraph, name: str) -> None:
    options = next(c for c in CONTRACTS if c["name"] == name)
    check = _contract(options).check(copy.deepcopy(graph), verbose=False)
    assert check.kept, check.metadata


@pytest.mark.parametrize("name", _names())
def test_contract_breaks_on_a_planted_import(graph: grimp.ImportGraph, name: str) -> None:
    options = next(c for c in CONTRACTS if c["name"] == name)
    importer, imported = PLANTED[name]
    assert importer in graph.modules and imported in graph.modules
    planted = copy.deepcopy(graph)
    planted.add_import(importer=importer, imported=imported, line_number=1, line_contents="planted")
    assert not _contract(options).check(planted, verbose=False).kept


def test_no_new_import_cycles(graph: grimp.ImportGraph) -> None:
    g = nx.DiGraph()
    for module in graph.modules:
        g.add_node(module)
        g.add_edges_from((module, dep) for dep in graph.find_modules_directly_imported_by(module))
    cycles = [frozenset(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert all(any(c <= known for known in KNOWN_CYCLES) for c in cycles), cycles
