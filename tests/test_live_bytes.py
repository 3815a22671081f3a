"""``LiveBytes``: the storage bytes made inside a window, now and at most, over known ops."""

from __future__ import annotations

import threading

import torch

from pipeplan.profiler.live_bytes import LiveBytes

KIB = 1024


def test_peak_and_live_follow_the_storages_made_and_freed() -> None:
    before = torch.ones(1024)  # 4 KiB made before the window: never counted
    with LiveBytes() as live:
        a = torch.ones(256)  # 1 KiB
        b = torch.ones(512) * 2  # 2 KiB for ones, freed at once, and 2 KiB for the product
        assert (live.live, live.peak) == (3 * KIB, 5 * KIB)
        del a
        c = before + 1  # 4 KiB: a new result of an old tensor counts
        assert (live.live, live.peak) == (6 * KIB, 6 * KIB)
        del b, c
        assert live.live == 0
        d = torch.ones(128, dtype=torch.float64)  # 1 KiB: dtype's element size, not float32's
        assert (live.live, live.peak) == (KIB, 6 * KIB)
    assert live.created(d) is False  # asked after the window: no answer
    del d
    assert live.live == KIB  # freed after the window: no longer reported


def test_views_in_place_results_and_old_storages_are_not_new() -> None:
    old = torch.ones(1024)
    with LiveBytes() as live:
        view = old[2:].view(-1, 2)  # shares old's storage
        old.mul_(3)  # in place
        torch.add(old, 1, out=old)  # out= an old tensor
        assert (live.live, live.peak) == (0, 0)
        new = torch.ones(256)
        new.add_(1)
        alias = new.t()
        assert (live.live, live.peak) == (KIB, KIB)  # new's storage, once
        assert live.created(alias) and live.storage_bytes(alias) == KIB
        assert not live.created(view) and live.storage_bytes(old) == 0
        out = torch.empty(0)
        torch.add(new, 1, out=out)  # resizes a storage made in the window: 0 -> 1 KiB
        assert (live.live, live.peak) == (2 * KIB, 2 * KIB)


def test_empty_and_meta_tensors_count_nothing() -> None:
    with LiveBytes() as live:
        torch.empty(0)
        meta = torch.ones(1 << 20, device="meta") * 2
        assert (live.live, live.peak) == (0, 0)
        assert meta.shape == (1 << 20,)


def test_the_backward_of_autograd_is_seen() -> None:
    """The mode sees the ops of a backward (on CPU autograd runs them on the calling thread,
    on a device's own thread elsewhere; either way under the caller's dispatch modes)."""
    x = torch.randn(4, 256, requires_grad=True)  # 4 KiB
    y = torch.softmax(x, -1)
    grad = torch.ones_like(y)
    threads: set[int] = set()

    class Watched(LiveBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            threads.add(threading.get_ident())
            return super().__torch_dispatch__(func, types, args, kwargs)

    with Watched() as live:
        y.backward(grad)
        # softmax's backward makes its 4 KiB result, which becomes x.grad
        assert (live.live, live.peak) == (4 * KIB, 4 * KIB)
        assert x.grad is not None and live.created(x.grad)
    assert threads == {threading.get_ident()}


def test_a_backward_run_on_another_thread_is_seen_there() -> None:
    x = torch.randn(8, 128, requires_grad=True)
    y = torch.softmax(x, -1) * 3
    grad = torch.ones_like(y)
    peaks: list[int] = []

    def run() -> None:
        with LiveBytes() as live:
            y.backward(grad)
        peaks.append(live.peak)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    # mul's backward: the gradient of the probabilities (4 KiB); softmax's: x.grad (4 KiB)
    assert peaks == [8 * KIB]
