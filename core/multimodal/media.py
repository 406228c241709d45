"""Loading the images that chat messages name by URL, with the server's limits.

* ``data:image/...;base64,...`` URLs are decoded (the encoded size is checked before decoding);
* ``file://`` URLs read a local file only under ``--allowed-local-media-path`` (vLLM's flag;
  unset, they are refused); symlinks and ``..`` are resolved before the check;
* ``http(s)://`` URLs are fetched only from the hosts in ``--allowed-media-domains``. Unlike
  vLLM, which fetches any URL unless that flag restricts it, a server started without the flag
  fetches nothing: a request cannot make the server reach the network unless the operator
  said where. Redirects are not followed (a redirect could leave the allowed hosts).

Every image must decode with Pillow and stay within ``max_image_bytes`` (encoded) and
``max_image_pixels`` (width x height, read from the header before the pixels are decoded, so a
decompression bomb is refused cheaply). Problems raise ``MediaError`` (a ``ValueError``) with a
message for the client.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
from pathlib import Path
from typing import Any


class MediaError(ValueError):
    """An image input that cannot be used; the message says what was wrong and what is
    allowed."""


class MediaConnector:
    """Loads images by URL within a ``MultiModalConfig``'s limits."""

    def __init__(self, config: Any) -> None:
        self.config = config
        root = config.allowed_local_media_path
        self.allowed_root = Path(root).resolve() if root else None
        domains = config.allowed_media_domains or []
        self.allowed_domains = {d.lower().strip() for d in domains if d.strip()}

    # ------------------------------------------------------------------ URLs
    def load_image(self, url: str) -> Any:
        """The PIL image a URL names (``data:``, ``file:``, or an allowed ``http(s):``)."""
        if not isinstance(url, str) or not url:
            raise MediaError("image_url.url must be a non-empty string")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self.decode_image(self._data_url(url))
        if scheme == "file":
            return self.decode_image(self._local_file(url))
        if scheme in ("http", "https"):
            return self.decode_image(self._fetch(url))
        raise MediaError(
            f"image URL scheme {scheme or '(none)'!r} is not supported; use a data: URL "
            "(data:image/png;base64,...), a file:// URL under --allowed-local-media-path, or an "
            "http(s) URL of a host in --allowed-media-domains"
        )

    def _data_url(self, url: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep:
            raise MediaError("a data: URL needs a comma between its header and its data")
        media_type = header[len("data:") :].split(";")[0].strip().lower()
        if media_type and not media_type.startswith("image/"):
            raise MediaError(f"a data: URL of type {media_type!r} is not an image")
        if not header.lower().endswith(";base64"):
            raise MediaError("image data: URLs must be base64 encoded (data:image/...;base64,...)")
        limit = self.config.max_image_bytes
        if len(payload) * 3 // 4 > limit + 3:
            raise MediaError(self._too_big(len(payload) * 3 // 4))
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the data: URL's payload is not valid base64") from None
        if len(data) > limit:
            raise MediaError(self._too_big(len(data)))
        return data

    def _local_file(self, url: str) -> bytes:
        if self.allowed_root is None:
            raise MediaError(
                "file:// image URLs are not allowed: the server was started without "
                "--allowed-local-media-path"
            )
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(f"file:// URLs must name a local path, not host {parsed.netloc!r}")
        path = Path(urllib.parse.unquote(parsed.path)).resolve()
        if not path.is_relative_to(self.allowed_root):
            raise MediaError(
                f"{path} is outside the allowed local media directory (--allowed-local-media-path)"
            )
        try:
            size = path.stat().st_size
            if size > self.config.max_image_bytes:
                raise MediaError(self._too_big(size))
            with open(path, "rb") as f:
                return f.read(self.config.max_image_bytes + 1)
        except FileNotFoundError:
            raise MediaError(f"no such file: {path}") from None
        except IsADirectoryError:
            raise MediaError(f"{path} is a directory, not an image file") from None
        except PermissionError:
            raise MediaError(f"{path} cannot be read") from None

    def _fetch(self, url: str) -> bytes:
        host = (urllib.parse.urlparse(url).hostname or "").lower()
        if not self.allowed_domains:
            raise MediaError(
                "fetching image URLs over the network is off: start the server with "
                "--allowed-media-domains HOST... to allow hosts, or send the image as a data: URL"
            )
        if host not in self.allowed_domains:
            raise MediaError(
                f"image URL host {host!r} is not in --allowed-media-domains "
                f"({', '.join(sorted(self.allowed_domains))})"
            )
        import httpx

        limit = self.config.max_image_bytes
        try:
            with httpx.stream(
                "GET", url, timeout=self.config.media_fetch_timeout, follow_redirects=False
            ) as response:
                if response.status_code != 200:
                    raise MediaError(f"fetching the image URL returned HTTP {response.status_code}")
                declared = response.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > limit:
                    raise MediaError(self._too_big(int(declared)))
                chunks, total = [], 0
                for chunk in response.iter_bytes():
                    total += len(chunk)
                    if total > limit:
                        raise MediaError(self._too_big(total, at_least=True))
                    chunks.append(chunk)
        except httpx.HTTPError as e:
            raise MediaError(f"fetching the image URL failed: {type(e).__name__}: {e}") from None
        return b"".join(chunks)

    # ------------------------------------------------------------------ decoding
    def decode_image(self, data: bytes) -> Any:
        """A loaded RGB PIL image from encoded bytes, within the pixel limit."""
        from PIL import Image, UnidentifiedImageError

        if len(data) > self.config.max_image_bytes:
            raise MediaError(self._too_big(len(data)))
        try:
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > self.config.max_image_pixels:
                raise MediaError(
                    f"the image is {width} x {height} = {width * height} pixels; at most "
                    f"{self.config.max_image_pixels} are allowed (--max-image-pixels)"
                )
            image.load()
        except MediaError:
            raise
        except Image.DecompressionBombError:
            raise MediaError(
                f"the image has too many pixels (at most {self.config.max_image_pixels}, "
                "--max-image-pixels)"
            ) from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            raise MediaError(
                f"the image data is not an image Pillow can decode ({type(e).__name__}); send "
                "PNG, JPEG, WebP, GIF or BMP"
            ) from None
        return image.convert("RGB") if image.mode != "RGB" else image

    def check_image(self, image: Any) -> Any:
        """An image given as an object (offline ``multi_modal_data``): a PIL image within the
        pixel limit."""
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise MediaError(
                f"multi_modal_data images must be PIL.Image.Image objects, got "
                f"{type(image).__name__}"
            )
        width, height = image.size
        if width * height > self.config.max_image_pixels:
            raise MediaError(
                f"the image is {width} x {height} = {width * height} pixels; at most "
                f"{self.config.max_image_pixels} are allowed (max_image_pixels)"
            )
        return image

    def _too_big(self, size: int, at_least: bool = False) -> str:
        return (
            f"the image is {'over ' if at_least else ''}{size} bytes; at most "
            f"{self.config.max_image_bytes} bytes are allowed per image (--max-image-bytes)"
        )


def file_url(path: str | os.PathLike[str]) -> str:
    """The ``file://`` URL of a local path."""
    return Path(path).resolve().as_uri()
