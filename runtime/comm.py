"""Point-to-point transfers between stages: non-blocking, tagged, bounded waits.

A message is identified by ``(value, unit, direction)``: ``value`` the index of a
value name that crosses a cut (every rank numbers them the same way), ``unit`` the work
unit ``minibatch * microbatches + microbatch``, ``direction`` ``FORWARD`` (an
activation) or ``BACKWARD`` (its gradient). On gloo the three are packed into the
message tag, so receives may be posted long before they are needed, in any order. On
NCCL tags are ignored: receives are posted when they are waited on, in schedule order,
which both sides of every pair follow: the executor walks values by their global message id.

One forward message per unit and peer: the activations a stage sends to one rank for one
unit travel packed in one byte buffer (``pack_tensors``), tagged as its first value, because
each message costs a wakeup of both ranks' communication threads: on a 2-core machine, a
tiny Llama's three values per cut (hidden states, rotary cos and sin) made its ranks wait
about twice its compute at 4 micro-batches (issue 31). Both ends know which values a message
holds: the sender the values it sends that rank, the receiver the values its chunks read
from that stage, the same set. Gradients travel back the same way (``send_gradients``), one
message per backward, peer and producing stage: GPT-NeoX's and T5's three gradients per cut
took three messages, and their runs 1.29x and 1.22x their predicted time at 4 micro-batches.

Where units overlap on gloo (more than one micro-batch, or a schedule without flushes),
one thread per rank posts every send and receive, in the order the executor starts them:
gloo's ``isend`` and ``irecv`` take the connection's lock, which its communication thread
holds while it reads, so with traffic both ways a call blocked the executor for 0.25-0.5 ms
(a tiny Llama at 4 micro-batches on 2 ranks: 1,203 isends took 0.62 s of 3.6 s). The
executor gets a handle at once; a failure to post is raised by its wait. With one unit at a
time the ranks take turns, an inline post does not wait, and the thread's hand-offs of the
GIL cost more than they save (GPT-2 at one micro-batch: 3.6-4.6 ms inline, 5.3-5.4 ms with
the thread), so those runs post inline.

Shape handshake: the first activation on each (peer, value) channel is preceded by a
small header (rank, dtype, shape); afterwards the receiver pre-allocates buffers from
the cached header. Gradients need no header: their producer knows the activation.

Every wait is bounded (``timeout_s``); a failure or timeout raises ``RuntimeFailure``
naming this rank, the peer rank and the message.

A message to this rank itself (two chunks of an interleaved schedule on one rank) never
touches the backend: ``send`` leaves a copy in a local mailbox and ``wait`` takes it, so
it cannot deadlock and does not enter any pair's posting order. The schedule runs the
sending action first on this rank, so the mail is always there when waited for.
"""

from __future__ import annotations

import math
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeplan.errors import RuntimeFailure, first_line

__all__ = [
    "FORWARD",
    "BACKWARD",
    "TensorSpec",
    "PendingRecv",
    "P2P",
    "PeerFailure",
    "message_tag",
    "pack_tensors",
    "unpack_tensors",
    "short_reason",
]

FORWARD = 0
BACKWARD = 1
REAP_SCAN = 8  # pending sends ``P2P.reap`` looks at per call (the oldest)
_HEADER_LEN = 16  # int64: [ndim, dtype code, requires_grad, dim0, dim1, ...]
_PACK_ALIGN = 16  # bytes: each value of a packed message starts where any dtype may view it
_MAX_TAG = 2**31 - 1
_MIN_TAG_WINDOW = 1 << 16  # work units between two uses of one tag (units in flight are far fewer)
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def short_reason(exc: BaseException) -> str:
    """The first line of a (gloo/NCCL) error without source locations and boilerplate.

    >>> short_reason(RuntimeError("[/x/gloo/pair.cc:553] Connection closed by peer [1.2.3.4]:5. "
    ...                           "This is typically caused by a remote worker crashing."))
    'Connection closed by peer [1.2.3.4]:5'
    """
    text = first_line(exc)
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0].strip()[:200]


class PeerFailure(RuntimeFailure):
    """A transfer with ``peer`` failed or timed out (the peer probably died)."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    # an activation's header: whether its producer takes a gradient of it back (issue 31)
    requires_grad: bool = False

    @classmethod
    def of(cls, tensor: torch.Tensor, requires_grad: bool = False) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype, requires_grad)

    def encode(self, device: str) -> torch.Tensor:
        """``[ndim, dtype code, requires_grad, dim0, dim1, ...]`` as int64.

        >>> TensorSpec.decode(TensorSpec((2, 3), torch.float32, True).encode("cpu"))
        TensorSpec(shape=(2, 3), dtype=torch.float32, requires_grad=True)
        """
        if len(self.shape) > _HEADER_LEN - 3:
            raise RuntimeFailure(f"cannot send a tensor of {len(self.shape)} dims (max {_HEADER_LEN - 3})")
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header[0] = len(self.shape)
        header[1] = _DTYPES.index(self.dtype)
        header[2] = int(self.requires_grad)
        header[3 : 3 + len(self.shape)] = torch.tensor(self.shape, dtype=torch.int64)
        return header.to(device)

    @classmethod
    def decode(cls, header: torch.Tensor) -> TensorSpec:
        values = header.cpu().tolist()
        ndim = int(values[0])
        return cls(tuple(int(v) for v in values[3 : 3 + ndim]), _DTYPES[int(values[1])], bool(values[2]))


def message_tag(value: int, values: int, unit: int, direction: int, header: bool = False) -> int:
    """The gloo tag of one message: unique per (value, unit, direction, header?).

    >>> message_tag(1, 3, 0, FORWARD), message_tag(1, 3, 0, BACKWARD), message_tag(0, 3, 1, FORWARD)
    (4, 6, 12)
    """
    window = (_MAX_TAG + 1) // (values * 4)  # work units that fit in the tag space
    if window < _MIN_TAG_WINDOW:
        raise RuntimeFailure(
            f"message tags: {values} values crossing cuts leave room for only {window} work "
            f"units (need {_MIN_TAG_WINDOW})"
        )
    # Units wrap around the window: a tag is reused only 2**31 / (4 * values) units later
    # (>= 65,536), far more than are ever in flight between two ranks, so no run length
    # overflows the 31-bit tag.
    return (((unit % window) * values + value) * 2 + direction) * 2 + int(header)


def _packed_extent(spec: TensorSpec) -> int:
    nbytes = math.prod(spec.shape) * spec.dtype.itemsize
    return -(-nbytes // _PACK_ALIGN) * _PACK_ALIGN


def pack_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contiguous ``tensors`` as one uint8 buffer, each at an offset aligned to 16 bytes.

    >>> a, b = torch.arange(3.0), torch.tensor([True, False])
    >>> packed = pack_tensors([a, b])
    >>> packed.numel(), [t.tolist() for t in unpack_tensors(packed, [TensorSpec.of(a), TensorSpec.of(b)])]
    (32, [[0.0, 1.0, 2.0], [True, False]])
    """
    specs = [TensorSpec.of(t) for t in tensors]
    buffer = torch.empty(sum(map(_packed_extent, specs)), dtype=torch.uint8, device=tensors[0].device)
    offset = 0
    for tensor, spec in zip(tensors, specs):
        nbytes = tensor.numel() * tensor.element_size()
        buffer[offset : offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        offset += _packed_extent(spec)
    return buffer


def unpack_tensors(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """The tensors ``pack_tensors`` packed, as leaves sharing ``buffer``'s memory (no copy)."""
    out = []
    offset = 0
    for spec in specs:
        nbytes = math.prod(spec.shape) * spec.dtype.itemsize
        out.append(buffer[offset : offset + nbytes].view(spec.dtype).view(spec.shape).detach())
        offset += _packed_extent(spec)
    return out


def packed_bytes(specs: Sequence[TensorSpec]) -> int:
    """The size of the buffer ``pack_tensors`` makes of tensors with ``specs``."""
    return sum(map(_packed_extent, specs))


@dataclass
class PendingRecv:
    """A receive posted (or deferred until its header arrives / until its wait on NCCL)."""

    peer: int
    value: int
    unit: int
    direction: int
    label: str  # for errors and traces: "recv F3 <-r1"
    spec: TensorSpec | None
    buffer: torch.Tensor | None = None
    work: dist.Work | None = None
    # a packed message (several values): its values, and their shapes (forward: once the headers came)
    packed: tuple[int, ...] = ()
    specs: tuple[TensorSpec, ...] | None = None


def _work_of(op: Callable[..., Any], tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
    work = op(tensor, peer, tag=tag)
    if work is None:  # torch's answer for a rank outside the group, which no peer is
        raise RuntimeError(f"rank {peer} is not in the process group")
    return work


class _Posted:
    """A gloo send or receive handed to the posting thread; a ``dist.Work`` once posted."""

    __slots__ = ("future",)

    def __init__(self, future: Future[dist.Work]) -> None:
        self.future = future

    def is_completed(self) -> bool:
        if not self.future.done():
            return False
        return self.future.exception() is not None or self.future.result().is_completed()

    def wait(self, timeout: timedelta) -> None:
        """Posted and completed within ``timeout`` each; a failure to post raises here."""
        try:
            work = self.future.result(timeout=timeout.total_seconds())
        except FutureTimeout:
            raise RuntimeError("Timed out: the posting thread did not start the message") from None
        work.wait(timeout=timeout)


class _Poster:
    """One daemon thread that runs posts in the order they come: a daemon, so a post stuck in
    a dead peer's connection never holds the interpreter's exit."""

    def __init__(self) -> None:
        self.failed = False  # a post raised: its future holds the error
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pipeplan-p2p", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((fn, args, future))
        return future

    def stop(self) -> None:
        """Stop after the posts already submitted (does not wait for them)."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args, future = item
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiter, which names the message
                self.failed = True
                future.set_exception(exc)


@dataclass
class _PendingSend:
    work: dist.Work
    tensor: torch.Tensor
    peer: int
    label: str
    start_ms: float
    unit: int = 0  # the work unit of the message (a header: of the message it precedes)
    activations: tuple[int, ...] = ()  # the values a forward message (or its header) carries
    gradients: tuple[int, ...] = ()  # the values a backward message carries the gradient of
    header: bool = False  # a channel's header: it carries none of its value's data

    @property
    def message(self) -> tuple[int, int]:
        """(bytes, values) of the message, as it went: a packed one with its alignment."""
        return self.tensor.nbytes, 0 if self.header else len(self.activations) + len(self.gradients)


class P2P:
    """Tagged non-blocking sends/receives of one rank; see the module docstring.

    ``on_send_done(label, peer, start_ms, end_ms, message)`` is called when a send is seen
    complete (for traces; ``message`` is (bytes, values it carries)). Times are
    ``time.perf_counter()`` in milliseconds. ``post_thread`` (gloo only) posts from the
    posting thread.
    """

    def __init__(
        self,
        rank: int,
        values: int,
        device: str,
        timeout_s: float,
        tagged: bool,
        on_send_done: Callable[[str, int, float, float, tuple[int, int]], None] | None = None,
        post_thread: bool = False,
    ) -> None:
        self.rank = rank
        self.values = max(1, values)
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.tagged = tagged
        self.post_thread = post_thread and tagged  # NCCL posts inline: its calls do not block
        self._on_send_done = on_send_done
        self._sent_header: set[tuple[int, int]] = set()  # (peer, value)
        self._specs: dict[tuple[int, int], TensorSpec] = {}  # (peer, value) -> header
        self._header_work: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._sends: list[_PendingSend] = []
        self._mailbox: dict[tuple[int, int, int], list[torch.Tensor]] = {}  # to this rank itself
        self._own_grads: dict[int, bool] = {}  # value -> requires_grad of this rank's own sends
        self._poster: _Poster | None = None  # gloo: the posting thread, from the first message

    # ------------------------------------------------------------------ sending
    def send(
        self,
        tensor: torch.Tensor,
        peer: int,
        value: int,
        unit: int,
        direction: int,
        label: str,
        requires_grad: bool = True,
    ) -> None:
        """Start sending ``tensor``; the first activation on a channel carries a header, which
        says whether the producer takes its gradient back (``requires_grad``: the same for
        every unit of the channel; ``expects_gradient`` reads it at the receiver)."""
        if peer == self.rank:
            self._mailbox.setdefault((value, unit, direction), []).append(tensor.detach().clone())
            if direction == FORWARD:
                self._own_grads[value] = requires_grad
            return
        tensor = tensor.detach().contiguous()
        start = time.perf_counter() * 1000.0
        if direction == FORWARD:
            self._send_header(tensor, peer, value, unit, label, requires_grad, start)
        self._send_message(tensor, peer, [value], unit, direction, label, start)

    def send_activations(
        self,
        tensors: Sequence[torch.Tensor],
        peer: int,
        values: Sequence[int],
        unit: int,
        label: str,
        requires_grad: Sequence[bool],
    ) -> None:
        """Start sending one unit's activations ``tensors`` (of ``values``, in message order)
        to ``peer``: one message, packed when there are several (see the module docstring)."""
        self._send_values(tensors, peer, values, unit, FORWARD, label, requires_grad)

    def send_gradients(
        self, tensors: Sequence[torch.Tensor], peer: int, values: Sequence[int], unit: int, label: str
    ) -> None:
        """Start sending the gradients ``tensors`` of ``values`` (in message order) for ``unit``
        to ``peer``: one message, packed when there are several. No header: the receiver
        produced the values, so it knows their shapes (``post_packed`` with ``specs``)."""
        self._send_values(tensors, peer, values, unit, BACKWARD, label, [True] * len(tensors))

    def _send_values(
        self,
        tensors: Sequence[torch.Tensor],
        peer: int,
        values: Sequence[int],
        unit: int,
        direction: int,
        label: str,
        requires_grad: Sequence[bool],
    ) -> None:
        """One unit's ``tensors`` to ``peer`` as one message (``send``'s way for one value or
        this rank itself); activations after their channels' headers."""
        if len(tensors) == 1 or peer == self.rank:
            for tensor, value, grad in zip(tensors, values, requires_grad):
                self.send(tensor, peer, value, unit, direction, label, grad)
            return
        start = time.perf_counter() * 1000.0
        tensors = [tensor.detach().contiguous() for tensor in tensors]
        if direction == FORWARD:
            for tensor, value, grad in zip(tensors, values, requires_grad):
                self._send_header(tensor, peer, value, unit, label, grad, start)
        self._send_message(pack_tensors(tensors), peer, values, unit, direction, label, start)

    def _send_message(
        self,
        tensor: torch.Tensor,
        peer: int,
        values: Sequence[int],
        unit: int,
        direction: int,
        label: str,
        start: float,
    ) -> None:
        """Start sending ``tensor``, the message of ``values`` (activations or their gradients),
        tagged as the first one's; it stays pending until waited on."""
        work = self._isend(tensor, peer, message_tag(values[0], self.values, unit, direction), label)
        carried = tuple(values)
        if direction == FORWARD:
            send = _PendingSend(work, tensor, peer, label, start, unit, activations=carried)
        else:
            send = _PendingSend(work, tensor, peer, label, start, unit, gradients=carried)
        self._sends.append(send)
        self.reap()

    def _send_header(
        self, tensor: torch.Tensor, peer: int, value: int, unit: int, label: str, grad: bool, start: float
    ) -> None:
        """The (peer, value) channel's header, before its first activation."""
        if (peer, value) in self._sent_header:
            return
        header = TensorSpec.of(tensor, grad).encode(self.device)
        work = self._isend(header, peer, message_tag(value, self.values, 0, FORWARD, True), label)
        self._sends.append(
            _PendingSend(work, header, peer, f"{label} (header)", start, unit, (value,), header=True)
        )
        self._sent_header.add((peer, value))

    def _start(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """Start ``op`` (``dist.isend`` or ``dist.irecv``), from the posting thread where
        ``post_thread`` (see the module docstring), else here; in posting order."""
        if not self.post_thread:
            return _work_of(op, tensor, peer, tag if self.tagged else 0)
        if self._poster is None:
            self._poster = _Poster()
        return _Posted(self._poster.submit(_work_of, op, tensor, peer, tag))

    def _isend(self, tensor: torch.Tensor, peer: int, tag: int, label: str) -> Any:
        try:
            return self._start(dist.isend, tensor, peer, tag)
        except Exception as exc:
            raise self._failure(f"sending {label}", peer, exc) from exc

    def reap(self) -> None:
        """Forget sends that completed (reporting their end time), looking at the oldest
        ``REAP_SCAN`` only: O(1) per call however many are pending.

        On gloo (``tagged``) it looks at none: its point-to-point sends never report
        completion before they are waited on (``release`` and ``finish`` wait for them), so
        a scan found nothing, at a cost (``bench/exchange_only.py`` on 2 ranks, M = 4: 2.61 ms
        per minibatch and 3.7 ms of CPU with it, 2.41 and 3.5 without; issue 31). A post that
        failed on the posting thread is still raised here, at the next action."""
        if self.tagged:
            if self._poster is not None and self._poster.failed:
                for send in self._sends:
                    if send.work.is_completed():  # a failed post reads completed: raise its error
                        self._wait(send.work, f"sending {send.label}", send.peer)
            return
        now = time.perf_counter() * 1000.0
        still: list[_PendingSend] = []
        for send in self._sends[:REAP_SCAN]:
            if send.work.is_completed():
                self._wait(send.work, f"sending {send.label}", send.peer)  # raises its error
                if self._on_send_done is not None:
                    self._on_send_done(send.label, send.peer, send.start_ms, now, send.message)
            else:
                still.append(send)
        self._sends[:REAP_SCAN] = still

    def release(self, before_unit: int) -> int:
        """Wait (bounded) for the sends of units before ``before_unit``, known received, and
        drop them and the tensors they hold; returns how many. The caller vouches that every
        peer consumed them (a flush schedule at a step: ``Executor._step``), so the waits
        return at once; without this a gloo run held every activation it sent until the end."""
        return self._release(lambda send: send.unit < before_unit)

    def release_taken(self, peer: int, value: int, unit: int) -> int:
        """Wait for and drop the forward messages (and headers) to ``peer`` that carried
        ``value`` for ``unit``; returns how many. The caller received ``value``'s gradient for
        ``unit`` from ``peer``, which ``peer`` computed after the forward that took them, so
        the waits return at once. Without it and ``release_gradients`` gloo, whose sends report
        completion only once waited on, kept each message sent until a step released it (the
        demo's 1F1B-RR: up to 3.0-3.5 MiB of sends per rank, 1.0 MiB with both; issue 31)."""
        return self._release(lambda s: s.peer == peer and s.unit == unit and value in s.activations)

    def release_gradients(self, peer: int, unit: int, values: frozenset[int]) -> int:
        """Wait for and drop the gradient messages to ``peer`` of ``values`` for ``unit``; returns
        how many. The caller knows ``peer`` ran the backward that took them (a later forward of
        ``peer``'s reached it: ``Executor._gradients_taken``), so the waits return at once."""
        return self._release(
            lambda s: s.peer == peer and s.unit == unit and not values.isdisjoint(s.gradients)
        )

    def _release(self, taken: Callable[[_PendingSend], bool]) -> int:
        """Wait (bounded) for the pending sends ``taken`` picks, reporting each one's end, and
        drop them and the tensors they hold; returns how many."""
        done: list[_PendingSend] = []
        still: list[_PendingSend] = []
        for send in self._sends:
            (done if taken(send) else still).append(send)
        if not done:
            return 0
        self._sends = still
        for send in done:
            self._wait(send.work, f"sending {send.label}", send.peer)
            if self._on_send_done is not None:
                end = time.perf_counter() * 1000.0
                self._on_send_done(send.label, send.peer, send.start_ms, end, send.message)
        return len(done)

    def expects_gradient(self, peer: int, value: int) -> bool:
        """Whether ``peer`` takes the gradient of ``value`` back (its header's flag), once an
        activation of that channel was received; a channel without a header yet: True."""
        if peer == self.rank:
            return self._own_grads.get(value, True)
        spec = self._specs.get((peer, value))
        return spec.requires_grad if spec is not None else True

    @property
    def pending_sends(self) -> int:
        """Sends started and not yet seen complete."""
        return len(self._sends)

    def finish(self) -> None:
        """Wait (bounded) until every send completed (each work is waited on once), and stop
        the posting thread (a later message starts another)."""
        self._release(lambda send: True)
        if self._poster is not None:
            self._poster.stop()
            self._poster = None

    # ---------------------------------------------------------------- receiving
    def post(
        self, peer: int, value: int, unit: int, direction: int, label: str, spec: TensorSpec | None = None
    ) -> PendingRecv:
        """Post a receive now where possible (gloo, header known); ``wait`` completes it."""
        pending = PendingRecv(peer, value, unit, direction, label, spec)
        if self.tagged and peer != self.rank:
            self._advance(pending, block=False)
        return pending

    def post_packed(
        self,
        peer: int,
        values: Sequence[int],
        unit: int,
        direction: int,
        label: str,
        specs: Sequence[TensorSpec] | None = None,
    ) -> PendingRecv:
        """Post the receive of a packed message from another rank: ``send_activations``'
        (``FORWARD``; their headers give the shapes) or ``send_gradients``' (``BACKWARD``, with
        ``specs``), ``values`` in message order, two or more; ``wait_packed`` completes it."""
        known = tuple(specs) if specs is not None else None
        pending = PendingRecv(
            peer, values[0], unit, direction, label, None, packed=tuple(values), specs=known
        )
        if self.tagged:
            self._advance(pending, block=False)
        return pending

    def wait_packed(self, pending: PendingRecv) -> list[torch.Tensor]:
        """The tensors of a posted packed message, in its values' order."""
        self._advance(pending, block=True)
        self._wait(pending.work, f"receiving {pending.label}", pending.peer)
        assert pending.buffer is not None and pending.specs is not None
        return unpack_tensors(pending.buffer, pending.specs)

    def wait(self, pending: PendingRecv) -> torch.Tensor:
        """The received tensor; blocks at most ``timeout_s`` per message."""
        if pending.peer == self.rank:
            mail = self._mailbox.get((pending.value, pending.unit, pending.direction))
            if not mail:
                raise RuntimeFailure(
                    f"rank {self.rank}: {pending.label}: nothing was sent to this rank itself"
                )
            value = mail.pop(0)
            if not mail:
                del self._mailbox[(pending.value, pending.unit, pending.direction)]
            return value
        self._advance(pending, block=True)
        self._wait(pending.work, f"receiving {pending.label}", pending.peer)
        assert pending.buffer is not None
        return pending.buffer

    def _advance(self, pending: PendingRecv, block: bool) -> None:
        if pending.work is not None:
            return
        if pending.packed:
            if pending.specs is None:
                specs = [self._header(pending.peer, v, pending.label, block) for v in pending.packed]
                if any(spec is None for spec in specs):
                    return
                pending.specs = tuple(spec for spec in specs if spec is not None)
            size = packed_bytes(pending.specs)
            pending.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        else:
            if pending.spec is None:
                pending.spec = self._header(pending.peer, pending.value, pending.label, block)
                if pending.spec is None:
                    return
            pending.buffer = torch.empty(pending.spec.shape, dtype=pending.spec.dtype, device=self.device)
        tag = message_tag(pending.value, self.values, pending.unit, pending.direction)
        try:
            pending.work = self._start(dist.irecv, pending.buffer, pending.peer, tag)
        except Exception as exc:
            raise self._failure(f"receiving {pending.label}", pending.peer, exc) from exc

    def _header(self, peer: int, value: int, label: str, block: bool) -> TensorSpec | None:
        channel = (peer, value)
        if channel in self._specs:
            return self._specs[channel]
        if channel not in self._header_work:
            buffer = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            tag = message_tag(value, self.values, 0, FORWARD, True)
            try:
                work = self._start(dist.irecv, buffer, peer, tag)
            except Exception as exc:
                raise self._failure(f"receiving {label} (header)", peer, exc) from exc
            self._header_work[channel] = (work, buffer)
        work, buffer = self._header_work[channel]
        if not block and not work.is_completed():
            return None
        self._wait(work, f"receiving {label} (header)", peer)
        self._specs[channel] = TensorSpec.decode(buffer)
        del self._header_work[channel]
        return self._specs[channel]

    # ------------------------------------------------------------------- errors
    def _wait(self, work: dist.Work | None, what: str, peer: int) -> None:
        try:
            if work is None:
                raise RuntimeError("no request was posted")
            work.wait(timeout=self.timeout)
        except Exception as exc:
            raise self._failure(what, peer, exc) from exc

    def _failure(self, what: str, peer: int, exc: BaseException) -> PeerFailure:
        reason = short_reason(exc)
        if "Timed out" in reason or "timeout" in reason.lower():
            cause = f"no answer within {self.timeout_s:.0f} s"
        else:
            cause = f"connection lost ({reason})"
        return PeerFailure(f"rank {self.rank}: {what} failed: {cause}; rank {peer} failed or died", peer)
