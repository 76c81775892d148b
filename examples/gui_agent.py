"""A GUI agent loop with a sliding window over screen observations.

A fake phone settings app renders each screen as an accessibility tree (text). Every step the agent
observes the screen (a chunk), keeps only the last few observations (``slide``), and clicks the element it
has not tried on that screen yet whose label's first token ``next_token_logprobs`` scores highest. A screen seen again
is not re-encoded: still in the window it is moved last (``reorder``), already slid out it is recalled
(``recall``). With Kamera, survivors of a slide are only rotated; without it (``policy="recompute"``)
every step re-prefills all observations.

Screenshots need a vision-language engine, which this example does not support yet: ``--model`` is
accepted for that future path and the loop runs on accessibility-tree text with the default model.

    python examples/gui_agent.py            # full session
    python examples/gui_agent.py --short    # a few steps (CI)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from _common import SideBySide, arg_parser, load_engine

GOAL = "Turn on dark mode."
HOME = ("Wi-Fi", "Bluetooth", "Display", "Sound")


@dataclass
class Phone:
    """The app under control: a handful of settings screens with switches."""

    screen: str = "Home"
    switches: dict[str, bool] = field(
        default_factory=lambda: {"Wi-Fi": True, "Bluetooth": False, "Dark mode": False, "Vibrate": True}
    )

    def elements(self) -> list[tuple[str, str, str]]:
        """(role, label, state) of each element on the current screen."""

        def switch(label: str) -> tuple[str, str, str]:
            return ("switch", label, f"checked={self.switches[label]}")

        back = ("button", "Back", "")
        screens: dict[str, list[tuple[str, str, str]]] = {
            "Home": [("button", name, "") for name in HOME],
            "Wi-Fi": [switch("Wi-Fi"), ("button", "HomeNet", "connected"), ("button", "CafeGuest", "open"), back],
            "Bluetooth": [switch("Bluetooth"), ("button", "Pair new device", ""), back],
            "Display": [("slider", "Brightness", "value=70%"), switch("Dark mode"), ("button", "Font size", ""), back],
            "Sound": [("slider", "Volume", "value=40%"), switch("Vibrate"), back],
        }
        return screens[self.screen]

    def tree(self) -> str:
        """The accessibility tree of the current screen, as an agent would receive it."""
        lines = [f'window "Settings > {self.screen}"']
        for i, (role, label, state) in enumerate(self.elements(), 1):
            lines.append(f'  [{i}] {role} "{label}" {state}'.rstrip())
        return "\n".join(lines) + "\n\n"

    def click(self, label: str) -> None:
        if label == "Back":
            self.screen = "Home"
        elif self.screen == "Home":
            self.screen = label
        elif label in self.switches:
            self.switches[label] = not self.switches[label]


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--model", default=None, help="a vision-language model for screenshots (not supported yet)")
    parser.add_argument("--steps", type=int, default=None, help="maximum steps (default 16, 3 with --short)")
    args = parser.parse_args()
    if args.model:
        print(
            f"--model {args.model}: screenshots need a VLM engine, which this example does not support yet; "
            "using accessibility-tree text with the default model instead."
        )
    steps = args.steps or (3 if args.short else 16)
    keep = 2 if args.short else 3  # observations kept in the window
    engine = load_engine(args.device)
    session = SideBySide(engine)
    phone = Phone()
    actions: list[str] = []
    tried: dict[str, set[str]] = {}  # observation -> labels already clicked there (explore, don't repeat)

    for step in range(1, steps + 1):
        print(f"\n[{step}] screen {phone.screen!r}")
        obs = phone.tree()
        known = [cid for cid in session.chunks + session.evicted if session.kamera.chunk(cid).text == obs]
        if known and known[0] in session.chunks:
            print("    seen and still in the window: move it last (reorder)")
            session.reorder([c for c in session.chunks if c != known[0]] + [known[0]])
        elif known:
            print("    seen before and slid out: recall")
            session.recall(known[0])
        else:
            session.add_text(obs)
        if len(session.chunks) > keep:
            print(f"    slide {len(session.chunks) - keep} old observation(s) out")
            session.slide(len(session.chunks) - keep)

        labels = [label for _, label, _ in phone.elements() if label not in tried.setdefault(obs, set())]
        if not labels:  # everything tried here: start over on this screen
            tried[obs].clear()
            labels = [label for _, label, _ in phone.elements()]
        history = "; ".join(actions) or "none"
        prompt = (
            f"Goal: {GOAL} Actions so far: {history}. The last screen above is the current one. "
            f"Which element do you click next? Answer with its label only, one of: {', '.join(labels)}."
        )
        lps = session.logprobs(prompt)
        first_token = {label: engine.tokenize(label)[0] for label in labels}  # distinct on every screen
        picks = {name: max(labels, key=lambda lab, lp=lp: float(lp[first_token[lab]])) for name, lp in lps.items()}
        choice = picks["kamera"]
        note = "" if picks["recompute"] == choice else f" (recompute would click {picks['recompute']!r})"
        print(f"    click {choice!r}{note}")
        tried[obs].add(choice)
        actions.append(f"{choice} on {phone.screen}")
        phone.click(choice)
        if phone.switches["Dark mode"]:
            print("    goal reached: dark mode is on")
            break
    else:
        print(f"\ngoal not reached in {steps} steps (a 135M model is a weak GUI agent; the cost figures stand)")
    session.report()


if __name__ == "__main__":
    main()
