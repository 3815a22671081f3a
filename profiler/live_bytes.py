"""Live tensor bytes inside a window of code: what the tensors it creates hold, now and at most.

``LiveBytes`` is a ``TorchDispatchMode``: it sees every op that runs while it is entered,
on the entering thread and on autograd's (the mode stack is thread-local state, which the
autograd engine hands to the threads that run a backward). For each output tensor it
records the untyped storage behind it, if that storage is new: not one of the op's inputs'
(a view or an in-place result is not new memory) nor one recorded before. A storage's
bytes count from the op that made it until ``weakref.finalize`` reports it freed (torch
keeps one Python object per storage while the storage lives, so its ``id`` is its key).
Storages that existed before the window never count, nor do meta ones; an empty one made
inside counts 0 bytes until an op resizes it (an ``out=`` argument).

What it counts is tensor storage bytes created inside the window: not the allocator's
cached blocks, nor a process's RSS. Those are what a device or the OS reports, and they
include caches and workspaces (the CUDA allocator's reserve, glibc's free lists) that
depend on what ran before, so the difference of two readings is not what a computation
needs; its live storages are, on any device.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes"]


def _storage(value: object) -> torch.UntypedStorage | None:
    """The storage behind a tensor output; None for other values, meta tensors and tensors
    without one (sparse, nested, some subclasses)."""
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return None
    try:
        return value.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class LiveBytes(TorchDispatchMode):
    """Within ``with LiveBytes() as live:``, ``live.live`` is the bytes of the storages made
    inside the block and not yet freed, and ``live.peak`` the most that ever were at once.

    >>> x = torch.ones(256)  # made before: never counted
    >>> with LiveBytes() as live:
    ...     y = x * 2  # 1 KiB
    ...     z = torch.ones(512) + 1  # 2 KiB for ones, 2 KiB for the sum; ones is freed at once
    ...     del y
    >>> live.peak, live.live
    (5120, 2048)
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id of a live storage made in the window -> its bytes
        self._finalizers: dict[int, weakref.finalize] = {}
        # finalizers run on whichever thread frees the storage, possibly inside _record
        self._lock = threading.RLock()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._record(out, (args, kwargs))
        return out

    def _record(self, out: object, given: object) -> None:
        # the storages the op was handed: a view, in-place or out= result shares one of them
        inputs = {id(s) for s in map(_storage, pytree.tree_leaves(given)) if s is not None}
        for storage in map(_storage, pytree.tree_leaves(out)):
            if storage is None:
                continue
            key, nbytes = id(storage), int(storage.nbytes())
            with self._lock:
                if key in self._sizes:  # made in the window; resized in place (an out= op)?
                    self.live += nbytes - self._sizes[key]
                    self._sizes[key] = nbytes
                elif key in inputs:
                    continue
                else:
                    self._sizes[key] = nbytes
                    self.live += nbytes
                    self._finalizers[key] = weakref.finalize(storage, self._freed, key)
                self.peak = max(self.peak, self.live)

    def _freed(self, key: int) -> None:
        with self._lock:
            self.live -= self._sizes.pop(key, 0)
            self._finalizers.pop(key, None)

    def created(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage was made inside the window and is alive (ask inside:
        after it, every answer is False)."""
        storage = _storage(tensor)
        return storage is not None and id(storage) in self._sizes

    def storage_bytes(self, tensor: torch.Tensor) -> int:
        """Bytes of ``tensor``'s storage if it was made inside the window and is alive, else 0."""
        storage = _storage(tensor)
        return 0 if storage is None else self._sizes.get(id(storage), 0)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        # the counts stop here: a storage freed later is no longer reported to this object
        with self._lock:
            for finalizer in self._finalizers.values():
                finalizer.detach()
            self._finalizers.clear()
            self._sizes.clear()  # ids of storages freed from now on may be reused
