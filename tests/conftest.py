"""Test configuration: Hypothesis profiles and where Triton kernels run.

Profiles: ``ci`` (default; small example counts so the suite fits CI) and
``thorough`` (``HYPOTHESIS_PROFILE=thorough``). Without CUDA, Triton kernels run
under the interpreter (``TRITON_INTERPRET=1`` is set here, before Triton is
imported); tests that run kernels carry the ``interpreter`` marker. With CUDA they run
compiled, on the GPU, through ``ple.testing.device.on_device`` (the tests' tensors stay on the CPU).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Test shapes are tiny: one thread avoids OpenMP contention (CI has 2 cores and runs other work).
torch.set_num_threads(1)

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    # Compiled kernels (a GPU machine): the tests build CPU tensors, so every public ple.fast op runs on
    # the GPU through ple.testing.device.on_device (inputs copied over, results and in-place changes
    # copied back). Patched before any test module imports ple.fast's names.
    import ple.fast
    from ple.backends import OP_NAMES
    from ple.testing.device import on_device

    for _name in (*OP_NAMES, "prefill_conv_inputs"):
        _fn = getattr(ple.fast, _name)
        _wrapped = on_device(_fn, "cuda")
        setattr(ple.fast, _name, _wrapped)
        _home = importlib.import_module(_fn.__module__)
        if getattr(_home, _name, None) is _fn:
            setattr(_home, _name, _wrapped)

settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    parser.addoption("--deep", action="store_true", default=False,
                     help="the deep tier: every test (those marked deep too), properties at the Hypothesis "
                          "profile's example counts (tests/_tier.py)")


def pytest_configure(config):
    import _tier

    _tier.DEEP = bool(config.getoption("--deep"))


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--deep"):
        quick, deep = [], []
        for item in items:
            (deep if "deep" in item.keywords else quick).append(item)
        if deep:
            config.hook.pytest_deselected(items=deep)
            items[:] = quick
    skip_triton = pytest.mark.skip(reason="triton is not installed (pip install -e '.[fast]')")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "interpreter" in item.keywords and not HAS_TRITON:
            item.add_marker(skip_triton)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def poisoned_empty():
    """Fresh buffers hold NaN (floats), -7 (int64 / int32 / int8) or 0xF9 (uint8) while the test runs: an element
    no kernel writes shows up as a mismatch. Kernel tests use it through
    ``pytestmark = pytest.mark.usefixtures("poisoned_empty")``; it is the kit's own context manager
    (``ple.testing.poisoned_empty``), so tests and the public checks poison alike."""
    from ple.testing.kit import poisoned_empty as poison

    with poison():
        assert torch.isnan(torch.empty(2)).all()
        yield


@pytest.fixture
def deterministic_mode():
    """``torch.use_deterministic_algorithms(True)`` while the test runs (``ple.fast._numerics.deterministic``);
    the previous mode after. Request it by name or with ``pytest.mark.usefixtures("deterministic_mode")``."""
    from _helpers import deterministic_algorithms

    with deterministic_algorithms():
        yield


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield
