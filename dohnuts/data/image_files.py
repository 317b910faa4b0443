"""Images kept encoded until needed: a public source holds tens of thousands of them."""

from __future__ import annotations

import functools
import hashlib
import io
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from ..inputs.pixels import image_key
from ..schema import front_text, replaced_images

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


def is_image(value) -> bool:
    """An image of a state: decoded (PIL) or kept as its file (`ImageFile`)."""
    return isinstance(value, Image.Image | ImageFile)


def state_images(state) -> list:
    """The images of a state at any depth (mapping values, list items), in the order its JSON
    text places them."""
    found = []
    replaced(state, lambda image: found.append(image) or image)
    return found


def replaced(value, change):
    """`schema.replaced_images` of a state whose images are decoded or kept as files."""
    return replaced_images(value, change, is_image)


def pil_state(state):
    """The state with every `ImageFile` in it decoded (what `parse_request` takes)."""
    if isinstance(state, str):
        return state
    return replaced(state, lambda image: image.decoded() if isinstance(image, ImageFile) else image)


def shown_text(state) -> str:
    """The text a state is known by apart from its images (isolation, the guard, the vocabulary):
    `schema.front_text`, images decoded or kept as files."""
    return front_text(state, is_image)
