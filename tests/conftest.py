import atexit
import fcntl
import os
import shutil
import tempfile

import pytest

# Before torch, as a program that uses zerolite imports it: torch's threads then wait passively
# (zerolite/openmp.py). Spinning, each xdist worker's threads took the core the other worker needed.
import zerolite  # noqa: F401

# The tests build tiny models locally; nothing may reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# What the tests convert and what they measure of the machine (zerolite.planner.measurements) stay
# out of the user's cache: a tiny test model's timings are no plan's business. The process that made
# the folder (pytest's controller; xdist's workers inherit the variable) removes it when it exits.
if "ZEROLITE_CACHE" not in os.environ:
    os.environ["ZEROLITE_CACHE"] = tempfile.mkdtemp(prefix="zerolite-tests-")
    atexit.register(shutil.rmtree, os.environ["ZEROLITE_CACHE"], ignore_errors=True)

from support.layouts import TinyLayouts  # noqa: E402  (after the cache folder above is chosen)


@pytest.fixture(scope="session")
def tiny_layouts(tmp_path_factory) -> TinyLayouts:
    return TinyLayouts(tmp_path_factory)


@pytest.fixture(scope="session")
def make_source(tiny_layouts):
    """make_source(arch="llama", layers=3, tie=True, seed=0, fresh=False, **config) -> the saved tiny model's folder."""
    return tiny_layouts.source


@pytest.fixture(scope="session")
def make_layout(tiny_layouts):
    """make_layout(arch="llama", layers=3, tie=True, seed=0, dtype=None, weights=None, group_size=None, fresh=False,
    **config) -> its layout's folder."""
    return tiny_layouts.layout


from support.simulated_device import SimulatedDevice  # noqa: E402
from zerolite.io.device import cuda_available  # noqa: E402

GPUS = ["sim", "cuda"]


def pytest_generate_tests(metafunc):
    """A test marked cuda runs once on the simulated device (everywhere, CI included) and once on
    a real GPU: the one skip rule, in gpu() below, for where there is none."""
    if metafunc.definition.get_closest_marker("cuda") and "gpu" in metafunc.fixturenames:
        metafunc.parametrize("gpu", GPUS, indirect=True)


@pytest.fixture
def gpu(request):
    """The device a cuda-marked test runs on: "cuda", or a SimulatedDevice whose ledger watches
    the whole test (an ordering error fails it), its models saying they are on "cuda" to transformers."""
    if request.param == "cuda":
        if not cuda_available():
            pytest.skip("needs a CUDA device")
        yield "cuda"
        return
    device = SimulatedDevice(seed=abs(hash(request.node.nodeid)) % 1000, reports_cuda=True)
    with device.watching():
        yield device


@pytest.fixture(autouse=True)
def alone_when_timed(request, tmp_path_factory):
    """Under pytest-xdist (make test runs a worker per core), a test marked `alone` judges timings,
    so it runs while no other test does: it takes a lock exclusively that every other test holds
    shared while it runs."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    with open(tmp_path_factory.getbasetemp().parent / "alone.lock", "a") as lock:  # the workers' common folder
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield
