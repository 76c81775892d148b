"""``kamera demo``: a short agent session on the embedded default model.

A research agent reads pages about a small coastal region into a window of four, then the window
slides, gets reranked, looks back at an evicted page and forks. Each operation is run by three windows
side by side (``kamera``, ``recompute``, ``prefix``) so the cost and fidelity of each show directly.
"""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table

from kamera_engine import Engine

from .bench.corpus import load_corpus
from .bench.metrics import kl
from .console import err, out, write_json
from .window import ContextWindow

POLICIES = ("kamera", "recompute", "prefix")


def run_demo(engine: Engine, *, quick: bool = False, as_json: bool = False) -> int:
    corpus = load_corpus()
    demo = corpus.demo
    pages = [corpus.page(pid) for pid in demo.pages]
    questions = demo.questions
    wins = {p: ContextWindow(engine, policy=p) for p in POLICIES}
    ids: dict[str, dict[str, str]] = {p: {} for p in POLICIES}
    steps: list[dict[str, Any]] = []

    def say(text: str) -> None:
        if not as_json:
            out.print(text)

    def ask(label: str, q_index: int) -> None:
        q = questions[q_index % len(questions)]
        row: dict[str, Any] = {"step": label, "question": q.question, "expected": q.answer}
        lps = {}
        for p, win in wins.items():
            before = win.stats().tokens_prefilled
            t0 = time.perf_counter()
            lps[p] = win.next_token_logprobs(q.question)
            ttft = time.perf_counter() - t0
            answer = win.generate(q.question, max_new_tokens=12 if quick else 24, stop=["\n"]).strip()
            row[p] = {
                "ttft_s": ttft,
                "tokens_prefilled": win.stats().tokens_prefilled - before,
                "answer": answer,
                "plan": _describe(win),
            }
        for p in POLICIES:
            row[p]["kl_to_recompute"] = kl(lps["recompute"], lps[p])
        steps.append(row)
        k = row["kamera"]
        say(f"[bold]{label}[/]  Q: {q.question}")
        say(f"   kamera: {k['answer']!r}  ({k['tokens_prefilled']} tokens prefilled, {k['ttft_s']:.2f}s)")
        say(f"   recompute: {row['recompute']['answer']!r}  ({row['recompute']['tokens_prefilled']} tokens)")
        say(f"   plan: {_describe(wins['kamera'])}")

    with err.status("reading four pages into the window"):
        for page in pages[:4]:
            for p, win in wins.items():
                ids[p][page.id] = win.add_text(page.text + "\n\n")
    ask("1. read four pages", 0)

    with err.status("sliding the window"):
        for p, win in wins.items():
            win.slide(1)
            ids[p][pages[4].id] = win.add_text(pages[4].text + "\n\n")
    ask("2. slide: oldest page out, a new page in", 1)

    with err.status("reranking"):
        for _p, win in wins.items():
            order = win.chunks
            win.reorder([order[-1], *order[:-1]])
    ask("3. rerank: newest page first", 2)

    with err.status("looking back at an evicted page"):
        for p, win in wins.items():
            win.slide(1)
            win.recall(ids[p][pages[0].id])
    ask("4. look back: recall the first page", 3)

    branch = wins["kamera"].fork()
    branch.slide(2)
    fork_note = f"fork: branch has {len(branch)} chunks, main window still {len(wins['kamera'])}"
    say(f"[bold]5. fork[/]  {fork_note} (no tensor copied)")
    victim = wins["kamera"].chunks[1]
    disp = wins["kamera"].is_disposable(victim, questions[3].question, max_new_tokens=12)
    say(f"[bold]6. disposability[/]  drop conditioning of {victim[:8]}: answer unchanged = {disp.disposable}")

    summary = _summary(wins, steps)
    if as_json:
        write_json({"steps": steps, "summary": summary})
        return 0
    table = Table(title="kamera demo: cost and fidelity over the session")
    for col in ("policy", "tokens prefilled", "mean TTFT (s)", "mean KL to recompute", "answers = recompute"):
        table.add_column(col, justify="right")
    for p, s in summary.items():
        table.add_row(
            p,
            str(s["tokens_prefilled"]),
            f"{s['ttft_s_mean']:.2f}",
            f"{s['kl_mean']:.4f}",
            f"{s['answers_match']}/{len(steps)}",
        )
    out.print(table)
    return 0


def _describe(win: ContextWindow) -> str:
    last = [d for d in win.stats().decisions if d.source == "plan"]
    return last[-1].reason if last else ""


def _summary(wins: dict[str, ContextWindow], steps: list[dict[str, Any]]) -> dict[str, Any]:
    res = {}
    for p, win in wins.items():
        res[p] = {
            "tokens_prefilled": win.stats().tokens_prefilled,
            "ttft_s_mean": sum(s[p]["ttft_s"] for s in steps) / len(steps),
            "kl_mean": sum(s[p]["kl_to_recompute"] for s in steps) / len(steps),
            "answers_match": sum(s[p]["answer"] == s["recompute"]["answer"] for s in steps),
        }
    return res
