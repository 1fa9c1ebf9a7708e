import os
import sys

import pytest

# The tests build tiny models locally; nothing may reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from layouts import TinyLayouts  # noqa: E402  (importable once the path above is set)


@pytest.fixture(scope="session")
def tiny_layouts(tmp_path_factory) -> TinyLayouts:
    return TinyLayouts(tmp_path_factory)


@pytest.fixture(scope="session")
def make_source(tiny_layouts):
    """make_source(arch="llama", layers=3, tie=True, seed=0, fresh=False, **config) -> the saved tiny model's folder."""
    return tiny_layouts.source


@pytest.fixture(scope="session")
def make_layout(tiny_layouts):
    """make_layout(arch="llama", layers=3, tie=True, seed=0, dtype=None, fresh=False, **config) -> its layout's folder."""
    return tiny_layouts.layout
