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

Works with every policy that serves chunks from KV (``kamera``, ``recompute``, ``prefix``, ``blind``);
the token-axis baselines that re-run chosen tokens through the layers (``cacheblend``, ``mpic``) and
KV compression take text chunks only for now.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kamera_engine import ChunkNotFoundError, InvalidInputError, UnsupportedModelError, WindowOperationError
from kamera_engine.vision import VisionEngine

from .chunks import Chunk, ChunkId, content_id
from .media import DEFAULT_LIMITS, FetchLimits, ImageInput, image_digest, load_image, load_video

if TYPE_CHECKING:
    from .window import ContextWindow

#: How a prompt names an image (MPIC's IMAGE#ID style) and what a name may be made of.
REF_PATTERN = re.compile(r"IMAGE#([A-Za-z0-9_]+)")
_REF_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")

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


def _chunk(
    win: ContextWindow,
    engine: VisionEngine,
    cid: ChunkId,
    kind: str,
    register: Any,
    label: str | None,
    prefix: Sequence[int] = (),
) -> Chunk:
    """The chunk for ``cid``: the known one, or a new one registered with the engine (the vision tower runs
    here, once per distinct picture). Nothing is added to the window yet."""
    if cid in win._table:
        return win._table.get(cid)
    runs = engine.tower_runs
    entry = register()
    win._stats.vision_tower_runs += engine.tower_runs - runs
    return Chunk(cid, kind, [*prefix, *entry.token_ids], text=label)


def _append(win: ContextWindow, chunk: Chunk) -> ChunkId:
    return win._append_known(chunk.id) if chunk.id in win._table else win._add(chunk)


def add_image(
    win: ContextWindow, image: ImageInput, *, ref: str | None = None, limits: FetchLimits = DEFAULT_LIMITS
) -> ChunkId:
    """Append an image chunk (PIL image, path, bytes or http(s) URL); returns its content id.

    ``ref``: a name (letters, digits, ``_``; at most 64) the prompt can use as ``IMAGE#<ref>``; the chunk
    then starts with the text ``IMAGE#<ref>:`` so the model reads the name next to the picture.
    """
    engine = _engine(win, "add_image")
    if ref is not None and (not isinstance(ref, str) or not _REF_NAME.fullmatch(ref)):
        raise InvalidInputError(f"image ref {ref!r}: use 1-64 letters, digits or '_' (the prompt says IMAGE#<ref>)")
    img = load_image(image, limits=limits)
    digest = image_digest(img)
    name = "image" if ref is None else f"IMAGE#{ref}"
    label = f"[{name} {img.width}x{img.height}]"
    prefix = [] if ref is None else engine.tokenize(f"{name}: ")  # a name is part of the chunk's content
    cid = content_id("image", (digest if ref is None else f"{digest}#{ref}").encode())
    if ref is not None and win._refs.get(ref, cid) != cid:
        raise InvalidInputError(f"IMAGE#{ref} already names another image ({win._refs[ref][:8]}); pick another ref")
    chunk_id = _append(
        win, _chunk(win, engine, cid, "image", lambda: engine.register_image(img, digest), label, prefix)
    )
    if ref is not None:
        win._refs[ref] = chunk_id
    return chunk_id


def check_prompt_refs(win: ContextWindow, prompt: str) -> None:
    """Refuse a prompt that names an image (``IMAGE#<ref>``) the window does not hold."""
    for ref in dict.fromkeys(REF_PATTERN.findall(prompt)):
        cid = win._refs.get(ref)
        if cid is None:
            known = "known: " + (", ".join(f"IMAGE#{r}" for r in win._refs) or "none")
            raise ChunkNotFoundError(f"the prompt names IMAGE#{ref}, but no image was added with that ref ({known})")
        if cid not in win:
            raise WindowOperationError(
                f"the prompt names IMAGE#{ref}, which was evicted from the window: win.recall(win.refs[{ref!r}]) first"
            )


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
            win, engine, cid, "video", lambda s=seg, d=digest: engine.register_video(s.frames, s.fps, d), label
        )
        # every segment is checked before any is added (the budget, and the context its canonical is
        # computed in): a refusal changes nothing
        win._check_fits(chunk)
        engine.check_length(len(engine.anchor_ids) + len(chunk))
        chunks.append(chunk)
    return [_append(win, chunk) for chunk in chunks]
