"""Error hierarchy: the CLI prints any of these as one line and exits 2.

``InputError`` means the user's input is wrong (a file, a flag, a value);
``InfeasibleError`` means the input is fine but no plan satisfies it (memory);
``RuntimeFailure`` means a distributed run failed (a peer died, a timeout).
"""

from __future__ import annotations

__all__ = ["PipeplanError", "InputError", "InfeasibleError", "RuntimeFailure"]


class PipeplanError(Exception):
    """Base of every error pipeplan reports to a user without a traceback."""


class InputError(PipeplanError):
    """The user's input (file, flag, value) is invalid."""


class InfeasibleError(PipeplanError):
    """The input is valid but no plan satisfies its constraints."""


class RuntimeFailure(PipeplanError):
    """A distributed run failed: a peer died, a collective timed out."""
