"""Images kept encoded: the bytes unchanged, the pixel digest of the decoded image, clear errors."""

import io

import pytest
from PIL import Image

from dohnuts.data.image_files import ImageFile, pil_state
from dohnuts.inputs.pixels import image_key


def _encoded(fmt, **save) -> tuple[bytes, Image.Image]:
    image = Image.new("RGB", (30, 20), (10, 120, 200))
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue(), image


def test_an_image_file_keeps_its_bytes_and_knows_its_pixels_without_decoding_again():
    data, image = _encoded("PNG")
    file = ImageFile.from_bytes(data)
    assert file.data == data and file.suffix == ".png" and file.size == (30, 20)
    assert file.key == image_key(image) == image_key(file.decoded())
    assert file.file_name.startswith("images/") and file.file_name.endswith(".png")
    jpeg, _ = _encoded("JPEG", quality=95)
    assert ImageFile.from_bytes(jpeg).suffix == ".jpg" and ImageFile.from_bytes(jpeg).data == jpeg
    state = pil_state({"caption": "x", "image": file})
    assert isinstance(state["image"], Image.Image) and state["caption"] == "x"


def test_bytes_that_are_no_image_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="not an image Pillow can decode"):
        ImageFile.from_bytes(b"<html>not an image</html>")
