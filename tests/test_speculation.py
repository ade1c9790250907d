"""Speculative decoding on the real model: drafts verified in the batch change no token.

A daemon with `--speculate prompt-lookup` and one without answer the same requests; on the
suite's exact kernels every greedy run, forced-length runs included, and every same-seed
sampled run gives the same tokens on both, and so does a generation cut and continued. A
grammar that repeats one sentence makes drafts that must be taken, on any machine: the drafting
daemon drafts wherever the lookup finds a match (`--no-spec-adaptive`), since whether an adaptive
draft pays depends on what a decode of several positions costs on the machine at that moment
(the scheduler tests cover that choice with the fake engine).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from conftest import GREEDY, HttpDaemon, forced, generated_tokens, new_session, say

from superfluid.protocol.schema import GenParams

pytestmark = pytest.mark.e2e

MODULE = "\n".join(
    f"def step_{i}(value, factor):\n    result = value * factor + {i}\n    return result\n" for i in range(10)
)
PROMPTS = [
    *(f"Rewrite this Python module with type hints:\n{MODULE[: 120 * (1 + i)]}" for i in range(8)),
    *(f"Repeat this list exactly: {', '.join(str(n) for n in range(i, i + 30))}" for i in range(6)),
    "Tell me about lighthouses.",
    "What is the capital of France?",
    "Write a haiku about rivers.",
    "Explain how a bicycle works.",
    "List five colours.",
    "Describe a storm at sea.",
]
TOKENS = 48
SAMPLED = GenParams(0.8, 0.95, 0.0, 40, 7)
SENTENCE = "The cat sat on the mat. "


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    proc = HttpDaemon(tmp_path_factory.mktemp("plain"), "--speculate", "off", max_context=2048, max_batch=4).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def drafting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    proc = HttpDaemon(
        tmp_path_factory.mktemp("drafting"),
        "--speculate",
        "prompt-lookup",
        "--no-spec-adaptive",
        max_context=2048,
        max_batch=4,
    ).start()
    yield proc
    proc.stop()


def replies(daemon: HttpDaemon, prompts: list[str], params: GenParams, tokens: int) -> list[list[int]]:
    """Each prompt's forced reply, four at a time (batched together)."""
    out: dict[int, list[int]] = {}

    def one(i: int) -> None:
        with daemon.client() as c:
            session = new_session(c, params)
            say(c, session, prompts[i])
            out[i] = generated_tokens(forced(c, session, tokens)[0])

    for start in range(0, len(prompts), 4):
        threads = [threading.Thread(target=one, args=(i,)) for i in range(start, min(start + 4, len(prompts)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return [out[i] for i in range(len(prompts))]


def test_greedy_runs_are_the_same_with_drafts_and_without(plain: HttpDaemon, drafting: HttpDaemon) -> None:
    before = drafting.metric("superfluid_spec_proposed_total")
    assert replies(drafting, PROMPTS, GREEDY, TOKENS) == replies(plain, PROMPTS, GREEDY, TOKENS)
    assert drafting.metric("superfluid_spec_proposed_total") > before, "the rewrites were drafted"
    assert plain.metric("superfluid_spec_proposed_total") == 0


def test_sampled_runs_with_a_seed_are_the_same_with_drafts_and_without(plain: HttpDaemon, drafting: HttpDaemon) -> None:
    prompts = PROMPTS[:2] + PROMPTS[8:10]
    assert replies(drafting, prompts, SAMPLED, TOKENS) == replies(plain, prompts, SAMPLED, TOKENS)


def test_a_cut_generation_continues_as_the_uncut_one(plain: HttpDaemon, drafting: HttpDaemon) -> None:
    uncut = replies(plain, PROMPTS[:1], GREEDY, TOKENS)[0]
    with drafting.client() as c:
        session = new_session(c)
        say(c, session, PROMPTS[0])
        first = generated_tokens(forced(c, session, 20)[0])
        rest = generated_tokens(forced(c, session, TOKENS - 20)[0])
    assert first + rest == uncut


def test_a_repeating_constraint_has_its_drafts_taken(plain: HttpDaemon, drafting: HttpDaemon) -> None:
    """A schema whose only value repeats one sentence: the second sentence on is drafted and taken."""

    def constrained(daemon: HttpDaemon) -> dict:
        schema = {"type": "object", "properties": {"said": {"type": "string", "enum": [SENTENCE * 6]}}}
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Say the sentence about the cat six times."}],
            "max_tokens": 200,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "said", "schema": schema}},
        }
        reply = httpx.post(f"{daemon.url}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()

    with_drafts, without = constrained(drafting), constrained(plain)
    text = with_drafts["choices"][0]["message"]["content"]
    assert text == without["choices"][0]["message"]["content"]
    assert json.loads(text) == {"said": SENTENCE * 6}
    spec = with_drafts["superfluid"]["spec"]
    assert spec["accepted"] > 0, spec
    assert "spec" not in without["superfluid"]


def test_http_replies_report_their_drafts(drafting: HttpDaemon) -> None:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": PROMPTS[8]}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    reply = httpx.post(f"{drafting.url}/v1/chat/completions", json=body, timeout=120).json()
    spec = reply["superfluid"]["spec"]
    assert spec["proposed"] > 0 and 0 <= spec["accepted"] <= spec["proposed"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["proposed"], abs=1e-4)


def test_a_draft_never_outruns_max_tokens(drafting: HttpDaemon) -> None:
    with drafting.client() as c:
        session = new_session(c)
        say(c, session, PROMPTS[9])
        for tokens in (1, 2, 3, 5):
            assert len(generated_tokens(forced(c, session, tokens)[0])) == tokens
