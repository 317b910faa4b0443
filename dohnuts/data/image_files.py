"""Images kept encoded until needed: a public source holds tens of thousands of them."""

from __future__ import annotations

import functools
import hashlib
import io
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from ..inputs.pixels import image_key

SUFFIXES = {"PNG": ".png", "JPEG": ".jpg", "GIF": ".gif", "WEBP": ".webp", "BMP": ".bmp", "TIFF": ".tif"}


@dataclass(frozen=True, eq=False)
class ImageFile:
    """An image as its file's bytes, with what partitioning needs of it without decoding again:
    the pixel digest (`image_key`, the isolation and cache key) and the size. Partitions write
    the bytes unchanged."""

    data: bytes
    suffix: str
    key: str
    size: tuple[int, int]

    @classmethod
    def from_bytes(cls, data: bytes) -> ImageFile:
        """Raises ValueError when the bytes are not an image Pillow can decode."""
        try:
            with Image.open(io.BytesIO(data)) as image:
                suffix = SUFFIXES.get(image.format or "", ".png")
                rgb = image.convert("RGB")
        except (UnidentifiedImageError, OSError) as error:
            raise ValueError(f"not an image Pillow can decode ({type(error).__name__})") from None
        if suffix == ".png" and (image.format or "PNG") != "PNG":
            suffix, data = ".png", _png(rgb)  # a format without a suffix of ours: store it as PNG
        return cls(data, suffix, image_key(rgb), rgb.size)

    def decoded(self) -> Image.Image:
        with Image.open(io.BytesIO(self.data)) as image:
            return image.convert("RGB")

    @functools.cached_property
    def file_name(self) -> str:
        """Its file in a partition folder, named by its bytes (hashed once: many rows share it)."""
        return f"images/{hashlib.sha256(self.data).hexdigest()[:32]}{self.suffix}"


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def pil_state(state):
    """The state with an ImageFile under "image" decoded (what `parse_request` takes)."""
    if isinstance(state, dict) and isinstance(state.get("image"), ImageFile):
        return {**state, "image": state["image"].decoded()}
    return state
