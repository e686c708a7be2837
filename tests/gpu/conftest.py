"""The CUDA checks of issue #15: skipped where torch sees no GPU (CI), run by anyone who has one with
``python -m pytest tests/gpu`` (see README, "On a GPU")."""

from __future__ import annotations

import os

import pytest
import torch

# cuBLAS is deterministic only with a fixed workspace; set before any CUDA work in this process and
# in the ranks it spawns (they inherit the environment).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "tests/gpu/" in item.nodeid.replace(os.sep, "/"):
            item.add_marker(skip)
