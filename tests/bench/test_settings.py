"""The runtime settings a measurement may change (`dohnuts.bench.settings`)."""

import pytest

from dohnuts.bench import settings

pytest.importorskip("triton")  # the settings are the Triton kernels' modules'
from dohnuts.ops.delta_rule import scan  # noqa: E402
from dohnuts.ops.swiglu import fused as swiglu  # noqa: E402


@pytest.fixture
def restored():
    """Every known setting as it was before the test."""
    before = settings.current()
    yield
    settings.restore(before)


def test_settings_change_the_modules_the_kernels_read(restored):
    chosen = settings.apply(("scan.FWD_VALUES=32", "swiglu.BY_ROWS=1", "scan.ALONE_FROM=none", "swiglu.BLOCK=512"))
    assert scan.FWD_VALUES == 32 and swiglu.BY_ROWS is True and scan.ALONE_FROM is None and swiglu.BLOCK == 512
    assert chosen == settings.current() and chosen["scan.FWD_VALUES"] == 32
    settings.apply(("swiglu.BY_ROWS=0", "scan.ALONE_FROM=2048"))
    assert swiglu.BY_ROWS is False and scan.ALONE_FROM == 2048


@pytest.mark.parametrize("item, message", [
    ("scan.FWD_VALUES", "NAME=VALUE"), ("scan.WALK=1", "NAME=VALUE"), ("scan.FWD_VALUES=48", "takes 16, 32, 64, 128"),
    ("swiglu.BY_ROWS=2", "takes 0, 1"), ("conv.TOKENS=none", "takes 8, 16, 32, 64"),
    ("scan.ALONE_FROM=soon", "an integer from 0 to 2147483646 or none"),
    ("scan.ALONE_FROM=-5", "an integer from 0"), ("scan.ALONE_FROM=2147483647", "an integer from 0")])
def test_a_bad_setting_is_refused_by_name_and_nothing_is_set(restored, item, message):
    before = settings.current()
    with pytest.raises(ValueError, match=message):
        settings.apply(("scan.FWD_VALUES=32", item))  # a good one first: not set either
    assert settings.current() == before
