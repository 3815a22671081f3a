"""Error hierarchy: the CLI prints any of these as one line and exits 2.

``InputError`` means the user's input is wrong (a file, a flag, a value);
``InfeasibleError`` means the input is fine but no plan satisfies it (memory);
``RuntimeFailure`` means a distributed run failed (a peer died, a timeout).
"""

from __future__ import annotations

__all__ = ["PipeplanError", "InputError", "InfeasibleError", "RuntimeFailure", "first_line", "one_line"]


class PipeplanError(Exception):
    """Base of every error pipeplan reports to a user without a traceback."""


class InputError(PipeplanError):
    """The user's input (file, flag, value) is invalid."""


class InfeasibleError(PipeplanError):
    """The input is valid but no plan satisfies its constraints."""


class RuntimeFailure(PipeplanError):
    """A distributed run failed: a peer died, a collective timed out."""


def first_line(exc: BaseException) -> str:
    r"""The first line of ``exc``'s message; its class name when the message is empty.

    >>> first_line(ValueError("bad\nmore")), first_line(KeyError())
    ('bad', 'KeyError')
    """
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def one_line(exc: BaseException) -> str:
    r"""``Class: first line`` of ``exc`` (the class alone when the message is empty).

    >>> one_line(ValueError("bad\nmore")), one_line(KeyError())
    ('ValueError: bad', 'KeyError')
    """
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
