"""Many agents on one engine, in one process, with asyncio: every agent's answers decode in shared steps.

Each agent holds its own window and runs the loop an agent runs: a tool result arrives as a page, the agent
asks a question about it, and once three pages are held the oldest slides out. All agents run at once as
coroutines under ``engine.batching()``: their pages, prompts and decode steps go through one scheduler,
whose every step reads the model's weights once for all of them. The same agents then run one at a time
(the same calls, no batching) for comparison; the answers are the same both ways.

    python examples/many_agents.py                 # 8 agents, 6 rounds
    python examples/many_agents.py --agents 32
    python examples/many_agents.py --short         # 2 agents, 2 rounds (CI)
"""

from __future__ import annotations

import asyncio
import time

from _common import arg_parser, load_engine

from kamera_sdk import ContextWindow, Engine, to_thread

WORDS = "river stone lamp orchard violin harbor ledger copper meadow lantern".split()


def page(agent: int, step: int) -> str:
    """Tool result ``step`` of agent ``agent`` (about 56 tokens)."""
    words = [WORDS[(agent * 7 + step * 3 + k) % len(WORDS)] for k in range(40)]
    return f"Report {step} of agent {agent}: the {words[0]} is at number {agent * 13 + step}. " + " ".join(words)


def question(agent: int, step: int) -> str:
    return f"In one sentence, what does report {step} say is at number {agent * 13 + step}?"


async def agent_async(engine: Engine, agent: int, rounds: int, max_new_tokens: int) -> list[tuple[str, int]]:
    """The agent's loop as a coroutine: window calls on window threads (their forwards join the shared steps),
    answers awaited. Each answer with the tokens it decoded."""
    window = ContextWindow(engine)
    answers = []
    for step in range(rounds):
        await to_thread(window.add_text, page(agent, step))
        stream = await window.agenerate(question(agent, step), max_new_tokens, stream=True)
        answers.append((await stream.text(), stream.tokens))
        if len(window.chunks) >= 3:
            await to_thread(window.slide, 1)
    return answers


def agent_sync(engine: Engine, agent: int, rounds: int, max_new_tokens: int) -> list[tuple[str, int]]:
    """The same loop, plain calls."""
    window = ContextWindow(engine)
    answers = []
    for step in range(rounds):
        window.add_text(page(agent, step))
        stream = window.generate(question(agent, step), max_new_tokens, stream=True)
        answers.append(("".join(stream), stream.tokens))
        if len(window.chunks) >= 3:
            window.slide(1)
    return answers


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--agents", type=int, default=8, help="agents on the engine at once (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=6, help="pages per agent (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="answer cap (default: %(default)s)")
    args = parser.parse_args()
    if args.short:
        args.agents, args.rounds, args.max_new_tokens = 2, 2, 16
    engine = load_engine(args.device)
    agent_sync(engine, 0, 1, 4)  # warm-up: the anchor's KV, the first forwards

    async def everyone() -> list[list[tuple[str, int]]]:
        return await asyncio.gather(
            *(agent_async(engine, i, args.rounds, args.max_new_tokens) for i in range(args.agents))
        )

    t0 = time.perf_counter()
    with engine.batching() as scheduler:
        together = asyncio.run(everyone())
    together_s = time.perf_counter() - t0
    stats = scheduler.stats()

    t0 = time.perf_counter()
    alone = [agent_sync(engine, i, args.rounds, args.max_new_tokens) for i in range(args.agents)]
    alone_s = time.perf_counter() - t0

    n = sum(t for answers in alone for _, t in answers)
    same = sum(a == b for x, y in zip(together, alone, strict=True) for a, b in zip(x, y, strict=True))
    print(f"{args.agents} agents x {args.rounds} rounds, answers up to {args.max_new_tokens} tokens ({n} decoded)")
    print(f"  at once, batched:  {together_s:6.1f} s  {n / together_s:6.1f} tokens/s")
    print(f"  one at a time:     {alone_s:6.1f} s  {n / alone_s:6.1f} tokens/s")
    print(f"  batched / one at a time: {alone_s / together_s:.2f}x")
    print(
        f"  steps: {stats.steps}, rows per step {stats.batch_mean:.1f} on average (at most {stats.batch_max}); "
        f"window forwards in shared steps: {stats.carried}"
    )
    print(f"  answers identical both ways: {same} of {args.agents * args.rounds}")
    saved = 1 - together_s / alone_s
    if saved > 0:
        print(f"Kamera saved {saved:.0%} of the wall time by batching the agents")
    else:  # few agents: a step's bookkeeping for nothing to share
        print(f"Kamera saved no wall time here: batched took {-saved:.0%} longer")


if __name__ == "__main__":
    main()
