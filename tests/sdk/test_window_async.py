"""Many windows at once from asyncio: ``ContextWindow.agenerate`` under ``Engine.batching()`` decodes every
window's answer in the engine's shared steps, and each answer is the window's own ``generate`` alone; a
cancelled or closed answer leaves the others as they were; the batching block finishes what it started and
then gives the engine back."""

from __future__ import annotations

import asyncio

import pytest

from kamera_engine import Engine, InvalidInputError
from kamera_engine.scheduler import Scheduler
from kamera_sdk import ContextWindow
from kamera_sdk.policies import POLICIES
from tests.conftest import char_engine, random_ids

POLICY_NAMES = sorted(POLICIES)
#: per window: greedy, temperature with a seed, top-p, stop strings (cycled)
SAMPLING = [
    dict(max_new_tokens=24),
    dict(max_new_tokens=20, temperature=0.9, seed=5),
    dict(max_new_tokens=22, temperature=1.1, top_p=0.8, seed=17),
    dict(max_new_tokens=26, stop=["k", "q"]),
]


@pytest.fixture
def engine() -> Engine:
    return char_engine()


def _window(engine: Engine, i: int, policy: str = "kamera") -> ContextWindow:
    w = ContextWindow(engine, policy=policy)
    for j in range(1 + i % 3):
        w.add(random_ids(4 + 3 * j + i, 100 + 10 * i + j))
    return w


def _prompt(i: int) -> list[int]:
    return random_ids(3 + i % 4, 300 + i)


def _alone(engine: Engine, i: int, policy: str = "kamera") -> str:
    return _window(engine, i, policy).generate(_prompt(i), **SAMPLING[i % len(SAMPLING)])


def test_windows_of_every_policy_answer_at_once_as_each_alone(engine: Engine) -> None:
    cases = list(enumerate(POLICY_NAMES))
    expected = [_alone(engine, i, p) for i, p in cases]
    windows = [_window(engine, i, p) for i, p in cases]

    async def answer_all() -> list[str]:
        return await asyncio.gather(
            *(w.agenerate(_prompt(i), **SAMPLING[i % len(SAMPLING)]) for (i, _), w in zip(cases, windows, strict=True))
        )

    with engine.batching() as sched:
        assert engine.scheduler is sched
        got = asyncio.run(answer_all())
    stats = sched.stats()
    assert got == expected
    assert stats.submitted == stats.finished == len(cases)  # every answer decoded in the scheduler's steps
    assert stats.batch_max >= 2  # and they shared steps
    assert stats.follow_ons >= 1  # an answer queued by its prompt's forward's step decoded as alone too
    assert engine.scheduler is None


def test_without_batching_agenerate_is_generate_on_worker_threads(engine: Engine) -> None:
    expected = [_alone(engine, i) for i in range(4)]
    windows = [_window(engine, i) for i in range(4)]

    async def answer_all() -> list[str]:
        return await asyncio.gather(*(w.agenerate(_prompt(i), **SAMPLING[i]) for i, w in enumerate(windows)))

    assert asyncio.run(answer_all()) == expected


LONG = dict(max_new_tokens=2000)  # greedy, no stop: still decoding when the test withdraws it


def test_a_closed_stream_leaves_the_others_as_alone(engine: Engine) -> None:
    expected = [_alone(engine, i) for i in range(3)]
    long_alone = _window(engine, 1).generate(_prompt(1), **LONG)
    windows = [_window(engine, i) for i in range(3)]

    async def run() -> tuple[list[str], str]:
        streams = [
            await w.agenerate(_prompt(i), stream=True, **(LONG if i == 1 else SAMPLING[i]))
            for i, w in enumerate(windows)
        ]
        first = await streams[1].__anext__()
        await streams[1].aclose()  # a client that stopped reading
        return [await streams[i].text() for i in (0, 2)], first

    with engine.batching() as sched:
        texts, first = asyncio.run(run())
    assert texts == [expected[0], expected[2]]
    assert first and long_alone.startswith(first)
    stats = sched.stats()
    assert (stats.cancelled, stats.finished, stats.running, stats.waiting) == (1, 2, 0, 0)


def test_a_cancelled_call_withdraws_its_answer_and_leaves_the_others_as_alone(engine: Engine) -> None:
    expected = _alone(engine, 0)
    windows = [_window(engine, i) for i in range(2)]

    async def run(sched: Scheduler) -> str:
        doomed = asyncio.ensure_future(windows[1].agenerate(_prompt(1), **LONG))
        while sched.stats().submitted < 1:  # its window work is done and its answer decodes
            await asyncio.sleep(0.005)
        other = asyncio.ensure_future(windows[0].agenerate(_prompt(0), **SAMPLING[0]))
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return await other

    with engine.batching() as sched:
        assert asyncio.run(run(sched)) == expected
    stats = sched.stats()
    assert (stats.cancelled, stats.finished, stats.running, stats.waiting) == (1, 1, 0, 0)


def test_leaving_the_block_finishes_answers_in_progress_then_the_engine_runs_unbatched(engine: Engine) -> None:
    expected = _alone(engine, 0)
    with engine.batching() as sched:
        stream = _window(engine, 0).generate(_prompt(0), stream=True, **SAMPLING[0])
    assert sched.stats().finished == 1  # decoded to its end before the block let go, nobody reading it
    assert "".join(stream) == expected
    assert engine.scheduler is None and engine.counters.forwards > 0
    assert _alone(engine, 0) == expected  # no scheduler any more: the single path


def test_a_block_that_raises_cancels_its_answers(engine: Engine) -> None:
    with pytest.raises(RuntimeError, match="agent failed"), engine.batching() as sched:
        stream = _window(engine, 1).generate(_prompt(1), stream=True, **LONG)
        raise RuntimeError("agent failed")
    assert sched.stats().cancelled == 1
    assert len("".join(stream)) < 2000 and engine.scheduler is None


def test_batching_twice_is_refused_and_leaves_the_first_on(engine: Engine) -> None:
    expected = _alone(engine, 2)
    with engine.batching() as sched:
        with pytest.raises(InvalidInputError, match="already batching"), engine.batching():
            pass
        # an engine over the same weights (another anchor, as a chat engine) shares the block, and is refused too
        other = Engine(engine.model, engine.tokenizer, name="tiny-llama", anchor_ids=[1, 2, 3])
        assert other.scheduler is sched
        with pytest.raises(InvalidInputError, match="already batching"), other.batching():
            pass
        assert engine.scheduler is sched
        assert _window(engine, 2).generate(_prompt(2), **SAMPLING[2]) == expected
        assert sched.stats().finished == 1


def test_without_batching_a_cancelled_read_raises_cancelled_and_the_stream_closes(engine: Engine) -> None:
    """No scheduler: tokens are decoded on worker threads. Cancelling a read while a token is being decoded
    raises ``CancelledError`` (the close waits for that token instead of failing on a running generator), and
    the window answers again as alone afterwards."""
    expected = _alone(engine, 0)
    window = _window(engine, 1)

    async def run() -> str:
        stream = await window.agenerate(_prompt(1), stream=True, **LONG)
        await stream.__anext__()
        reader = asyncio.ensure_future(stream.text())
        await asyncio.sleep(0.05)  # a token is being decoded on a worker thread now
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await stream.aclose()
        assert stream.tokens < 2000
        return await _window(engine, 0).agenerate(_prompt(0), **SAMPLING[0])

    assert asyncio.run(run()) == expected


def test_a_request_read_async_with_no_driver_steps_the_scheduler_itself(engine: Engine) -> None:
    from kamera_engine import SamplingParams

    sched = Scheduler(engine)  # never started: nobody drives it
    want = list(sched.submit(None, _prompt(0), 0, SamplingParams(max_new_tokens=12)))
    req = sched.submit(None, _prompt(0), 0, SamplingParams(max_new_tokens=12))

    async def read() -> list[int]:
        return [t async for t in req.aiter()]

    assert not req.driven and asyncio.run(read()) == want


def test_an_async_reader_goes_on_when_the_driver_stops(engine: Engine) -> None:
    """An async reader whose scheduler's driver stops mid-answer goes on stepping the scheduler itself, and gets
    the answer it would have had. (A stopping driver also wakes readers waiting on it, which closes a race between
    its last token and its stop that no test hits reliably.)"""
    from kamera_engine import SamplingParams

    sched = Scheduler(engine)
    want = list(sched.submit(None, _prompt(1), 0, SamplingParams(max_new_tokens=600)))
    req = sched.submit(None, _prompt(1), 0, SamplingParams(max_new_tokens=600))
    sched.start()

    async def read() -> list[int]:
        got = []
        async for token in req.aiter():
            got.append(token)
            if len(got) == 3:
                await asyncio.to_thread(sched.stop)  # mid-answer
        return got

    assert asyncio.run(asyncio.wait_for(read(), timeout=60)) == want
    assert not req.driven
