"""A pytest plugin: a test that launches a process must carry the ``multiprocess`` marker.

CI runs the ``multiprocess`` tests in a lane of their own, one at a time, so that their gloo
ranks never share the 2 cores with other tests until their timeouts fire (``tests/lanes.py``).
An unmarked test that starts processes would run in a parallel lane instead; this guard makes
such a test fail wherever it runs, naming the test and the command it started.

Launching means starting, from the test process (the test, its fixtures or the code they call,
a ``CliRunner`` command included): a Python interpreter, ``torchrun`` or ``pipeplan`` through
``subprocess`` (``Popen``, so ``run`` and ``check_output`` too), or any ``multiprocessing``
process (``torch.multiprocessing`` included). Helpers that libraries start on their own
(matplotlib's ``fc-list``, ``ldconfig``) are not launches. The guard raises at the launch and,
in case the code under test swallowed that error, fails the test at teardown.

``tests/conftest.py`` registers this module; ``python -m pytest -p spawn_guard`` loads it elsewhere.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Generator, Sequence
from typing import Any

import pytest

__all__ = ["UnmarkedLaunchError", "is_process_launch"]

MARKER = "multiprocess"
_PROGRAMS = ("torchrun", "pipeplan")


class UnmarkedLaunchError(RuntimeError):
    """A test without the ``multiprocess`` marker launched a process."""


def is_process_launch(args: str | bytes | os.PathLike[str] | Sequence[Any], executable: Any = None) -> bool:
    """Whether ``subprocess.Popen(args, executable=executable)`` starts Python, torchrun or pipeplan.

    >>> is_process_launch([sys.executable, "-m", "pipeplan", "run"]), is_process_launch(["fc-list"])
    (True, False)
    >>> is_process_launch("torchrun --nproc-per-node 2 train.py")
    True
    """
    if executable is not None:
        program = os.fsdecode(executable)
    elif isinstance(args, (str, bytes, os.PathLike)):
        program = os.fsdecode(args).split(maxsplit=1)[0] if os.fsdecode(args).strip() else ""
    else:
        program = os.fsdecode(args[0]) if len(args) else ""
    name = os.path.basename(program)
    return program == sys.executable or name.startswith("python") or name in _PROGRAMS


class _Watch:
    """The test now running (None between tests) and the launches it made without the marker."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.unmarked_launches: list[str] = []

    def launched(self, what: str) -> None:
        if self.item is None or self.item.get_closest_marker(MARKER) is not None:
            return
        self.unmarked_launches.append(what)
        raise UnmarkedLaunchError(_message(self.item.nodeid, what))


_WATCH = _Watch()


def _message(nodeid: str, what: str) -> str:
    return (
        f"{nodeid} launches {what} but is not marked {MARKER}: add @pytest.mark.{MARKER} "
        f"(CI runs such tests one at a time, tests/lanes.py)"
    )


def _guard_popen(execute_child: Callable[..., Any]) -> Callable[..., Any]:
    # Popen.__init__ calls _execute_child with the caller's args (before any shell wrapping),
    # and closes the pipes it opened when that raises.
    def guarded(self: subprocess.Popen[Any], args: Any, executable: Any, *rest: Any, **kwargs: Any) -> Any:
        if is_process_launch(args, executable):
            _WATCH.launched(f"a process ({args!r})")
        return execute_child(self, args, executable, *rest, **kwargs)

    guarded.spawn_guarded = True  # type: ignore[attr-defined]
    return guarded


def _guard_start(start: Callable[[multiprocessing.process.BaseProcess], None]) -> Callable[..., None]:
    def guarded(self: multiprocessing.process.BaseProcess) -> None:
        _WATCH.launched(f"a multiprocessing process ({self.name})")
        start(self)

    return guarded


def pytest_configure(config: pytest.Config) -> None:
    if getattr(subprocess.Popen._execute_child, "spawn_guarded", False):  # type: ignore[attr-defined]
        return  # registered twice (conftest and -p spawn_guard)
    subprocess.Popen._execute_child = _guard_popen(subprocess.Popen._execute_child)  # type: ignore[attr-defined]
    multiprocessing.process.BaseProcess.start = _guard_start(  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    _WATCH.item, _WATCH.unmarked_launches = item, []
    try:
        return (yield)
    finally:
        _WATCH.item = None


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    if call.excinfo is not None and call.excinfo.errisinstance(UnmarkedLaunchError):
        _WATCH.unmarked_launches.clear()  # reported already: the test failed on the launch itself


@pytest.hookimpl(trylast=True)  # after the fixtures' own teardown, which must still run
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _WATCH.unmarked_launches:
        launches, _WATCH.unmarked_launches = _WATCH.unmarked_launches, []
        pytest.fail(_message(item.nodeid, " and ".join(launches)), pytrace=False)
