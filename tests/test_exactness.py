"""A cut, resumed, forked, batched, preempted or crash-replayed run equals the uncut one, token for token.

These runs are long (200 tokens with end-of-generation banned) over several prompts, so
somewhere in them two logits sit close enough for a last-bit difference to flip greedy's
choice: a path that computes a token differently from a lone uncut lane shows up here. The
references are computed one at a time on fresh sessions (a cold prefill of the prompt, then
one decode step per token); every other path must reproduce them exactly, on the machine
the suite runs on (text may differ from CPU to CPU; the equality may not).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import TEMPLATES, DaemonProcess, forced, generated_tokens, metric, new_session, say

from superfluid.client import SocketClient
from superfluid.engine.build import exactness_problems, fast_build_exact, system_info
from superfluid.protocol.schema import EventBody, GenParams, Request, Response

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import exactness  # bench/exactness.py: the path-by-path logits probe
from random_model import IQ_TYPES, Shape, random_model  # bench/random_model.py: models of every weight type

pytestmark = pytest.mark.e2e

PROMPTS = exactness.PROMPTS
TOKENS = 200
GREEDY = GenParams(0.0, 1.0, 0.0, 0, 0)
SAMPLED = GenParams(0.8, 0.95, 0.0, 40, 11)
# (prompt, params) pairs every path is checked on: four greedy runs and two sampled ones
RUNS = [(p, GREEDY) for p in PROMPTS] + [(p, SAMPLED) for p in PROMPTS[:2]]


def test_the_llama_cpp_library_is_built_for_exactness() -> None:
    problems = exactness_problems()
    assert not problems, (
        f"the loaded llama.cpp lets the batch shape change a token's logits: {problems}; "
        f"its build: {system_info()}. Rebuild it as the Makefile does: make clean test"
    )


# the library an exact worker runs here: the fast build on x86 and arm64, whose kernels our patches hold to one
# order; llama-cpp-python's own on other CPUs
EXACT_LIBRARY = "fast" if fast_build_exact() else "wheel"


def probe_exact_library(*flags: str) -> str:
    """bench/exactness.py as an exact worker runs: on its library (on the fast build with flash attention held
    to one order by the patched library), in a process of its own (a process loads one library): every path
    must print `same`."""
    probe = [sys.executable, str(Path(exactness.__file__)), "--library", EXACT_LIBRARY, *flags]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=600)
    if EXACT_LIBRARY == "fast":
        # llamafile's sgemm held to one order where it is compiled in (an arm64 build with SVE leaves it out)
        sgemm = "LLAMAFILE = 1" not in done.stdout or "BATCH_INVARIANT_SGEMM = 1" in done.stdout
        assert sgemm and "MATMUL_INT8 = 1" not in done.stdout, done.stdout + done.stderr
        assert "FA_ONE_ORDER = 1" in done.stdout and "attention: flash" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    paths = [line for line in done.stdout.splitlines() if line.split()[-1:] == ["same"]]
    assert len(paths) == len(exactness.PATHS), done.stdout
    return done.stdout


def test_every_engine_path_computes_bit_identical_logits_on_the_exact_workers_library() -> None:
    probe_exact_library("--tokens", "40")


def test_long_prompts_compute_exactly_on_the_exact_workers_library() -> None:
    # llama.cpp's flash attention takes a tiled kernel from 64 queries on and splits one query's keys across
    # threads from 512 keys on; the patched library holds every query to the tiled kernel's order
    probe_exact_library("--tokens", "12", "--context", "600", "--prompts", "2")


def test_llama_cpps_own_flash_attention_order_depends_on_the_batch() -> None:
    # what the patch is for, and proof that the probe above can fail: --kernels fast leaves the order to llama.cpp
    probe = [sys.executable, str(Path(exactness.__file__)), "--kernels", "fast", "--tokens", "4", "--context", "600"]
    done = subprocess.run([*probe, "--prompts", "1"], capture_output=True, text=True, timeout=600)
    assert "attention: flash" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 1, done.stdout + done.stderr
    assert "re-prefill" in done.stdout and " #" in done.stdout, done.stdout


@pytest.mark.parametrize("weights", ["q4_0", "q4_k", "q2_k", "q3_k", "q5_k", "q6_k", *IQ_TYPES, "q4_k_m"])
def test_repacked_and_tiled_weights_compute_exactly_on_the_exact_workers_library(tmp_path: Path, weights: str) -> None:
    # exact kernels repack Q4_0 and Q4_K weights on x86 (scripts/patches/repack-exact-types.patch): llama.cpp's
    # gemm takes the rows of a batch four at a time and its gemv the rest, so the two must quantize and sum alike
    # (for Q4_K, with scripts/patches/repack-q4_K-one-order.patch; without it the batched path differs at once).
    # The other K-quants and the IQ types stay plain and take llama.cpp's tiled kernels from eight rows on, its
    # one-row kernels below (scripts/patches/tiled-k-quants-one-order.patch has those sum in the tiled kernels'
    # order); Q4_K_M mixes repacked Q4_K and tiled Q6_K
    peers = TEMPLATES.resolve().parents[5]  # <peers>/src/llama_cpp_python-*/vendor/llama.cpp/models/templates
    model = random_model(peers, Shape(width=256, layers=2, ffn=512, kv_heads=2), tmp_path, weights=weights)
    printed = probe_exact_library("--tokens", "24", "--model", str(model))
    held = "on" if EXACT_LIBRARY == "fast" else "off"  # the wheel has neither, and its plain kernels ignore the batch
    assert f"repacked weights: {held}" in printed and f"tiled K-quant kernels: {held}" in printed


def test_every_engine_path_computes_bit_identical_logits_on_llama_cpp_pythons_library() -> None:
    # what --no-worker-process runs, in this process
    from superfluid.engine.llama import LlamaModel
    from superfluid.model.resolve import embedded_model

    found = exactness.probe_all(LlamaModel(embedded_model().path), list(PROMPTS[:2]), 48, threads=2)
    differing = [f"{d.path}: prompt {d.prompt} from reply position {d.first}" for d in found if d.first is not None]
    assert not differing, differing


def test_a_short_copy_moves_through_the_state_at_once_and_equals_a_stream_copy() -> None:
    import llama_cpp
    import numpy as np

    from superfluid.engine.interface import ContextShape
    from superfluid.engine.llama import LlamaContext, LlamaModel
    from superfluid.model.resolve import embedded_model

    model = LlamaModel(embedded_model().path)
    context = LlamaContext(model, ContextShape(4096, 3, 512, 2))
    prompt = model.tokenize("<|im_start|>user\nName three harbours.<|im_end|>\n<|im_start|>assistant\n", True)

    def last(seq: int) -> np.ndarray:
        one = np.ones(1, dtype=np.int32)
        return context.decode(one * prompt[-1], one * (len(prompt) - 1), one * seq, np.ones(1, dtype=np.int8))[0].copy()

    n = len(prompt) - 1
    context.decode(
        np.asarray(prompt[:-1], dtype=np.int32),
        np.arange(n, dtype=np.int32),
        np.zeros(n, dtype=np.int32),
        np.zeros(n, dtype=np.int8),
    )
    context.copy(0, 1, n)
    assert not context.copy_pending, "a short source is copied at once, through its state"
    assert context.length(1) == n
    llama_cpp.llama_memory_seq_cp(llama_cpp.llama_get_memory(context._ctx), 0, 2, -1, -1)  # a stream copy
    assert np.array_equal(last(1), last(2)), "the state copy and the stream copy decode to different logits"


def test_a_batch_aborted_in_its_second_micro_batch_leaves_nothing_of_itself_in_the_kv() -> None:
    import ctypes

    import llama_cpp
    import numpy as np

    from superfluid.engine.interface import ContextShape, StepInterrupted
    from superfluid.engine.llama import LlamaContext, LlamaModel
    from superfluid.model.resolve import embedded_model

    context = LlamaContext(LlamaModel(embedded_model().path), ContextShape(512, 2, 512, 2))
    # sequence 0 brings 8 tokens, sequence 1 brings 4: llama.cpp decodes 4 of each, then sequence 0's last 4
    tokens = np.asarray([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], dtype=np.int32)
    positions = np.asarray([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3], dtype=np.int32)
    seqs = np.asarray([0] * 8 + [1] * 4, dtype=np.int32)
    want = np.asarray([0] * 7 + [1] + [0] * 3 + [1], dtype=np.int8)
    asked = [0]
    abort_at = [0]  # 0: never

    def count(_data: ctypes.c_void_p) -> bool:  # llama.cpp asks after every operation
        asked[0] += 1
        return bool(abort_at[0]) and asked[0] >= abort_at[0]

    callback = llama_cpp.ggml_abort_callback(count)
    llama_cpp.llama_set_abort_callback(context._ctx, callback, None)
    whole = context.decode(tokens, positions, seqs, want).copy()
    llama_cpp.llama_memory_clear(context._mem, True)
    abort_at[0], asked[0] = asked[0] * 3 // 4, 0  # within the second micro-batch
    with pytest.raises(StepInterrupted):
        context.decode(tokens, positions, seqs, want)
    assert (context.length(0), context.length(1)) == (0, 0), "the first micro-batch's positions stayed in the KV"
    abort_at[0] = 0
    assert np.array_equal(context.decode(tokens, positions, seqs, want), whole), "the batch ran again differs"


def _same(got: list[int], expected: list[int], what: str) -> None:
    if got != expected:
        at = next(
            (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected))
        )
        pytest.fail(f"{what}: differs from the uncut run at token {at} of {len(expected)}")


def _fresh(client: SocketClient, prompt: str, params: GenParams) -> int:
    session = new_session(client, params)
    say(client, session, prompt)
    return session


def _together(daemon: DaemonProcess, jobs: list[Callable[[SocketClient], Any]]) -> list[Any]:
    """Run each job on its own connection, all at once; their results in order."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(index: int, job: Callable[[SocketClient], Any]) -> None:
        try:
            with daemon.client() as client:
                results[index] = job(client)
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    if errors:
        raise errors[0]
    return results


def _tokens(client: SocketClient, session: int, n: int) -> list[int]:
    return generated_tokens(forced(client, session, n)[0])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path_factory.mktemp("exact"), max_context=2048, max_batch=8).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def references(daemon: DaemonProcess) -> dict[tuple[str, GenParams], list[int]]:
    """Each run alone on a fresh session, one after another."""
    with daemon.client() as client:
        return {(p, params): _tokens(client, _fresh(client, p, params), TOKENS) for p, params in RUNS}


def test_cut_by_max_tokens_and_continued(daemon: DaemonProcess, references: dict) -> None:
    def cut(prompt: str, params: GenParams) -> Callable[[SocketClient], list[int]]:
        def job(c: SocketClient) -> list[int]:
            session = _fresh(c, prompt, params)
            return _tokens(c, session, 70) + _tokens(c, session, TOKENS - 70)

        return job

    for (prompt, params), got in zip(RUNS, _together(daemon, [cut(*run) for run in RUNS]), strict=True):
        _same(got, references[(prompt, params)], f"cut at 70 and continued ({prompt!r}, T={params.temperature})")


def test_cancelled_and_continued(daemon: DaemonProcess, references: dict) -> None:
    def cancelled(prompt: str, params: GenParams) -> Callable[[SocketClient], list[int]]:
        def job(c: SocketClient) -> list[int]:
            session = _fresh(c, prompt, params)
            c.send(Request.Generate(session, TOKENS, True))
            replies = [c.receive()]
            while len(generated_tokens([r.event for r in replies if isinstance(r, Response.Delta)])) < 40:
                replies.append(c.receive())
            with daemon.client() as other:
                assert other.call(Request.Cancel(session)) == Response.Cancelling()
            while isinstance(replies[-1], Response.Delta):
                replies.append(c.receive())
            first = generated_tokens([r.event for r in replies if isinstance(r, Response.Delta)])
            return first + _tokens(c, session, TOKENS - len(first))

        return job

    for (prompt, params), got in zip(RUNS, _together(daemon, [cancelled(*run) for run in RUNS]), strict=True):
        _same(got, references[(prompt, params)], f"cancelled and continued ({prompt!r}, T={params.temperature})")


def test_two_forks_at_the_same_event(daemon: DaemonProcess, references: dict) -> None:
    with daemon.client() as c:
        parents = [_fresh(c, prompt, params) for prompt, params in RUNS]
        for parent in parents:
            forced(c, parent, 8)  # the parent's slot now holds the prompt and more: forks start warm

    def fork(parent: int, split: int | None) -> Callable[[SocketClient], list[int]]:
        def job(c: SocketClient) -> list[int]:
            child = c.call(Request.Fork(parent, 2, None)).session
            if split is None:
                return _tokens(c, child, TOKENS)
            return _tokens(c, child, split) + _tokens(c, child, TOKENS - split)

        return job

    jobs = [fork(parent, split) for parent in parents for split in (None, 90)]
    results = _together(daemon, jobs)
    for i, (prompt, params) in enumerate(RUNS):
        expected = references[(prompt, params)]
        _same(results[2 * i], expected, f"a fork generating at once ({prompt!r}, T={params.temperature})")
        _same(results[2 * i + 1], expected, f"a fork cut at 90 ({prompt!r}, T={params.temperature})")


def test_batched_with_seven_others(daemon: DaemonProcess, references: dict) -> None:
    others = [("Describe the ocean floor.", GREEDY), ("Explain how clocks work.", SAMPLED)]
    jobs = [lambda c, r=run: _tokens(c, _fresh(c, *r), TOKENS) for run in RUNS + others]
    results = _together(daemon, jobs)
    for (prompt, params), got in zip(RUNS, results, strict=False):
        _same(got, references[(prompt, params)], f"eight lanes in one batch ({prompt!r}, T={params.temperature})")


def test_sigkill_and_restart_mid_generation(tmp_path: Path, references: dict) -> None:
    proc = DaemonProcess(tmp_path, max_context=2048, max_batch=8).start()
    try:
        with proc.client() as c:
            sessions = [_fresh(c, prompt, params) for prompt, params in RUNS]
        seen = threading.Event()

        def until_killed(session: int) -> Callable[[SocketClient], None]:
            def job(c: SocketClient) -> None:
                c.send(Request.Generate(session, TOKENS, True))
                try:
                    while isinstance(c.receive(), Response.Delta):
                        seen.set()
                except ConnectionError:
                    pass  # the kill

            return job

        def kill_a_while_after_the_first_token() -> None:
            seen.wait(120)
            time.sleep(1.5)
            proc.kill()

        killer = threading.Thread(target=kill_a_while_after_the_first_token)
        killer.start()
        _together(proc, [until_killed(s) for s in sessions])
        killer.join()
        proc.start()
        with proc.client() as c:
            for session, (prompt, params) in zip(sessions, RUNS, strict=True):
                events = c.call(Request.Read(session, 0)).events
                before = generated_tokens([e for e in events if isinstance(e.body, EventBody.Generated)])
                assert 0 < len(before) < TOKENS, "the kill came mid-generation"
                got = before + _tokens(c, session, TOKENS - len(before))
                _same(got, references[(prompt, params)], f"killed after {len(before)} tokens and resumed ({prompt!r})")
    finally:
        proc.stop()


def test_preempted_by_an_interactive_chat_and_resumed(tmp_path: Path, references: dict) -> None:
    proc = DaemonProcess(tmp_path, max_context=2048, max_batch=2).start()
    try:
        runs = RUNS[:2]
        started = threading.Barrier(len(runs) + 1)

        def background(prompt: str, params: GenParams) -> Callable[[SocketClient], list[int]]:
            def job(c: SocketClient) -> list[int]:
                session = _fresh(c, prompt, params)
                c.call(Request.SetQos(session, 3, False))
                c.send(Request.Generate(session, TOKENS, True))
                replies = [c.receive()]
                started.wait(60)
                while isinstance(replies[-1], Response.Delta):
                    replies.append(c.receive())
                return generated_tokens([r.event for r in replies if isinstance(r, Response.Delta)])

            return job

        def chat(c: SocketClient) -> None:
            started.wait(60)
            session = _fresh(c, "Hi! Who are you?", GREEDY)
            c.call(Request.SetQos(session, 0, False))
            forced(c, session, 24)

        *results, _ = _together(proc, [background(*run) for run in runs] + [chat])
        with proc.client() as c:
            assert metric(c, "superfluid_preemptions_total") >= 1, "the chat took a lane"
        for (prompt, params), got in zip(runs, results, strict=True):
            _same(got, references[(prompt, params)], f"preempted and resumed ({prompt!r})")
    finally:
        proc.stop()


def test_a_prefix_restored_from_host_memory(tmp_path: Path, references: dict) -> None:
    proc = DaemonProcess(tmp_path, max_context=2048, max_batch=1).start()  # five KV slots in all
    try:
        with proc.client() as c:
            prompt, params = RUNS[1]
            session = _fresh(c, prompt, params)
            first = _tokens(c, session, 80)
            for i in range(6):  # other sessions take every slot: the entry moves to host memory
                forced(c, _fresh(c, f"Count the boats in harbour {i}.", GREEDY), 4)
            assert metric(c, "superfluid_cache_exports_total") >= 1
            imports = metric(c, "superfluid_cache_imports_total")
            got = first + _tokens(c, session, TOKENS - 80)
            assert metric(c, "superfluid_cache_imports_total") == imports + 1, "it came back from host memory"
        _same(got, references[(prompt, params)], "continued from a prefix imported from host memory")
    finally:
        proc.stop()


def test_a_run_of_draws_in_one_engine_call_equals_one_call_per_token() -> None:
    import llama_cpp
    import numpy as np

    from superfluid.engine.interface import ContextShape, Draw, Step
    from superfluid.engine.llama import LlamaContext, LlamaModel
    from superfluid.engine.local import LocalEngine
    from superfluid.model.resolve import embedded_model

    model = LlamaModel(embedded_model().path)
    engine = LocalEngine(LlamaContext(model, ContextShape(512, 2, 512, 2)))
    prompts = [model.tokenize(p, True) for p in PROMPTS[:2]]

    def generate(run: int, count: int) -> list[list[int]]:
        llama_cpp.llama_memory_clear(engine.context._mem, True)
        # both prompts in one batch, then their tokens: both lanes run alike, so every batch has both
        tokens = np.concatenate([np.asarray(p, dtype=np.int32) for p in prompts])
        positions = np.concatenate([np.arange(len(p), dtype=np.int32) for p in prompts])
        seqs = np.concatenate([np.full(len(p), seq, dtype=np.int32) for seq, p in enumerate(prompts)])
        want = np.zeros(len(tokens), dtype=np.int8)
        want[len(prompts[0]) - 1] = want[-1] = 1
        draws = [Draw(GREEDY, len(p), True, run=run) for p in prompts]
        out = engine.step(Step(tokens, positions, seqs, want, draws))
        while len(out[0]) < count:
            last = np.asarray([o[-1] for o in out], dtype=np.int32)
            at = np.asarray([len(p) + len(o) - 1 for p, o in zip(prompts, out, strict=True)], dtype=np.int32)
            draws = [Draw(GREEDY, int(a) + 1, True, run=min(run, count - len(out[0]))) for a in at]
            more = engine.step(Step(last, at, np.arange(2, dtype=np.int32), np.ones(2, dtype=np.int8), draws))
            out = [o + m for o, m in zip(out, more, strict=True)]
        return out

    single = generate(1, 41)
    runs = generate(5, 41)
    assert all(len(o) == 41 for o in runs), [len(o) for o in runs]
    assert runs == single
