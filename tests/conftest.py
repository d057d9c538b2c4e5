"""Test configuration: Hypothesis profiles and where Triton kernels run.

Profiles: ``ci`` (default; small example counts so the suite fits CI) and
``thorough`` (``HYPOTHESIS_PROFILE=thorough``). Without CUDA, Triton kernels run
under the interpreter (``TRITON_INTERPRET=1`` is set here, before Triton is
imported); tests that run kernels carry the ``interpreter`` marker.
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

settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    skip_triton = pytest.mark.skip(reason="triton is not installed (pip install -e '.[fast]')")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "interpreter" in item.keywords and not HAS_TRITON:
            item.add_marker(skip_triton)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def poisoned_empty():
    """Fresh buffers hold NaN (floats) or -7 (int32/int64) while the test runs: an element no kernel
    writes shows up as a mismatch. Kernel tests use it through
    ``pytestmark = pytest.mark.usefixtures("poisoned_empty")``; it is the kit's own context manager
    (``ple.testing.poisoned_empty``), so tests and the public checks poison alike."""
    from ple.testing.kit import poisoned_empty as poison

    with poison():
        assert torch.isnan(torch.empty(2)).all()
        yield


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield
