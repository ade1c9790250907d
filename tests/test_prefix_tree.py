"""The prefix tree answers what comparing a query with every held token list would."""

from __future__ import annotations

import random

import numpy as np

from superfluid.scheduler.prefix_tree import PrefixTree, common_prefix


def brute_longest(held: dict[int, np.ndarray], query: np.ndarray, limit: int) -> int:
    return max((min(common_prefix(query, tokens), limit) for tokens in held.values()), default=0)


def brute_prefixes(held: dict[int, np.ndarray], query: np.ndarray) -> set[int]:
    return {key for key, tokens in held.items() if common_prefix(query, tokens) == len(tokens)}


def token_list(rng: random.Random, stems: list[np.ndarray]) -> np.ndarray:
    """A stem cut somewhere and extended, so that lists share prefixes and part inside edges."""
    stem = rng.choice(stems)
    cut = rng.randint(0, len(stem))
    tail = np.array([rng.randint(0, 3) for _ in range(rng.randint(0, 6))], dtype=np.int32)
    return np.concatenate([stem[:cut], tail]).astype(np.int32)


def test_the_tree_agrees_with_comparing_every_held_list() -> None:
    rng = random.Random(7)
    stems = [np.array([rng.randint(0, 3) for _ in range(12)], dtype=np.int32) for _ in range(4)]
    tree: PrefixTree[int] = PrefixTree()
    held: dict[int, np.ndarray] = {}
    for step in range(3000):
        roll = rng.random()
        if roll < 0.45 or not held:
            key = rng.randint(0, 40)  # keys come back: `add` replaces
            held[key] = token_list(rng, stems)
            tree.add(key, held[key])
        elif roll < 0.75:
            key = rng.choice(list(held))
            del held[key]
            tree.remove(key)
        query = token_list(rng, stems)
        limit = rng.randint(0, len(query) + 2)
        found = tree.longest(query, limit)
        best = brute_longest(held, query, limit)
        if best == 0:
            assert found is None, step
        else:
            assert found is not None, step
            key, length = found
            assert length == best, step
            assert min(common_prefix(query, held[key]), limit) == best, step
        assert set(tree.prefixes_of(query)) == brute_prefixes(held, query), step
        assert len(tree) == len(held)


def test_among_equal_matches_the_most_recently_added_wins() -> None:
    tree: PrefixTree[str] = PrefixTree()
    tree.add("old", np.array([1, 2, 3, 4], dtype=np.int32))
    tree.add("new", np.array([1, 2, 3, 5], dtype=np.int32))
    query = np.array([1, 2, 3, 9], dtype=np.int32)
    assert tree.longest(query, 10) == ("new", 3)
    tree.add("old", np.array([1, 2, 3, 4], dtype=np.int32))  # added again: now the newest
    assert tree.longest(query, 10) == ("old", 3)
    assert tree.longest(query, 2) == ("old", 2)
    tree.remove("old")
    tree.remove("new")
    assert tree.longest(query, 10) is None and len(tree) == 0
    tree.remove("gone")  # forgetting what is not held changes nothing
