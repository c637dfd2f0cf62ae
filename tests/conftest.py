import os
import signal

import pytest
import torch

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    # A background job of a shell script starts with Ctrl-C ignored, and its children inherit that: the tests
    # that stop a run with SIGINT would see it ignored. A handler here is reset to the default in every child.
    signal.signal(signal.SIGINT, signal.default_int_handler)

if not torch.cuda.is_available():
    # Triton's interpreter runs the kernels on the CPU (tests/ops/test_kernels.py). It must be chosen before
    # anything imports triton; the ops themselves take the kernels on CUDA only.
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: runs compared bit for bit with runs in subprocesses or forks, which
    compute on one thread (OMP_NUM_THREADS=1), give the same sums."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _pinned_tiles(request):
    """On a GPU the Triton kernels would time their candidate launch settings at every new shape class (the
    tests' many small shapes: minutes in all); the tests run them pinned, except those marked ``unpinned``.
    ``benchmarks/kernel_tiles.py`` checks every candidate against the reference on the GPU."""
    if not torch.cuda.is_available() or "unpinned" in request.keywords:
        yield
        return
    from allhere.kernels import autotune

    with autotune.pinned():
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
