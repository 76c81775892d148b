"""Image and video inputs: loopback HTTP (real PNG, oversized body, wrong type, redirect loop), files,
bytes, refused schemes, undecodable data; PyAV decoding, sampling and segmentation."""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from kamera_engine.errors import (
    ImageDecodeError,
    InvalidInputError,
    MediaError,
    MediaFetchError,
    MediaTooLargeError,
    MediaTypeError,
    RedirectError,
    UnsupportedSchemeError,
)
from kamera_sdk.media import FetchLimits, image_digest, load_image, load_video
from tests.vision.conftest import write_video


def png_bytes(size: tuple[int, int] = (24, 16), color: tuple[int, int, int] = (200, 30, 60)) -> bytes:
    img = Image.new("RGB", size, color)
    img.putpixel((3, 5), (0, 255, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


PNG = png_bytes()
BIG = 64 * 1024


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # keep pytest output quiet
        pass

    def _send(self, code: int, ctype: str, body: bytes, *, length: bool = True, extra: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        if length:
            self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(body)

    def do_GET(self) -> None:
        p = self.path
        if p == "/img.png":
            self._send(200, "image/png", PNG)
        elif p == "/big.png":  # honest Content-Length above the limit
            self._send(200, "image/png", b"\x89PNG" + b"\0" * BIG)
        elif p == "/big-chunked.png":  # no Content-Length: the limit is enforced while streaming
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(BIG // 1024 + 4):
                self.wfile.write(b"\0" * 1024)
        elif p == "/page.html":
            self._send(200, "text/html; charset=utf-8", b"<html>not an image</html>")
        elif p == "/garbage.png":
            self._send(200, "image/png", b"definitely not a png")
        elif p == "/loop-a":
            self._send(302, "text/plain", b"", extra={"Location": "/loop-b"})
        elif p == "/loop-b":
            self._send(302, "text/plain", b"", extra={"Location": "/loop-a"})
        elif p.startswith("/chain/"):
            n = int(p.rsplit("/", 1)[1])
            self._send(302, "text/plain", b"", extra={"Location": f"/chain/{n + 1}" if n < 20 else "/img.png"})
        elif p == "/hop":
            self._send(301, "text/plain", b"", extra={"Location": "/img.png"})
        elif p == "/to-file":
            self._send(302, "text/plain", b"", extra={"Location": "file:///etc/passwd"})
        elif p == "/bomb.png":  # a small gzip body that inflates far past the limit
            import gzip

            self._send(200, "image/png", gzip.compress(b"\0" * (BIG * 8)), extra={"Content-Encoding": "gzip"})
        elif p == "/missing":
            self._send(404, "text/plain", b"nope")
        else:
            self._send(404, "text/plain", b"")


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client that stops reading on purpose (a refused oversized body): nothing to report
        super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    srv = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


LIMITS = FetchLimits(timeout_s=5.0, deadline_s=10.0, max_bytes=BIG // 2, max_redirects=5)


def test_url_serves_a_real_png(server: str) -> None:
    img = load_image(f"{server}/img.png", limits=LIMITS)
    assert img.size == (24, 16) and img.mode == "RGB"
    assert img.getpixel((3, 5)) == (0, 255, 0)
    # the same picture from bytes, a path or a PIL image has the same digest
    assert image_digest(img) == image_digest(load_image(PNG)) == image_digest(Image.open(io.BytesIO(PNG)))


def test_url_follows_a_bounded_redirect(server: str) -> None:
    assert load_image(f"{server}/hop", limits=LIMITS).size == (24, 16)


def test_oversized_body_is_refused(server: str) -> None:
    with pytest.raises(MediaTooLargeError, match="Content-Length"):
        load_image(f"{server}/big.png", limits=LIMITS)
    with pytest.raises(MediaTooLargeError, match="stopped reading"):
        load_image(f"{server}/big-chunked.png", limits=LIMITS)


def test_wrong_content_type_is_refused(server: str) -> None:
    with pytest.raises(MediaTypeError, match="text/html"):
        load_image(f"{server}/page.html", limits=LIMITS)


def test_redirect_loop_and_too_many_redirects(server: str) -> None:
    with pytest.raises(RedirectError, match="loop"):
        load_image(f"{server}/loop-a", limits=LIMITS)
    with pytest.raises(RedirectError, match="more than 5 redirects"):
        load_image(f"{server}/chain/0", limits=LIMITS)


def test_refused_schemes_and_http_errors(server: str) -> None:
    with pytest.raises(UnsupportedSchemeError, match="'file'"):
        load_image("file:///etc/passwd")
    with pytest.raises(UnsupportedSchemeError, match="'ftp'"):
        load_image("ftp://127.0.0.1/x.png")
    with pytest.raises(UnsupportedSchemeError):  # a redirect to another scheme is re-checked
        load_image(f"{server}/to-file", limits=LIMITS)
    with pytest.raises(MediaFetchError, match="HTTP 404"):
        load_image(f"{server}/missing", limits=LIMITS)


def test_undecodable_inputs_raise_clear_errors(server: str, tmp_path: Path) -> None:
    with pytest.raises(ImageDecodeError, match="not a decodable image"):
        load_image(f"{server}/garbage.png", limits=LIMITS)
    with pytest.raises(ImageDecodeError):
        load_image(b"\x00\x01\x02")
    with pytest.raises(MediaError, match="not found"):
        load_image(tmp_path / "nope.png")
    with pytest.raises(InvalidInputError, match="PIL image, a path, bytes"):
        load_image(12345)
    path = tmp_path / "a.png"
    path.write_bytes(PNG)
    assert load_image(path).size == (24, 16) and load_image(str(path)).size == (24, 16)
    with pytest.raises(MediaTooLargeError, match="pixels"):
        load_image(Image.new("RGB", (100, 100)), limits=FetchLimits(max_pixels=50))
    for size in ((0, 0), (5, 0)):  # an image with no pixels: named, not a ZeroDivisionError in a processor
        with pytest.raises(ImageDecodeError, match=f"a {size[0]}x{size[1]} image has no pixels"):
            load_image(Image.new("RGB", size))


def test_video_file_decodes_samples_and_segments(tmp_path: Path) -> None:
    path = tmp_path / "clip.mp4"
    write_video(path)  # 12 frames at 4 fps = 3 s
    every = load_video(path, sample_fps=None)
    assert len(every) == 12
    sampled = load_video(path, sample_fps=2.0)
    assert len(sampled) == 6
    assert sampled.timestamps == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5])
    segs = sampled.segments(4)
    assert [len(s.frames) for s in segs] == [4, 2] and segs[1].index == 1
    assert segs[0].start_s == 0.0 and segs[1].start_s == pytest.approx(2.0)
    assert segs[0].digest() != segs[1].digest()
    assert len(load_video(path.read_bytes(), sample_fps=None, max_frames=5)) == 5
    with pytest.raises(ImageDecodeError, match="not a decodable video"):
        load_video(b"not a video at all")
    with pytest.raises(InvalidInputError, match="frames_per_segment"):
        sampled.segments(0)


def test_video_from_frames() -> None:
    frames = [Image.new("RGB", (16, 16), (i * 30, 0, 0)) for i in range(5)]
    video = load_video(frames, frames_fps=2.0)
    assert len(video) == 5 and video.timestamps[-1] == 2.0
    assert [len(s.frames) for s in video.segments(2)] == [2, 2, 1]
    with pytest.raises(InvalidInputError, match="at least one frame"):
        load_video([])


def test_a_compressed_body_is_refused_before_it_inflates(server: str) -> None:
    with pytest.raises(MediaFetchError, match=r"compressed response \(gzip\) refused"):
        load_image(f"{server}/bomb.png", limits=LIMITS)


def test_video_files_and_frames_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "clip.mp4"
    write_video(path)
    size = path.stat().st_size
    with pytest.raises(MediaTooLargeError, match="exceeds the limit"):
        load_video(path, limits=FetchLimits(max_video_bytes=size - 1))
    assert len(load_video(path, limits=FetchLimits(max_bytes=size - 1)).frames) > 0  # the image limit is not it
    with pytest.raises(MediaTooLargeError, match=r"\(a frame\): 32x32 exceeds the limit of 1000 pixels"):
        load_video(path, limits=FetchLimits(max_pixels=1000))
