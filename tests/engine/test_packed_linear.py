"""oneDNN's packed linears (``packed_linear.py``): the same numbers as ``nn.Linear`` within float rounding,
a packed copy that follows its weight, copies that pack again, and the backend's choice and refusals."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from kamera_engine import Engine, InvalidInputError
from kamera_engine.loading import LoadSettings
from kamera_engine.packed_linear import (
    LINEAR_BACKEND_ENV,
    PackedLinear,
    onednn_available,
    pack_linears,
    resolve_linear_backend,
)
from kamera_engine.runner import run_forward
from tests.conftest import ANCHOR, random_ids, tiny_model

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def _layer(n_in: int = 48, n_out: int = 40, bias: bool = True) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(3)
    plain = nn.Linear(n_in, n_out, bias=bias)
    packed = copy.deepcopy(plain)
    holder = nn.Sequential(packed)
    assert pack_linears(holder) == 1
    return plain, holder[0]


@pytest.mark.parametrize("rows", [1, 3, 8, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_equals_nn_linear_within_rounding(rows: int, bias: bool) -> None:
    plain, packed = _layer(bias=bias)
    assert type(packed) is PackedLinear
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        got, want = packed(x), plain(x)
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


def test_the_packed_copy_follows_its_weight() -> None:
    """A weight changed in place, replaced, or given new data (``.data =``, a dtype round trip) is packed
    again before the next forward (never a stale copy)."""
    plain, packed = _layer()
    x = torch.randn(1, 4, 48)
    with torch.no_grad():
        first = packed._packing
        packed.weight.mul_(2.0)
        plain.weight.mul_(2.0)
        assert torch.allclose(packed(x), plain(x), atol=1e-5) and packed._packing is not first
        packed.weight = nn.Parameter(torch.randn(40, 48))
        plain.weight = nn.Parameter(packed.weight.detach().clone())
        assert torch.allclose(packed(x), plain(x), atol=1e-5)
        packed.weight.data = torch.randn(40, 48)
        plain.weight.data = packed.weight.detach().clone()
        assert torch.allclose(packed(x), plain(x), atol=1e-5)
        packed.to(torch.bfloat16).to(torch.float32)
        plain.to(torch.bfloat16).to(torch.float32)
        assert torch.allclose(packed(x), plain(x), atol=1e-5)


def test_a_lone_row_equals_the_same_row_in_a_batch() -> None:
    """Where oneDNN's one-row kernel rounds differently (the default model's 1,536-input down projection),
    a lone row runs as two, so a row's result does not depend on how many rows share the product."""
    for n_in in (576, 1536):
        torch.manual_seed(n_in)
        layer = nn.Sequential(nn.Linear(n_in, 64, bias=False))
        pack_linears(layer)
        x = torch.randn(1, 64, n_in)
        with torch.inference_mode():
            for rows in (2, 3, 8, 64):
                batch = layer(x[:, :rows])
                for i in (0, rows - 1):
                    assert torch.equal(layer(x[:, i : i + 1]), batch[:, i : i + 1]), (n_in, rows, i)
    packed = layer[0]
    packed._current()  # packed now; force the two-row form and check every lone shape
    packed._packing = packed._packing._replace(pad_single=True)
    v = x[0, 0]
    with torch.inference_mode():
        want = nn.functional.linear(v, packed.weight)
        for shape in ((n_in,), (1, n_in), (1, 1, n_in)):
            got = packed(v.reshape(shape))
            assert got.shape == (*shape[:-1], 64) and torch.allclose(got.reshape(-1), want, atol=1e-4)


def test_copies_pack_again_and_autograd_runs_through_nn_linear() -> None:
    plain, packed = _layer()
    x = torch.randn(1, 5, 48)
    for twin in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):
        assert type(twin) is PackedLinear and twin._packing is None
        with torch.no_grad():
            assert torch.allclose(twin(x), plain(x), atol=1e-5)
    x.requires_grad_(True)
    packed(x).sum().backward()  # a forward autograd must see runs nn.Linear's own
    assert x.grad is not None and packed.weight.grad is not None


def test_only_plain_cpu_float32_linears_are_packed() -> None:
    class Adapter(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(8, 8), Adapter(8, 8), nn.Linear(8, 8).to(torch.bfloat16))
    assert pack_linears(model) == 1
    assert [type(m) for m in model] == [PackedLinear, Adapter, nn.Linear]


def test_the_backend_is_chosen_and_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    monkeypatch.delenv(LINEAR_BACKEND_ENV, raising=False)
    assert resolve_linear_backend(None, model) == "onednn"
    assert resolve_linear_backend("native", model) == "native"
    monkeypatch.setenv(LINEAR_BACKEND_ENV, "native")
    assert resolve_linear_backend(None, model) == "native"
    assert resolve_linear_backend("onednn", model) == "onednn"  # an argument wins over the environment
    monkeypatch.setenv(LINEAR_BACKEND_ENV, "mkl")
    with pytest.raises(InvalidInputError, match="unknown linear backend 'mkl'"):
        resolve_linear_backend(None, model)
    monkeypatch.delenv(LINEAR_BACKEND_ENV)
    half = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16))
    assert resolve_linear_backend(None, half) == "native"  # auto: oneDNN's packed path is float32 only
    with pytest.raises(InvalidInputError, match="float32 models on a CPU"):
        resolve_linear_backend("onednn", half)
    with pytest.raises(InvalidInputError, match="unknown linear backend 'blas'"):
        LoadSettings.resolve("cpu", None, None, "blas")
    with pytest.raises(InvalidInputError, match="float32 models on a CPU"):  # before any weights are read
        LoadSettings.resolve("cpu", "bf16", None, "onednn")
    monkeypatch.setenv(LINEAR_BACKEND_ENV, "fast")
    with pytest.raises(InvalidInputError, match="unknown linear backend 'fast'"):
        LoadSettings.resolve("cpu", None, None, None)
    monkeypatch.delenv(LINEAR_BACKEND_ENV)
    pack_linears(model)  # packed by another engine: it runs onednn, and native is refused for it
    assert resolve_linear_backend(None, model) == "onednn"
    with pytest.raises(InvalidInputError, match="already packed"):
        resolve_linear_backend("native", model)


def test_a_model_made_in_inference_mode_packs() -> None:
    """Inference tensors keep no version counter: their packing is keyed on the tensor and its storage."""
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(16, 8))
        x = torch.randn(3, 16)
    assert pack_linears(model) == 1
    with torch.inference_mode():
        assert torch.allclose(model(x), nn.functional.linear(x, model[0].weight, model[0].bias), atol=1e-5)


def test_an_engine_on_packed_linears_answers_as_on_nn_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default CPU engine packs its linears; its logits and KV match BLAS's within float32 rounding
    and its greedy tokens are the same."""
    monkeypatch.delenv(LINEAR_BACKEND_ENV, raising=False)
    # on the CPU wherever the tests run (``KAMERA_TEST_DEVICE``): packing is a CPU engine's
    packed = Engine(tiny_model("llama").cpu(), None, anchor_ids=ANCHOR)
    native = Engine(tiny_model("llama").cpu(), None, anchor_ids=ANCHOR, linear_backend="native")
    assert packed.info().linear_backend == "onednn" and native.info().linear_backend == "native"
    assert not any(type(m) is PackedLinear for m in native.model.modules())
    assert packed.fingerprint == native.fingerprint  # the same weights: stored KV serves both
    ids = torch.tensor(random_ids(40, 7))
    a = run_forward(packed.model, ids, None, 0, logits="all")
    b = run_forward(native.model, ids, None, 0, logits="all")
    assert (a.logits - b.logits).abs().max() < 1e-4
    assert (a.kv.keys - b.kv.keys).abs().max() < 1e-4
    assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
