"""A GUI agent loop with a sliding window over screen observations.

A fake phone settings app renders each screen as an accessibility tree (text). Every step the agent
observes the screen (a chunk), keeps only the last few observations (``slide``), and clicks the element it
has not tried on that screen yet whose label's first token ``next_token_logprobs`` scores highest. A screen seen again
is not re-encoded: still in the window it is moved last (``reorder``), already slid out it is recalled
(``recall``). With Kamera, survivors of a slide are only rotated; without it (``policy="recompute"``)
every step re-prefills all observations.

With a vision-language model the observations are screenshots instead: each screen is rendered to an
image and added with ``add_image`` (the vision tower runs once per distinct screen; a screen seen again
is reordered or recalled, never re-encoded).

    python examples/gui_agent.py                                  # accessibility text, default model
    python examples/gui_agent.py --short                          # a few steps (CI)
    python examples/gui_agent.py --model Qwen/Qwen2-VL-2B-Instruct --device cuda   # screenshots, a real VLM
    python examples/gui_agent.py --short --tiny-vlm qwen2_vl      # screenshots, a tiny random VLM (mechanics)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from _common import SideBySide, arg_parser, load_engine, scratch_dir

from kamera_engine import Engine
from kamera_engine.vision import VisionEngine

if TYPE_CHECKING:
    from PIL import Image

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


def screenshot(tree: str) -> Image.Image:
    """The screen as pixels: the accessibility tree drawn as a phone screen (what a VLM agent would see)."""
    from PIL import Image, ImageDraw

    lines = tree.strip().splitlines()
    img = Image.new("RGB", (224, 28 + 18 * len(lines)), (250, 250, 250))
    draw = ImageDraw.Draw(img)
    draw.rectangle([0, 0, 223, 20], fill=(40, 90, 160))
    draw.text((6, 5), lines[0].split('"')[1], fill=(255, 255, 255))
    for i, line in enumerate(lines[1:]):
        draw.text((8, 28 + 18 * i), line.strip(), fill=(20, 20, 20))
    return img


def load(args: argparse.Namespace) -> Engine:
    """The default text model, a VLM by id or path (``--model``), or a tiny random VLM (``--tiny-vlm``)."""
    if args.model:
        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
        return Engine.load(args.model, device=args.device)
    if args.tiny_vlm:
        from kamera_engine.vision.tiny import build_tiny_vlm

        path = build_tiny_vlm(args.tiny_vlm, scratch_dir("kamera-gui-agent-"))
        return VisionEngine.load(path, device=args.device or "cpu", dtype="float32")
    return load_engine(args.device)


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--model", default=None, help="a vision-language model id or path: observe screenshots")
    parser.add_argument("--tiny-vlm", default=None, help="observe screenshots with a tiny random VLM of this family")
    parser.add_argument("--steps", type=int, default=None, help="maximum steps (default 16, 3 with --short)")
    args = parser.parse_args()
    steps = args.steps or (3 if args.short else 16)
    keep = 2 if args.short else 3  # observations kept in the window
    engine = load(args)
    pixels = isinstance(engine, VisionEngine)  # a vision-language engine: observe screenshots
    print("observations:", "screenshots (add_image)" if pixels else "accessibility-tree text (add_text)")
    session = SideBySide(engine)
    phone = Phone()
    actions: list[str] = []
    tried: dict[str, set[str]] = {}  # observation -> labels already clicked there (explore, don't repeat)
    seen: dict[str, str] = {}  # observation -> its chunk id
    runs0 = getattr(engine, "tower_runs", 0)

    for step in range(1, steps + 1):
        print(f"\n[{step}] screen {phone.screen!r}")
        obs = phone.tree()
        known = seen.get(obs)
        if known in session.chunks:
            print("    seen and still in the window: move it last (reorder)")
            session.reorder([c for c in session.chunks if c != known] + [known])
        elif known is not None:
            print("    seen before and slid out: recall")
            session.recall(known)
        elif pixels:
            seen[obs] = session.add_image(screenshot(obs))
            print("    new screenshot: vision tower + one conditioned forward")
        else:
            seen[obs] = session.add_text(obs)
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
        print(f"\ngoal not reached in {steps} steps (a small model is a weak GUI agent; the cost figures stand)")
    if pixels:
        print(f"vision tower runs: {engine.tower_runs - runs0} for {len(seen)} distinct screens")
    session.report()


if __name__ == "__main__":
    main()
