"""A video question-answering loop that slides over segments.

A video (a file decoded with PyAV, or a synthetic clip drawn here) is sampled and cut into segments of a
few frames; each segment is one chunk. The agent watches segment after segment with a window of the last
few segments (``slide``), asks a question after each, and at the end looks back at the first segment
(``recall``). With Kamera, survivors of a slide are only rotated and a recalled segment gets a fresh
patch, with no vision re-encode; the ``recompute`` baseline re-prefills the whole window on every
question. The vision tower runs once per distinct segment for both.

    python examples/video_agent.py                      # a tiny random Qwen2-VL built in a temp dir
    python examples/video_agent.py --short              # a few steps (CI)
    python examples/video_agent.py --family llava       # another tiny family
    python examples/video_agent.py --model Qwen/Qwen2.5-VL-3B-Instruct --video clip.mp4 --device cuda

On a tiny random model the answers are noise: the run checks the mechanics (what is prefilled, rotated,
patched, encoded). A real checkpoint (``--model``, an id or a local path) gives real answers.
"""

from __future__ import annotations

import sys

from _common import SideBySide, arg_parser, scratch_dir
from PIL import Image, ImageDraw

from kamera_engine.vision import VisionEngine
from kamera_sdk.media import load_video


def synthetic_clip(n_frames: int, size: tuple[int, int] = (112, 84)) -> list[Image.Image]:
    """A red square moving left to right over a blue-to-green background, one frame per second."""
    frames = []
    for i in range(n_frames):
        img = Image.new("RGB", size, (20, 40 + 12 * i % 200, 200 - 10 * i % 180))
        x = 4 + (i * (size[0] - 28)) // max(1, n_frames - 1)
        ImageDraw.Draw(img).rectangle([x, 30, x + 20, 50], fill=(230, 30, 30))
        frames.append(img)
    return frames


def load(args) -> VisionEngine:
    if args.model:
        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
        return VisionEngine.load(args.model, device=args.device)
    from kamera_engine.vision.tiny import build_tiny_vlm

    path = build_tiny_vlm(args.family, scratch_dir("kamera-video-agent-"))
    print(f"built a tiny random {args.family} at {path}", file=sys.stderr, flush=True)
    return VisionEngine.load(path, device=args.device or "cpu", dtype="float32")


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--model", default=None, help="a VLM id or local path (default: a tiny random model)")
    parser.add_argument("--family", default="qwen2_vl", help="tiny family when no --model is given")
    parser.add_argument("--video", default=None, help="a video file (default: a synthetic clip)")
    parser.add_argument("--frames-per-segment", type=int, default=2)
    parser.add_argument("--window", type=int, default=3, help="segments kept in the window")
    args = parser.parse_args()

    engine = load(args)
    n_frames = 8 if args.short else 16
    if args.video:
        clip = load_video(args.video, sample_fps=1.0, max_frames=n_frames)
    else:
        clip = load_video(synthetic_clip(n_frames), frames_fps=1.0)
    segments = clip.segments(args.frames_per_segment)
    print(f"{len(clip)} frames -> {len(segments)} segments of {args.frames_per_segment} frames")

    session = SideBySide(engine, rank=32)
    question = "Question: where is the red square now?"
    max_new = 4 if args.short else 16
    runs0 = engine.tower_runs
    first = None
    for seg in segments:
        print(f"\n[segment {seg.index}: {seg.start_s:.0f}-{seg.end_s:.0f}s]")
        ids = session._each("add_video", seg.frames, frames_per_segment=len(seg.frames), frames_fps=seg.fps)[0]
        first = first or ids[0]
        if len(session.chunks) > args.window:
            gone = session.slide(len(session.chunks) - args.window)
            print(f"    slide: {len(gone)} segment(s) out, survivors rotated")
        session.ask(question, max_new)
    print("\n[look back at the first segment]")
    if first in session.evicted:
        session.recall(first, at=0)
        print("    recall: segment 0 re-admitted from its canonical (no vision re-encode)")
    session.ask("Question: where did the red square start?", max_new)

    runs = engine.tower_runs - runs0
    print(f"\nvision tower runs: {runs} for {len(segments)} distinct segments")
    session.report()


if __name__ == "__main__":
    main()
