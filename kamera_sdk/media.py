"""Image and video inputs: decode, fetch, sample and segment.

Images come as a PIL image, a path, raw bytes, or an http(s) URL. URLs are fetched with httpx under
explicit limits (:class:`FetchLimits`): connect/read timeouts and an overall deadline, a maximum body
size checked *while streaming* (a lying or absent ``Content-Length`` cannot get past it), an
``image/*`` content-type check before the body is read, and a bounded number of redirects, each one
re-checked (no scheme other than http/https, no loops). Every failure is a :class:`MediaError`
subclass that says what was refused and why.

Video comes as a list of frames or a file / bytes decoded with PyAV. Frames are sampled at a target
rate (or a fixed count) and split into segments of ``frames_per_segment`` frames; each segment becomes
one chunk of the window.

Images are identified by their decoded pixels (:func:`image_digest`), so the same picture read from a
path, from bytes or from a URL is the same chunk.
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from PIL import Image, UnidentifiedImageError

from kamera_engine.errors import (
    ImageDecodeError,
    InvalidInputError,
    MediaError,
    MediaFetchError,
    MediaTooLargeError,
    MediaTypeError,
    RedirectError,
    UnsupportedSchemeError,
    positive_int,
)

ImageInput = Any  # PIL.Image.Image | str | Path | bytes | bytearray

_SCHEMES = ("http", "https")
_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True, slots=True)
class FetchLimits:
    """Limits for URL inputs (and the size cap for files and bytes).

    ``timeout_s``: connect / read / write timeout of each request. ``deadline_s``: wall-clock cap on one
    fetch including redirects and the body (a slow drip of bytes cannot hold it forever).
    ``max_bytes``: largest image body or file accepted. ``max_video_bytes``: largest video file or bytes
    accepted. ``max_redirects``: redirects followed before giving up. ``max_pixels``: largest decoded
    image or video frame (width x height) accepted.
    """

    timeout_s: float = 10.0
    deadline_s: float = 30.0
    max_bytes: int = 20 * 1024 * 1024
    max_redirects: int = 5
    max_pixels: int = 40_000_000
    max_video_bytes: int = 2 * 1024**3
    user_agent: str = "kamera-media/0.1"


DEFAULT_LIMITS = FetchLimits()


def is_url(value: object) -> bool:
    return isinstance(value, str) and "://" in value[:16]


def fetch_bytes(url: str, limits: FetchLimits = DEFAULT_LIMITS, *, client: Any | None = None) -> tuple[bytes, str]:
    """GET ``url`` under ``limits``; returns the body and its content type (must be ``image/*``)."""
    import httpx

    own = client is None
    if client is None:
        timeout = httpx.Timeout(limits.timeout_s)
        client = httpx.Client(timeout=timeout, follow_redirects=False, headers={"User-Agent": limits.user_agent})
    t0 = time.monotonic()
    seen: list[str] = []
    current = url
    try:
        while True:
            _check_scheme(current)
            if current in seen:
                raise RedirectError(f"redirect loop fetching {url}: {' -> '.join([*seen, current])}")
            seen.append(current)
            if time.monotonic() - t0 > limits.deadline_s:  # redirects count against the deadline too
                raise MediaFetchError(f"{current}: fetch exceeded the {limits.deadline_s} s deadline")
            try:
                # the size limit is on the bytes that arrive: no transfer encoding that inflates them
                with client.stream("GET", current, headers={"Accept-Encoding": "identity"}) as resp:
                    if resp.status_code in _REDIRECTS:
                        location = resp.headers.get("location")
                        if not location:
                            raise MediaFetchError(f"{current}: redirect {resp.status_code} without a Location")
                        if len(seen) > limits.max_redirects:
                            raise RedirectError(f"{url}: more than {limits.max_redirects} redirects")
                        current = urljoin(current, location)
                        continue
                    if resp.status_code >= 400:
                        raise MediaFetchError(f"{current}: HTTP {resp.status_code}")
                    ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
                    if not ctype.startswith("image/"):
                        raise MediaTypeError(f"{current}: content type {ctype or 'missing'!r} is not image/*")
                    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
                    if encoding not in ("", "identity"):
                        raise MediaFetchError(
                            f"{current}: compressed response ({encoding}) refused: its size cannot be bounded "
                            "before it is inflated"
                        )
                    declared = resp.headers.get("content-length")
                    if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
                        raise MediaTooLargeError(
                            f"{current}: Content-Length {int(declared)} exceeds the limit of {limits.max_bytes} bytes"
                        )
                    buf = bytearray()
                    for piece in resp.iter_raw():
                        buf.extend(piece)
                        if len(buf) > limits.max_bytes:
                            raise MediaTooLargeError(
                                f"{current}: body exceeds the limit of {limits.max_bytes} bytes (stopped reading)"
                            )
                        if time.monotonic() - t0 > limits.deadline_s:
                            raise MediaFetchError(f"{current}: fetch exceeded the {limits.deadline_s} s deadline")
                    return bytes(buf), ctype
            except httpx.TimeoutException as exc:
                raise MediaFetchError(f"{current}: timed out ({exc.__class__.__name__})") from exc
            except httpx.HTTPError as exc:
                raise MediaFetchError(f"{current}: {exc.__class__.__name__}: {exc}") from exc
    finally:
        if own:
            client.close()


def _check_scheme(url: str) -> None:
    scheme = urlsplit(url).scheme.lower()
    if scheme not in _SCHEMES:
        raise UnsupportedSchemeError(f"{url}: scheme {scheme!r} is refused; only http and https URLs are fetched")


def _check_pixels(width: int, height: int, what: str, limits: FetchLimits) -> None:
    """Refuse a picture with no pixels (``ImageDecodeError``) or more than ``limits.max_pixels``."""
    if width < 1 or height < 1:
        raise ImageDecodeError(f"{what}: a {width}x{height} image has no pixels")
    if width * height > limits.max_pixels:
        raise MediaTooLargeError(f"{what}: {width}x{height} exceeds the limit of {limits.max_pixels} pixels")


def decode_image(data: bytes, *, source: str = "bytes", limits: FetchLimits = DEFAULT_LIMITS) -> Image.Image:
    """Decode image bytes to an RGB PIL image, or raise :class:`ImageDecodeError`."""
    if len(data) > limits.max_bytes:
        raise MediaTooLargeError(f"{source}: {len(data)} bytes exceeds the limit of {limits.max_bytes}")
    if not data:
        raise ImageDecodeError(f"{source}: empty input is not an image")
    try:
        img = Image.open(io.BytesIO(data))
        _check_pixels(img.width, img.height, source, limits)
        img.load()
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageDecodeError(f"{source}: not a decodable image ({exc})") from exc
    return img.convert("RGB")


def load_image(src: ImageInput, *, limits: FetchLimits = DEFAULT_LIMITS, client: Any | None = None) -> Image.Image:
    """An RGB PIL image from a PIL image, a path, bytes, or an http(s) URL."""
    if isinstance(src, Image.Image):
        _check_pixels(src.width, src.height, "image", limits)
        return src if src.mode == "RGB" else src.convert("RGB")
    if isinstance(src, (bytes, bytearray, memoryview)):
        return decode_image(bytes(src), limits=limits)
    if isinstance(src, str) and is_url(src):
        data, _ = fetch_bytes(src, limits, client=client)
        return decode_image(data, source=src, limits=limits)
    if isinstance(src, (str, Path)):
        path = Path(src)
        if not path.is_file():
            raise MediaError(f"image file not found: {path}")
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise MediaTooLargeError(f"{path}: {size} bytes exceeds the limit of {limits.max_bytes}")
        return decode_image(path.read_bytes(), source=str(path), limits=limits)
    raise InvalidInputError(f"an image is a PIL image, a path, bytes or an http(s) URL; got {type(src).__name__}")


def image_digest(img: Image.Image) -> str:
    """Content hash of a decoded image (mode, size and pixels): the same picture from any source is equal."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{img.mode}:{img.width}x{img.height}\0".encode())
    h.update(img.tobytes())
    return h.hexdigest()


# --- video -------------------------------------------------------------------------------------------
@dataclass(slots=True)
class VideoSegment:
    """Consecutive sampled frames of a video; one segment is one chunk."""

    frames: list[Image.Image]
    index: int
    start_s: float
    end_s: float
    fps: float  # sampling rate of ``frames`` (frames per second of video time)

    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(f"video:{self.fps:.6f}\0".encode())
        for f in self.frames:
            h.update(image_digest(f).encode())
        return h.hexdigest()


@dataclass(slots=True)
class Video:
    """Sampled frames with their timestamps (seconds)."""

    frames: list[Image.Image]
    timestamps: list[float] = field(default_factory=list)
    fps: float = 1.0

    def __len__(self) -> int:
        return len(self.frames)

    def segments(self, frames_per_segment: int) -> list[VideoSegment]:
        """Split into segments of ``frames_per_segment`` frames (the last one may be shorter)."""
        frames_per_segment = positive_int("frames_per_segment", frames_per_segment)
        out = []
        for i in range(0, len(self.frames), frames_per_segment):
            ts = self.timestamps[i : i + frames_per_segment]
            out.append(
                VideoSegment(
                    self.frames[i : i + frames_per_segment], len(out), ts[0], ts[-1] + 1.0 / self.fps, self.fps
                )
            )
        return out


def load_video(
    src: str | Path | bytes | Sequence[ImageInput],
    *,
    sample_fps: float | None = 1.0,
    max_frames: int | None = 256,
    frames_fps: float = 1.0,
    limits: FetchLimits = DEFAULT_LIMITS,
) -> Video:
    """Frames of a video, sampled.

    ``src``: a list of frames (each anything :func:`load_image` takes; they are taken as sampled at
    ``frames_fps``), or a video file path / bytes decoded with PyAV. ``sample_fps``: keep about this many
    frames per second of video (``None``: every decoded frame). ``max_frames``: cap on sampled frames.
    """
    if max_frames is not None and max_frames < 1:
        raise InvalidInputError(f"max_frames must be >= 1, got {max_frames}")
    if sample_fps is not None and sample_fps <= 0:
        raise InvalidInputError(f"sample_fps must be > 0, got {sample_fps}")
    if isinstance(src, (list, tuple)):
        if not src:
            raise InvalidInputError("a video needs at least one frame")
        frames = [load_image(f, limits=limits) for f in src]
        if max_frames is not None:
            frames = frames[:max_frames]
        return Video(frames, [i / frames_fps for i in range(len(frames))], frames_fps)
    if isinstance(src, (bytes, bytearray)):
        if len(src) > limits.max_video_bytes:
            raise MediaTooLargeError(f"video of {len(src)} bytes exceeds the limit of {limits.max_video_bytes}")
        return _decode_video(io.BytesIO(bytes(src)), "bytes", sample_fps, max_frames, limits)
    if isinstance(src, (str, Path)):
        if is_url(str(src)):
            raise InvalidInputError("video URLs are not fetched; download the file and pass its path")
        path = Path(src)
        if not path.is_file():
            raise MediaError(f"video file not found: {path}")
        size = path.stat().st_size
        if size > limits.max_video_bytes:
            raise MediaTooLargeError(
                f"video file {path} of {size} bytes exceeds the limit of {limits.max_video_bytes} "
                "(raise it with limits=FetchLimits(max_video_bytes=...))"
            )
        return _decode_video(str(path), str(path), sample_fps, max_frames, limits)
    raise InvalidInputError(f"a video is a list of frames, a path or bytes; got {type(src).__name__}")


def _decode_video(
    target: Any, source: str, sample_fps: float | None, max_frames: int | None, limits: FetchLimits
) -> Video:
    try:
        import av
    except ImportError as exc:  # pragma: no cover - av is a declared dependency of the vision extra
        raise MediaError("decoding video files needs PyAV: pip install av") from exc
    frames: list[Image.Image] = []
    stamps: list[float] = []
    try:
        with av.open(target) as container:
            if not container.streams.video:
                raise ImageDecodeError(f"{source}: no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 25.0)
            next_t = 0.0
            for i, frame in enumerate(container.decode(stream)):
                t = float(frame.time) if frame.time is not None else i / rate
                if sample_fps is not None and t + 1e-6 < next_t:
                    continue
                _check_pixels(frame.width, frame.height, f"{source} (a frame)", limits)
                frames.append(frame.to_image().convert("RGB"))
                stamps.append(t)
                if sample_fps is not None:
                    next_t = (len(frames)) / sample_fps
                if max_frames is not None and len(frames) >= max_frames:
                    break
    except MediaError:
        raise
    except Exception as exc:  # av raises its own error tree (av.error.*), plus OSError
        raise ImageDecodeError(f"{source}: not a decodable video ({exc})") from exc
    if not frames:
        raise ImageDecodeError(f"{source}: no frames decoded")
    return Video(frames, stamps, sample_fps if sample_fps is not None else rate)


__all__ = [
    "DEFAULT_LIMITS",
    "FetchLimits",
    "Video",
    "VideoSegment",
    "decode_image",
    "fetch_bytes",
    "image_digest",
    "is_url",
    "load_image",
    "load_video",
]
