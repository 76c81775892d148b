"""Eight concurrent client sessions: no errors, no session sees another's chunks; a req/s and p95 report."""

from __future__ import annotations

import asyncio
import sys

import pytest

from kamera_sdk import ChunkNotFoundError
from kamera_sdk.server import AsyncRemoteWindow
from kamera_sdk.server.loadgen import run_load
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.slow

SESSIONS = 8


def test_eight_threaded_sessions(live: LiveServer) -> None:
    report = run_load(live.url, sessions=SESSIONS, requests_per_session=2, max_new_tokens=4, api_key=live.api_key)
    sys.stderr.write(
        f"\n{SESSIONS} sessions: {report.requests_per_s:.2f} req/s, p50 {report.latency_p50_s:.3f} s, "
        f"p95 {report.latency_p95_s:.3f} s (max_new_tokens=4)\n"
    )
    assert report.errors == [] and report.isolation_violations == []
    assert report.requests == SESSIONS * 2


def test_eight_async_sessions_streaming(live: LiveServer) -> None:
    async def one(i: int) -> tuple[str, list[str], list[str], str]:
        win = AsyncRemoteWindow(live.url, api_key=live.api_key)
        await win.open()
        mine = [await win.add_text(f"Agent {i} found {i + 2} bugs in module m{i}.")]
        mine.append(await win.add_text(f"Agent {i} works on branch b{i}."))
        text = "".join([p async for p in await win.generate(f"How many bugs did agent {i} find?", 4, stream=True)])
        return win.id or "", mine, await win.chunks(), text

    async def main() -> None:
        results = await asyncio.gather(*(one(i) for i in range(SESSIONS)))
        assert len({sid for sid, *_ in results}) == SESSIONS
        for _, mine, seen, text in results:
            assert seen == mine and isinstance(text, str)
        # every session refuses every other session's chunk ids
        for i, (sid, _, _, _) in enumerate(results):
            async with AsyncRemoteWindow(live.url, api_key=live.api_key, session_id=sid) as win:
                for j, (_, theirs, _, _) in enumerate(results):
                    if i != j:
                        with pytest.raises(ChunkNotFoundError):
                            await win.evict(theirs[0])
                assert await win.chunks() == results[i][1]
                await win.delete()

    asyncio.run(main())
