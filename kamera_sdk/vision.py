"""Image and video chunks for ``ContextWindow`` (``add_image`` / ``add_video`` delegate here).

An image becomes one chunk whose id is the hash of its decoded pixels, so the same picture from a path,
bytes or a URL is one chunk. A video becomes one chunk per segment of ``frames_per_segment`` sampled
frames. The engine registers each image / segment once (its vision tower runs then, and its output is
kept in the engine's vision embedding cache): adding it again, evicting and recalling it, or
re-materialising it after a cascade never re-runs the tower.

Prompts can name images MPIC-style: ``add_image(img, ref="EIFFEL2025")`` puts the text
``IMAGE#EIFFEL2025:`` in front of the image inside its chunk, so a prompt such as "Compare IMAGE#EIFFEL2025
and IMAGE#LOUVRE2025" reads the names the model saw next to the pictures. A prompt that names an image
the window does not hold is refused (unknown name, or evicted: recall it first). The vision tower still
runs once per distinct picture, whatever names it is given.

Works with every policy that declares ``serves_images`` (those that serve chunks from KV: ``kamera``,
``recompute``, ``prefix``, ``blind``); the token-axis baselines that re-run chosen tokens through the
layers (``cacheblend``, ``mpic``) and KV compression take text chunks only for now.

This module reaches the window through its public seam only (``WindowSeam``: ``known`` and ``admit``)
and owns what a window branch knows of its images (``WindowMedia``); it never imports the window.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Sequence
from pathlib import Path
from typing import Protocol

from kamera_engine import ChunkNotFoundError, Engine, InvalidInputError, UnsupportedModelError, WindowOperationError
from kamera_engine.vision import VisionEngine

from .chunks import Chunk, ChunkId, content_id
from .media import DEFAULT_LIMITS, FetchLimits, ImageInput, image_digest, load_image, load_video
from .policies import POLICIES, ReusePolicy

#: How a prompt names an image (MPIC's IMAGE#ID style) and what a name may be made of.
REF_PATTERN = re.compile(r"IMAGE#([A-Za-z0-9_]+)")
_REF_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")


class WindowSeam(Protocol):
    """What vision needs of a window: its engine and policy, a look-up of known content, and ``admit``."""

    engine: Engine
    policy: ReusePolicy
    compressor: object | None

    def known(self, chunk_id: ChunkId) -> Chunk | None: ...

    def admit(self, *chunks: Chunk) -> list[ChunkId]: ...


class WindowMedia:
    """What one window branch knows of its images: the ``IMAGE#<ref>`` names given with
    ``add_image(..., ref=...)`` and the chunks they name, and the vision-tower runs it caused. A fork
    starts with its parent's names and no tower runs of its own."""

    def __init__(self, refs: dict[str, ChunkId] | None = None) -> None:
        self._refs: dict[str, ChunkId] = dict(refs or {})
        self.tower_runs = 0

    @property
    def refs(self) -> dict[str, ChunkId]:
        return dict(self._refs)

    def fork(self) -> WindowMedia:
        return WindowMedia(self._refs)

    def check_name(self, ref: str, chunk_id: ChunkId) -> None:
        """Refuse a ref that already names another image (nothing is recorded)."""
        held = self._refs.get(ref, chunk_id)
        if held != chunk_id:
            raise InvalidInputError(f"IMAGE#{ref} already names another image ({held[:8]}); pick another ref")

    def name(self, ref: str, chunk_id: ChunkId) -> None:
        self.check_name(ref, chunk_id)
        self._refs[ref] = chunk_id

    def forget(self, chunk_id: ChunkId) -> None:
        """Drop the names of a forgotten image (a prompt naming one is told no image has that ref)."""
        self._refs = {ref: cid for ref, cid in self._refs.items() if cid != chunk_id}

    def check_prompt(self, prompt: str, window: Container[ChunkId]) -> None:
        """Refuse a prompt that names an image (``IMAGE#<ref>``) the window does not hold."""
        if "IMAGE#" not in prompt:
            return
        for ref in dict.fromkeys(REF_PATTERN.findall(prompt)):
            cid = self._refs.get(ref)
            if cid is None:
                known = "known: " + (", ".join(f"IMAGE#{r}" for r in self._refs) or "none")
                raise ChunkNotFoundError(
                    f"the prompt names IMAGE#{ref}, but no image was added with that ref ({known})"
                )
            if cid not in window:
                raise WindowOperationError(
                    f"the prompt names IMAGE#{ref}, which was evicted from the window: "
                    f"win.recall(win.refs[{ref!r}]) first"
                )


def _engine(win: WindowSeam, what: str) -> VisionEngine:
    engine = win.engine
    if not isinstance(engine, VisionEngine):
        raise UnsupportedModelError(
            f"{what} needs a vision-language engine (VisionEngine.load(<VLM id or path>)); "
            f"{engine.name} is a text model"
        )
    if not win.policy.serves_images:
        serving = sorted(name for name, cls in POLICIES.items() if cls.serves_images)
        raise UnsupportedModelError(f"policy {win.policy.name!r} does not serve image chunks yet; use one of {serving}")
    if win.compressor is not None:
        raise UnsupportedModelError("KV compression does not take image chunks yet")
    return engine


def _chunk(
    win: WindowSeam,
    media: WindowMedia,
    engine: VisionEngine,
    cid: ChunkId,
    kind: str,
    register: Callable[[], object],
    label: str | None,
    prefix: Sequence[int] = (),
) -> Chunk:
    """The chunk for ``cid``: the known one, or a new one registered with the engine (the vision tower runs
    here, once per distinct picture). Nothing is added to the window yet."""
    known = win.known(cid)
    if known is not None:
        return known
    runs = engine.tower_runs
    entry = register()
    media.tower_runs += engine.tower_runs - runs
    return Chunk(cid, kind, [*prefix, *entry.token_ids], text=label)  # type: ignore[attr-defined]


def image_chunk(
    win: WindowSeam,
    media: WindowMedia,
    image: ImageInput,
    *,
    ref: str | None = None,
    limits: FetchLimits = DEFAULT_LIMITS,
) -> Chunk:
    """The chunk ``add_image`` appends for ``image``, not yet in the window (the vision tower runs here,
    once per distinct picture): its length is the tokens it takes. ``ref``: as ``add_image``'s (checked,
    not yet recorded)."""
    engine = _engine(win, "add_image")
    if ref is not None and (not isinstance(ref, str) or not _REF_NAME.fullmatch(ref)):
        raise InvalidInputError(f"image ref {ref!r}: use 1-64 letters, digits or '_' (the prompt says IMAGE#<ref>)")
    img = load_image(image, limits=limits)
    digest = image_digest(img)
    name = "image" if ref is None else f"IMAGE#{ref}"
    label = f"[{name} {img.width}x{img.height}]"
    prefix = [] if ref is None else engine.tokenize(f"{name}: ")  # a name is part of the chunk's content
    cid = content_id("image", (digest if ref is None else f"{digest}#{ref}").encode())
    if ref is not None:
        media.check_name(ref, cid)
    return _chunk(win, media, engine, cid, "image", lambda: engine.register_image(img, digest), label, prefix)


def add_image(
    win: WindowSeam,
    media: WindowMedia,
    image: ImageInput,
    *,
    ref: str | None = None,
    limits: FetchLimits = DEFAULT_LIMITS,
) -> ChunkId:
    """Append an image chunk (PIL image, path, bytes or http(s) URL); returns its content id.

    ``ref``: a name (letters, digits, ``_``; at most 64) the prompt can use as ``IMAGE#<ref>``; the chunk
    then starts with the text ``IMAGE#<ref>:`` so the model reads the name next to the picture.
    """
    chunk = image_chunk(win, media, image, ref=ref, limits=limits)
    (chunk_id,) = win.admit(chunk)
    if ref is not None:
        media.name(ref, chunk_id)
    return chunk_id


def add_video(
    win: WindowSeam,
    media: WindowMedia,
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
    (taken as sampled at ``frames_fps``). Returns the segments' chunk ids, in order. Segments with the same
    frames are the same content, so the same chunk (a window is a set): a static scene's repeated segment
    appears once in the window and its id repeats in the list.
    """
    engine = _engine(win, "add_video")
    if isinstance(video, (list, tuple)):
        clip = load_video(video, max_frames=max_frames, frames_fps=frames_fps, limits=limits)
    else:
        clip = load_video(video, sample_fps=sample_fps, max_frames=max_frames, limits=limits)
    chunks = []
    for seg in clip.segments(frames_per_segment):
        digest = seg.digest()
        cid = content_id("video", digest.encode())
        label = f"[video {seg.start_s:.1f}-{seg.end_s:.1f}s, {len(seg.frames)} frames]"
        chunk = _chunk(
            win, media, engine, cid, "video", lambda s=seg, d=digest: engine.register_video(s.frames, s.fps, d), label
        )
        # the context each segment's canonical is computed in is checked before any is added (``admit``
        # checks the budget of every segment first): a refusal changes nothing
        engine.check_length(len(engine.anchor_ids) + len(chunk))
        chunks.append(chunk)
    return win.admit(*chunks)
