"""The sampler: position-keyed draws, and the fast path against a plain reading of the rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superfluid.engine.sampling import BucketedRow, heaviest, sample, splitmix64, uniform, weights
from superfluid.protocol.schema import GenParams


def test_splitmix64_known_values() -> None:
    # SplitMix64 of state 0 advanced once, the first output of the reference generator
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(1) == 0x910A2DEC89025CC1
    assert 0.0 <= uniform(7, 100) < 1.0
    assert uniform(7, 100) == uniform(0, 107) == uniform(100, 7)


def test_greedy_takes_the_lowest_id_on_a_tie() -> None:
    logits = np.array([0.1, 3.0, 3.0, -1.0], dtype=np.float32)
    assert sample(logits, GenParams(0.0, 1.0, 0.0, 0, 0), 0) == 1


def cut_and_draw(w: np.ndarray, p: GenParams, position: int) -> tuple[int, float | None, float, float]:
    """What `sample` hands `BucketedRow.draw`: the top-k/min-p limit, the top-p mass, the row's mass and the draw."""
    total = float(w.sum(dtype=np.float64))
    limit = p.top_k if 0 < p.top_k < len(w) else len(w)
    if p.min_p > 0:
        limit = min(limit, int(np.count_nonzero(w >= np.float32(p.min_p))))
    top_p = p.top_p * total if 0 < p.top_p < 1 else None
    return limit, top_p, total, uniform(p.seed, position)


def reference(logits: np.ndarray, p: GenParams, position: int) -> int:
    """The rules read literally: sort everything, cut, draw."""
    if p.temperature <= 0:
        return int(np.argmax(logits))
    w = weights(logits, p.temperature).astype(np.float64)
    total = w.sum()
    order = sorted(range(len(w)), key=lambda i: (-w[i], i))
    keep = len(order)
    if 0 < p.top_k < len(order):
        keep = p.top_k
    if p.min_p > 0:
        keep = min(keep, sum(1 for i in order if w[i] >= np.float32(p.min_p)))
    if 0 < p.top_p < 1:
        mass = np.cumsum([w[i] for i in order[:keep]])
        reached = np.flatnonzero(mass >= p.top_p * total)
        if len(reached):
            keep = int(reached[0]) + 1
    kept = order[:keep]
    masses = np.cumsum([w[i] for i in kept])
    target = uniform(p.seed, position) * masses[-1]
    index = int(np.searchsorted(masses, target, side="right"))
    return kept[min(index, keep - 1)]


@settings(max_examples=300, deadline=None)
@given(
    vocab=st.integers(2, 5000),
    seed=st.integers(0, 2**64 - 1),
    position=st.integers(0, 10_000),
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
    top_p=st.sampled_from([0.0, 0.5, 0.9, 0.95, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.2]),
    top_k=st.sampled_from([0, 1, 5, 40, 100000]),
    ties=st.booleans(),
    spread=st.sampled_from([0.3, 3.0]),  # a flat row (top-p keeps most of it) and a peaked one
    data=st.data(),
)
def test_sampler_matches_the_literal_rules(
    vocab: int,
    seed: int,
    position: int,
    temperature: float,
    top_p: float,
    min_p: float,
    top_k: int,
    ties: bool,
    spread: float,
    data: st.DataObject,
) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = rng.normal(0, spread, vocab).astype(np.float32)
    if ties:
        logits = np.round(logits).astype(np.float32)  # many equal logits
    params = GenParams(temperature, top_p, min_p, top_k, seed)
    assert sample(logits, params, position) == reference(logits, params, position)


def test_the_same_seed_and_position_draw_the_same_token() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, 49152).astype(np.float32)
    params = GenParams(0.8, 0.95, 0.0, 40, 1234)
    first = [sample(logits, params, p) for p in range(50)]
    assert first == [sample(logits, params, p) for p in range(50)]
    assert len(set(first)) > 1  # the position changes the draw


def test_the_heaviest_tokens_of_a_peaked_row_are_those_a_full_sort_finds() -> None:
    # a model's row: a few likely tokens, a long tail, and ties where the 64th heaviest falls
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, 49152).astype(np.float32)
    logits[rng.choice(49152, 30, replace=False)] += 14
    logits[100:110] = np.sort(logits)[-64]
    w = weights(logits, 0.7)
    everything = sorted(range(len(w)), key=lambda i: (-w[i], i))
    for m in (1, 5, 40, 64, 512):
        assert heaviest(w, m).tolist() == everything[:m]


@pytest.mark.parametrize(
    ("spread", "params"),
    [
        (0.5, GenParams(0.7, 0.95, 0.0, 0, 11)),  # a random model's row: top-p keeps most of the vocabulary
        (0.5, GenParams(1.0, 1.0, 0.0, 0, 12)),  # no cut: the draw walks the whole row
        (1.0, GenParams(0.7, 0.9, 0.05, 0, 13)),  # min-p and top-p
        (1.0, GenParams(1.0, 0.95, 0.0, 5000, 14)),  # top-k far beyond the first look
        (2.0, GenParams(1.3, 1.0, 0.0, 20000, 15)),  # top-k alone
    ],
)
def test_a_flat_row_draws_from_its_buckets_what_the_literal_rules_draw(spread: float, params: GenParams) -> None:
    rng = np.random.default_rng(int(spread * 10) + params.seed)
    logits = rng.normal(0, spread, 49152).astype(np.float32)
    logits[rng.choice(49152, 2000, replace=False)] = np.round(logits[:2000], 1)  # ties inside buckets
    w = weights(logits, params.temperature)
    for position in range(4):
        drawn = BucketedRow(w).draw(*cut_and_draw(w, params, position))
        assert drawn is not None  # every weight it sums is heavy enough to be summed exactly
        assert drawn == sample(logits, params, position) == reference(logits, params, position)


def test_a_cut_among_weights_too_light_to_sum_exactly_sorts_the_row() -> None:
    # one likely token and a tail 20 below it: top-p reaches into weights of e**-20, whose sums round
    rng = np.random.default_rng(5)
    logits = (rng.normal(0, 1, 49152) - 20).astype(np.float32)
    logits[7] = 0.0
    params = GenParams(1.0, 0.9999999, 0.0, 0, 21)
    w = weights(logits, params.temperature)
    assert BucketedRow(w).draw(*cut_and_draw(w, params, 0)) is None
    assert [sample(logits, params, p) for p in range(3)] == [reference(logits, params, p) for p in range(3)]
