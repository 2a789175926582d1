"""Images from URLs, files and bytes, within limits, with errors that name the request field.

An image reaches the engine as a ``data:`` URL (base64), a ``file:`` URL
(only below ``--allowed-local-media-path``), an ``http(s)`` URL (fetched
within ``--media-fetch-timeout`` and ``--max-media-bytes``, only from
``--allowed-media-domains`` when set), or a ``PIL.Image`` (offline). Every
failure is a ``MediaError``: a ``ValueError`` carrying the request field to
blame (``param``) and the HTTP status (413 when the image is over the size
limit, else 400), so a bad image is refused before it reaches the engine.

Decoding (``decode_image``) refuses what PIL cannot read, formats outside
``SUPPORTED_FORMATS``, truncated files, and images whose header claims more
than ``max_pixels`` (a decompression bomb: a small file that would decode to
gigabytes), before any pixel is decoded. Imports no torch.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class MediaError(ValueError):
    """A bad image: ``param`` names the request field, ``status`` the HTTP status."""

    def __init__(self, message: str, param: str, status: int = 400) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.status = status


@dataclass(frozen=True)
class MediaLimits:
    """Where images may come from and how large they may be (``FrontendConfig``'s)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    fetch_timeout_s: float = 5.0
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000


def load_image(source: object, param: str, limits: MediaLimits) -> Image.Image:
    """An RGB image from a ``PIL.Image``, encoded bytes, or a data, file or http(s) URL
    (fetched here, blocking: the caller is off the event loop)."""
    if isinstance(source, Image.Image):
        width, height = source.size
        _check_pixels(width, height, param, limits)
        return source if source.mode == "RGB" else source.convert("RGB")
    if isinstance(source, (bytes, bytearray)):
        return decode_image(bytes(source), param, limits)
    if isinstance(source, str):
        return decode_image(read_url(source, param, limits), param, limits)
    raise MediaError(
        f"must be a PIL image, image bytes or a URL, got {type(source).__name__}", param
    )


def read_url(url: str, param: str, limits: MediaLimits) -> bytes:
    """The bytes an image URL names; http(s) URLs are fetched (blocking)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _read_data_url(url, param, limits)
    if scheme == "file":
        return _read_file_url(url, param, limits)
    if scheme in ("http", "https"):
        import httpx

        _check_domain(url, param, limits)
        deadline = time.monotonic() + limits.fetch_timeout_s
        try:
            with httpx.Client(
                timeout=limits.fetch_timeout_s, follow_redirects=_redirects(limits)
            ) as client:
                with client.stream("GET", url) as response:
                    _check_response(response.status_code, url, param)
                    chunks = []
                    size = 0
                    for chunk in response.iter_bytes():
                        size += len(chunk)
                        _check_size(size, param, limits)
                        if time.monotonic() > deadline:
                            raise _timeout(url, param, limits)
                        chunks.append(chunk)
                    return b"".join(chunks)
        except httpx.TimeoutException:
            raise _timeout(url, param, limits) from None
        except httpx.HTTPError as exc:
            raise MediaError(f"could not fetch {_short(url)}: {exc}", param) from None
    raise MediaError(f"unsupported URL {_short(url)}: use a data:, file: or http(s): URL", param)


async def fetch_url(url: str, param: str, limits: MediaLimits) -> bytes:
    """An http(s) URL's bytes, fetched without blocking the event loop (the limits as
    ``read_url``'s)."""
    import asyncio

    import httpx

    _check_domain(url, param, limits)

    async def fetch() -> bytes:
        async with httpx.AsyncClient(
            timeout=limits.fetch_timeout_s, follow_redirects=_redirects(limits)
        ) as client:
            async with client.stream("GET", url) as response:
                _check_response(response.status_code, url, param)
                chunks = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    _check_size(size, param, limits)
                    chunks.append(chunk)
                return b"".join(chunks)

    try:
        return await asyncio.wait_for(fetch(), limits.fetch_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise _timeout(url, param, limits) from None
    except httpx.HTTPError as exc:
        raise MediaError(f"could not fetch {_short(url)}: {exc}", param) from None


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def decode_image(data: bytes, param: str, limits: MediaLimits) -> Image.Image:
    """Decode an encoded image into RGB, refusing anything but a whole, sane image."""
    _check_size(len(data), param, limits)
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in SUPPORTED_FORMATS:
                raise MediaError(
                    f"unsupported image format {image.format} "
                    f"(supported: {', '.join(SUPPORTED_FORMATS)})",
                    param,
                )
            width, height = image.size
            _check_pixels(width, height, param, limits)
            image.load()
            return image.convert("RGB")
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError(
            f"is not an image in a supported format ({', '.join(SUPPORTED_FORMATS)})", param
        ) from None
    except Image.DecompressionBombError as exc:
        raise MediaError(f"image too large to decode: {exc}", param) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise MediaError(f"corrupt or truncated image: {exc}", param) from None


def _check_pixels(width: int, height: int, param: str, limits: MediaLimits) -> None:
    if width < 1 or height < 1:
        raise MediaError(f"image has no pixels ({width}x{height})", param)
    if width * height > limits.max_pixels:
        raise MediaError(
            f"image is {width}x{height} pixels, more than the {limits.max_pixels} allowed",
            param,
        )


def _check_size(num_bytes: int, param: str, limits: MediaLimits) -> None:
    if num_bytes > limits.max_bytes:
        raise MediaError(
            f"image is larger than the {limits.max_bytes} bytes allowed (--max-media-bytes)",
            param,
            status=413,
        )


def _read_data_url(url: str, param: str, limits: MediaLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("data URL has no ',' before its payload", param)
    media_type = header[5:].split(";", 1)[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise MediaError(f"data URL is {media_type}, not an image", param)
    if not header.endswith(";base64"):
        raise MediaError("data URL must be base64 (data:image/...;base64,...)", param)
    # Refuse before decoding: base64 holds 3 bytes per 4 characters.
    _check_size(len(payload) * 3 // 4, param, limits)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("data URL is not valid base64", param) from None


def _read_file_url(url: str, param: str, limits: MediaLimits) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise MediaError(
            "file: URLs are refused: the server allows no local media "
            "(start it with --allowed-local-media-path)",
            param,
        )
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"file URL {_short(url)} names a remote host", param)
    path = Path(urllib.parse.unquote(parsed.path)).resolve()
    allowed = Path(root).resolve()
    if os.path.commonpath([path, allowed]) != str(allowed):
        raise MediaError(f"{path} is outside the allowed local media path", param)
    try:
        _check_size(path.stat().st_size, param, limits)
        return path.read_bytes()
    except OSError as exc:
        raise MediaError(f"cannot read {path}: {exc.strerror or exc}", param) from None


def _check_domain(url: str, param: str, limits: MediaLimits) -> None:
    domains = limits.allowed_media_domains
    if domains is None:
        return
    host = (urllib.parse.urlparse(url).hostname or "").lower()
    if host not in domains:
        raise MediaError(
            f"{host or 'the URL'} is not among the allowed media domains (--allowed-media-domains)",
            param,
        )


def _redirects(limits: MediaLimits) -> bool:
    # A redirect could leave the allowed domains.
    return limits.allowed_media_domains is None


def _check_response(status: int, url: str, param: str) -> None:
    if status != 200:
        raise MediaError(f"fetching {_short(url)} returned HTTP {status}", param)


def _timeout(url: str, param: str, limits: MediaLimits) -> MediaError:
    return MediaError(
        f"fetching {_short(url)} took longer than {limits.fetch_timeout_s} s (--media-fetch-timeout)",
        param,
    )


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."
