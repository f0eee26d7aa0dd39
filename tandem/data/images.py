"""Decoding untrusted image bytes with Pillow: one place that bounds their size and names what is wrong.

Images reach tandem from data files (verl's ``images`` column), from API clients (``data:``
URLs in ``image_url`` content parts) and from agent loops. Each goes through
:func:`decode_image`, which refuses bytes Pillow cannot read and pictures whose decoded size
exceeds a pixel limit *before* decoding them (the header gives the size; a small PNG can
declare a gigapixel canvas), and returns an RGB image.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path

from PIL import Image

DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DATA_URL = re.compile(
    r"data:(?P<mime>image/[A-Za-z0-9.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<payload>.*)", re.S
)


class ImageError(ValueError):
    """An image that cannot be used; the message says why (the caller adds where)."""


def decode_image(
    raw: bytes,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    limit: str | None = None,
    where: str | None = None,
) -> Image.Image:
    """``raw`` (PNG, JPEG, ... bytes) as an RGB PIL image; :class:`ImageError` when Pillow cannot
    read it or it has more than ``max_pixels`` pixels (``limit``: the setting to name), its
    message opening with ``where`` when given (a data file's row, field and image)."""
    try:
        return _decode(raw, max_pixels, limit)
    except ImageError as error:
        if where is None:
            raise
        raise ImageError(f"{where}: {error}") from None


def _decode(raw: bytes, max_pixels: int, limit: str | None) -> Image.Image:
    if not isinstance(raw, (bytes, bytearray, memoryview)) or not raw:
        raise ImageError(
            "the image is empty" if not raw else f"expected image bytes, got {type(raw).__name__}"
        )
    try:
        image = Image.open(io.BytesIO(bytes(raw)))
        width, height = image.size
        if width * height > max_pixels:
            over = f"over {limit}={max_pixels}" if limit else f"more than the limit of {max_pixels}"
            raise ImageError(f"the image is {width}x{height} = {width * height} pixels, {over}")
        image.load()
    except ImageError:
        raise
    except Image.DecompressionBombError as error:
        raise ImageError(f"the image is too large to decode safely ({error})") from error
    except Image.UnidentifiedImageError as error:
        raise ImageError("the bytes are not an image Pillow can read (no known format)") from error
    except Exception as error:  # Pillow raises many types for damaged bytes: all mean "not an image"
        raise ImageError(
            f"the bytes are not an image Pillow can read ({type(error).__name__}: {error})"
        ) from error
    return image.convert("RGB")


def decode_data_url(
    url: str,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_bytes: int | None = None,
    limit: str | None = None,
) -> Image.Image:
    """A ``data:image/...;base64,...`` URL's image (:func:`decode_image`, ``limit`` naming the pixel
    limit's setting); any other URL (``http:``, ``file:``, ...) is refused: the caller must never
    fetch what a client names."""
    if not isinstance(url, str) or not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if isinstance(url, str) and ":" in url else "no scheme"
        raise ImageError(
            f"only data: URLs are accepted (base64-encoded images); got a {scheme} URL, which is never fetched"
        )
    match = DATA_URL.fullmatch(url)
    if match is None:
        raise ImageError("a data: URL must look like data:image/png;base64,<payload>")
    payload = match.group("payload")
    if max_bytes is not None and len(payload) * 3 // 4 > max_bytes:
        raise ImageError(
            f"the image is about {len(payload) * 3 // 4} bytes, more than the limit of {max_bytes}"
        )
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(f"the data: URL's payload is not valid base64 ({error})") from error
    return decode_image(raw, max_pixels, limit)


def entry_bytes(entry: object, base_dir: Path | None = None) -> bytes:
    """The bytes of one entry of a data file's image list, as verl writes it: ``{"bytes": ...}`` or
    ``{"path": ...}`` (a relative path is taken from ``base_dir``, the data file's folder);
    :class:`ImageError` for a missing file, one that is not a regular file (``/dev/zero``, a
    folder, a pipe) or an entry that is neither.

    Paths are trusted as the rest of the data file is: an absolute path or one with ``..`` is
    read wherever it points (as verl does). Check a data file from elsewhere before training on it.
    """
    if isinstance(entry, (bytes, bytearray)):
        return bytes(entry)
    if not isinstance(entry, dict):
        raise ImageError(
            f"an image entry must be {{'bytes': ...}} or {{'path': ...}}, got {type(entry).__name__}"
        )
    raw = entry.get("bytes")
    if raw is not None:
        if not isinstance(raw, (bytes, bytearray)):
            raise ImageError(f"the image entry's 'bytes' must be bytes, got {type(raw).__name__}")
        return bytes(raw)
    path = entry.get("path")
    if not isinstance(path, str) or not path:
        raise ImageError(f"an image entry needs 'bytes' or a 'path', got keys {sorted(entry)}")
    file = Path(path) if base_dir is None or Path(path).is_absolute() else base_dir / path
    if not file.exists():
        raise ImageError(f"the image file {file} does not exist")
    if not file.is_file():
        raise ImageError(
            f"the image path {file} is not a regular file (a device, folder or pipe); name an image file"
        )
    return file.read_bytes()
