"""The suite runs on the CPU wherever it runs, GPU machines included.

Its multi-rank tests are gloo runs whose figures are CI's; with a GPU visible, a test plan
whose devices are GPUs takes NCCL and puts two ranks on a one-GPU machine's one GPU, and
profiles without ``--device`` measure on the GPU (on an H100 with torch 2.11, 31 tests
failed before a 320 s run was cut off; each cause was not read). So GPUs are hidden from
the test process and every process it starts, unless ``PIPEPLAN_TEST_CUDA=1`` asks for the
GPU tests (marker ``gpu``):

    PIPEPLAN_TEST_CUDA=1 python -m pytest -q -m gpu

Property tests (hypothesis) draw new cases on every developer run; under CI (``CI`` set) they
draw the same cases every time (``derandomize``), so a landing is judged on a fixed suite
and a case found locally becomes an ``@example`` or a fix, not a flaky CI run.
"""

import os

import pytest
from hypothesis import settings

if os.environ.get("PIPEPLAN_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read when CUDA initialises, which nothing has done yet

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    # A test that launches processes must be marked multiprocess (tests/spawn_guard.py).
    import spawn_guard

    if not config.pluginmanager.is_registered(spawn_guard):
        config.pluginmanager.register(spawn_guard, "spawn_guard")
