import json
import os

import pytest
import torch


def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    try:
        from moe_kernels import _native
        _native.library_for(torch.cuda.current_device())
    except Exception as e:  # no library for this GPU in this build
        return f"this build has no kernels for the GPU: {e}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class ErrorLog:
    """Largest relative error seen per label; written to $MOE_KERNELS_ERROR_REPORT at the end
    (under pytest-xdist, each worker to its own file: the path with the worker's id before
    the suffix)."""

    def __init__(self):
        self.worst = {}

    def add(self, label, err):
        self.worst[label] = max(self.worst.get(label, 0.0), float(err))


_LOG = ErrorLog()


@pytest.fixture(scope="session")
def error_log():
    return _LOG


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("MOE_KERNELS_ERROR_REPORT")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if path and worker:
        root, ext = os.path.splitext(path)
        path = f"{root}-{worker}{ext}"
    if path and _LOG.worst:
        with open(path, "w") as f:
            json.dump(dict(sorted(_LOG.worst.items())), f, indent=2)
