"""The patch: full rank reproduces KV(B|A) and re-prefill's next-token distribution; ranks and layers
behave; malformed inputs raise clear errors."""

from __future__ import annotations

import pytest
import torch

from kamera_engine import KV, Engine, InvalidInputError, Patch, conditioning_delta
from kamera_engine.operator import _top_factors
from tests.conftest import ANCHOR, random_ids, tiny_engine


def _setup(engine: Engine, seed: int = 0):
    a_ids, b_ids, q_ids = random_ids(20, seed), random_ids(16, seed + 1), random_ids(5, seed + 2)
    full = ANCHOR + a_ids + b_ids
    ref = engine.forward(full, None, 0, logits="none").kv.to("cpu")  # beside the canonical, in host memory
    start_b = len(ANCHOR) + len(a_ids)
    cond_b = ref.slice(start_b, start_b + len(b_ids))
    can_b = engine.canonical(b_ids)
    return a_ids, b_ids, q_ids, ref, cond_b, can_b, start_b


def _logprobs(engine: Engine, past: KV, q_ids: list[int]) -> torch.Tensor:
    return engine.next_token_logprobs(past, q_ids, len(past))


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum())


def test_full_rank_patch_reproduces_conditioned_kv_and_distribution(tiny: Engine) -> None:
    _, b_ids, q_ids, ref, cond_b, can_b, start_b = _setup(tiny)
    full_rank = len(b_ids)  # T <= H*D here, so rank T is exact
    patch = tiny.form_patch(cond_b, can_b, rank=full_rank)
    served = tiny.apply(can_b, patch, start_b)
    assert (served.keys - cond_b.keys).abs().max().item() <= 1e-4
    assert (served.values - cond_b.values).abs().max().item() <= 1e-4
    assembled = KV.cat([ref.slice(0, start_b), served])
    lp_ref = _logprobs(tiny, ref, q_ids)
    lp_served = _logprobs(tiny, assembled, q_ids)
    assert _kl(lp_ref, lp_served) <= 1e-6


def test_patch_error_shrinks_with_rank() -> None:
    engine = tiny_engine("llama")
    _, _b_ids, _, _, cond_b, can_b, start_b = _setup(engine, seed=10)
    errs = []
    for rank in (1, 4, 16):
        served = engine.apply(can_b, engine.form_patch(cond_b, can_b, rank=rank), start_b)
        errs.append((served.keys - cond_b.keys).norm().item() + (served.values - cond_b.values).norm().item())
    blind = engine.apply(can_b, None, start_b)
    blind_err = (blind.keys - cond_b.keys).norm().item() + (blind.values - cond_b.values).norm().item()
    assert blind_err > errs[0] > errs[1] > errs[2]


@pytest.mark.parametrize("tokens", [12, 20, 40])  # the (T, T) Gram matrix up to 3/4 of the features, then (F, F)
def test_top_factors_are_the_truncated_svd(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(tokens)
    features, rank = 24, 6
    qr_calls: list[int] = []
    qr = torch.linalg.qr
    monkeypatch.setattr(torch.linalg, "qr", lambda a, *args, **kw: qr_calls.append(1) or qr(a, *args, **kw))
    spectrum = torch.logspace(0, -4, min(tokens, features), dtype=torch.float64)
    u = torch.linalg.qr(torch.randn(3, tokens, len(spectrum), dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(3, features, len(spectrum), dtype=torch.float64))[0]
    qr_calls.clear()
    delta = (u * spectrum) @ v.transpose(1, 2)
    delta[1] = 0.0  # a layer the context does not change (layer 0 of a real model): zero factors, no NaN
    us, vt = _top_factors(delta.float(), rank, torch.float32)
    assert len(qr_calls) == (3 if 4 * tokens <= 3 * features else 0)  # the (T, T) route orthonormalises V
    assert us.shape == (3, tokens, rank) and vt.shape == (3, rank, features)
    assert torch.isfinite(us).all() and torch.isfinite(vt).all() and us[1].abs().max() == 0
    best = (u[:, :, :rank] * spectrum[:rank]) @ v[:, :, :rank].transpose(1, 2)  # Eckart-Young
    best[1] = 0.0
    assert (torch.bmm(us, vt).double() - best).abs().max().item() <= 1e-5
    for layer in (0, 2):
        assert (vt[layer] @ vt[layer].T - torch.eye(rank)).abs().max().item() <= 1e-5
        norms = us[layer].norm(dim=0)  # largest first: truncating a stored patch keeps its leading factors
        assert (norms[:-1] >= norms[1:]).all()


def test_top_factors_of_a_short_chunk_below_and_at_full_rank() -> None:
    """Fewer tokens than features: a Delta of lower rank than asked is rebuilt exactly (its extra directions
    are zero), and a full-rank patch (rank = T) stays exact in float64."""
    torch.manual_seed(3)
    tokens, features = 10, 24
    low = torch.randn(2, tokens, 3, dtype=torch.float64) @ torch.randn(2, 3, features, dtype=torch.float64)
    us, vt = _top_factors(low, 6, torch.float64)
    assert torch.isfinite(us).all() and (torch.bmm(us, vt) - low).abs().max().item() <= 1e-10
    full = torch.randn(2, tokens, features, dtype=torch.float64)
    us, vt = _top_factors(full, tokens, torch.float64)
    assert (torch.bmm(us, vt) - full).abs().max().item() <= 1e-10
    us, vt = _top_factors(full, tokens - 1, torch.float64)  # one below full rank: the (T, T) route, the best rank T-1
    s = torch.linalg.svdvals(full)
    err = torch.linalg.matrix_norm(torch.bmm(us, vt) - full, ord=2)
    assert torch.allclose(err, s[:, -1], rtol=1e-8)


def test_deep_only_patch_touches_only_its_layers() -> None:
    engine = tiny_engine("qwen2")
    _, _, _, _, cond_b, can_b, start_b = _setup(engine, seed=20)
    patch = engine.form_patch(cond_b, can_b, rank=4, layers=engine.deep_layers(0.5))
    assert patch.layers == (1,)
    served = engine.apply(can_b, patch, start_b)
    blind = engine.apply(can_b, None, start_b)
    assert torch.equal(served.keys[0], blind.keys[0]) and torch.equal(served.values[0], blind.values[0])
    assert not torch.allclose(served.values[1], blind.values[1])


def test_patch_is_position_free() -> None:
    """The same patch serves any position: applying at p equals relocating the exact application."""
    engine = tiny_engine("llama")
    _, _, _, _, cond_b, can_b, start_b = _setup(engine, seed=30)
    patch = engine.form_patch(cond_b, can_b, rank=8)
    here = engine.apply(can_b, patch, start_b, exact=True)
    there = engine.apply(can_b, patch, 3000, exact=True)
    assert (engine.relocate(here, 3000).keys - there.keys).abs().max().item() <= 1e-5
    assert torch.equal(here.values, there.values)


def test_orbit_patch_averages_orderings() -> None:
    engine = tiny_engine("mistral")
    a1, a2, b = random_ids(10, 40), random_ids(10, 41), random_ids(12, 42)
    can_b = engine.canonical(b)
    conds = []
    for order in ([a1, a2], [a2, a1]):
        ids = ANCHOR + order[0] + order[1] + b
        conds.append(engine.forward(ids, None, 0, logits="none").kv.to("cpu").slice(len(ids) - len(b), len(ids)))
    orbit = engine.form_patch(conds, can_b, rank=12)
    one = engine.form_patch(conds[0], can_b, rank=12)
    mean_v = (conds[0].values + conds[1].values) / 2
    served = engine.apply(can_b, orbit, 100)
    assert (served.values - mean_v).abs().max().item() <= 1e-4
    assert not torch.allclose(orbit.v_u, one.v_u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_conditioned_kv_gives_the_bits_of_the_float64_average(tiny: Engine, dtype: torch.dtype) -> None:
    """A single conditioned KV is subtracted in its own dtype; two copies of it take the float64 averaging
    path. The two must agree bit for bit (float64 rounds innocuously on the way back)."""
    _, _, _, _, cond_b, can_b, _ = _setup(tiny, seed=70)
    cond, can = cond_b.to(dtype=dtype), can_b.to(dtype=dtype)
    one = conditioning_delta(cond, can, tiny.rope)
    two = conditioning_delta([cond, cond], can, tiny.rope)
    assert one.keys.dtype == dtype and one.keys.abs().max() > 0
    assert torch.equal(one.keys, two.keys) and torch.equal(one.values, two.values)


def test_a_patch_is_formed_and_applied_beside_its_canonical(tiny: Engine) -> None:
    """A canonical is kept in host memory, a forward's KV on the model's device (a GPU under
    ``KAMERA_TEST_DEVICE=cuda``): the patch is formed where its canonical is, and one on another device is
    moved there to be applied or reconstructed."""
    _, _, _, _, cond_b, can_b, start_b = _setup(tiny, seed=80)
    assert can_b.keys.device.type == "cpu"
    patch = tiny.form_patch(cond_b.to(tiny.device), can_b, rank=8)
    assert torch.equal(patch.k_u, tiny.form_patch(cond_b, can_b, rank=8).k_u)
    assert patch.k_u.device == can_b.keys.device and patch.to("cpu") is patch
    moved = patch.to(tiny.device)
    assert torch.equal(tiny.apply(can_b, moved, start_b).keys, tiny.apply(can_b, patch, start_b).keys)
    assert torch.equal(tiny.reconstruct(can_b, moved).values, tiny.reconstruct(can_b, patch).values)


def test_patch_storage_round_trip_and_truncate() -> None:
    engine = tiny_engine("phi3")
    _, _, _, _, cond_b, can_b, _ = _setup(engine, seed=50)
    patch = engine.form_patch(cond_b, can_b, rank=8, dtype=torch.bfloat16)
    assert patch.k_u.dtype == torch.bfloat16 and patch.rank == 8
    back = Patch.from_tensors(patch.tensors())
    assert torch.equal(back.k_vt, patch.k_vt) and back.layers == patch.layers
    low = patch.truncate(2)
    assert low.rank == 2 and torch.equal(low.v_u, patch.v_u[..., :2])
    with pytest.raises(InvalidInputError, match="rank"):
        patch.truncate(9)


def test_malformed_operator_inputs_raise_clear_errors() -> None:
    engine = tiny_engine("llama")
    _, _, _, _, cond_b, can_b, _ = _setup(engine, seed=60)
    with pytest.raises(InvalidInputError, match="rank"):
        engine.form_patch(cond_b, can_b, rank=0)
    with pytest.raises(InvalidInputError, match="tokens"):
        engine.form_patch(cond_b.slice(0, 3), can_b, rank=2)
    with pytest.raises(InvalidInputError, match="position-free"):
        engine.apply(cond_b, None, 0)
    with pytest.raises(InvalidInputError, match="layers"):
        engine.form_patch(cond_b, can_b, rank=2, layers=[7])
    with pytest.raises(InvalidInputError, match=r"\(L, T, H, D\)"):
        KV(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(InvalidInputError, match="at least one token"):
        engine.canonical([])
