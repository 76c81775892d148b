"""Image and video chunks for ``ContextWindow`` (``add_image`` / ``add_video`` delegate here).

An image becomes one chunk whose id is the hash of its decoded pixels, so the same picture from a path,
bytes or a URL is one chunk. A video becomes one chunk per segment of ``frames_per_segment`` sampled
frames. The engine registers each image / segment once (its vision tower runs then, and its output is
kept in the engine's vision embedding cache): adding it again, evicting and recalling it, or
re-materialising it after a cascade never re-runs the tower.

Works with every policy that serves chunks from KV (``kamera``, ``recompute``, ``prefix``, ``blind``);
the token-axis baselines that re-run chosen tokens through the layers (``cacheblend``, ``mpic``) and
KV compression take text chunks only for now.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kamera_engine import UnsupportedModelError
from kamera_engine.vision import VisionEngine

from .chunks import Chunk, ChunkId, content_id
from .media import DEFAULT_LIMITS, FetchLimits, ImageInput, image_digest, load_image, load_video

if TYPE_CHECKING:
    from .window import ContextWindow

#: Policies that serve image chunks (the selective-recompute baselines run token ids through the layers).
VISION_POLICIES = frozenset({"kamera", "recompute", "prefix", "blind"})


def _engine(win: ContextWindow, what: str) -> VisionEngine:
    engine = win.engine
    if not isinstance(engine, VisionEngine):
        raise UnsupportedModelError(
            f"{what} needs a vision-language engine (VisionEngine.load(<VLM id or path>)); "
            f"{engine.name} is a text model"
        )
    if win.policy.name not in VISION_POLICIES:
        raise UnsupportedModelError(
            f"policy {win.policy.name!r} does not serve image chunks yet; use one of {sorted(VISION_POLICIES)}"
        )
    if win.compressor is not None:
        raise UnsupportedModelError("KV compression does not take image chunks yet")
    return engine


def _append(
    win: ContextWindow, engine: VisionEngine, cid: ChunkId, kind: str, register: Any, label: str | None
) -> ChunkId:
    if cid in win._table:
        return win._append_known(cid)
    runs = engine.tower_runs
    entry = register()
    win._stats.vision_tower_runs += engine.tower_runs - runs
    return win._add(Chunk(cid, kind, list(entry.token_ids), text=label))


def add_image(win: ContextWindow, image: ImageInput, *, limits: FetchLimits = DEFAULT_LIMITS) -> ChunkId:
    """Append an image chunk (PIL image, path, bytes or http(s) URL); returns its content id."""
    engine = _engine(win, "add_image")
    img = load_image(image, limits=limits)
    digest = image_digest(img)
    cid = content_id("image", digest.encode())
    label = f"[image {img.width}x{img.height}]"
    return _append(win, engine, cid, "image", lambda: engine.register_image(img, digest), label)


def add_video(
    win: ContextWindow,
    video: str | Path | bytes | Sequence[ImageInput],
    *,
    frames_per_segment: int = 4,
    sample_fps: float = 1.0,
    max_frames: int | None = 256,
    frames_fps: float = 1.0,
    limits: FetchLimits = DEFAULT_LIMITS,
) -> list[ChunkId]:
    """Append a video as one chunk per segment of ``frames_per_segment`` sampled frames.

    ``video``: a file path or bytes (decoded with PyAV, sampled at ``sample_fps``) or a list of frames
    (taken as sampled at ``frames_fps``). Returns the segments' chunk ids, in order.
    """
    engine = _engine(win, "add_video")
    if isinstance(video, (list, tuple)):
        clip = load_video(video, max_frames=max_frames, frames_fps=frames_fps, limits=limits)
    else:
        clip = load_video(video, sample_fps=sample_fps, max_frames=max_frames, limits=limits)
    ids = []
    for seg in clip.segments(frames_per_segment):
        digest = seg.digest()
        cid = content_id("video", digest.encode())
        label = f"[video {seg.start_s:.1f}-{seg.end_s:.1f}s, {len(seg.frames)} frames]"
        ids.append(
            _append(win, engine, cid, "video", lambda s=seg, d=digest: engine.register_video(s.frames, s.fps, d), label)
        )
    return ids
