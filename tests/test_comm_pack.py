"""One message per unit and peer each way, posted off the executor's thread (issue 31).

A stage sends one rank all its activations of a unit packed in one buffer
(``P2P.send_activations``), and their gradients come back the same way
(``P2P.send_gradients``); on gloo a posting thread starts every send and receive,
because gloo's ``isend``/``irecv`` block their caller on the connection's lock. The fake
``dist`` below matches messages by (peer, tag) as gloo does, so the tags, the headers and
the packing are checked end to end in one process; the gloo runs of every schedule and
family (tests/test_run_schedules.py, tests/test_hf_families.py) check the real thing.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from pipeplan.runtime import comm as comm_module
from pipeplan.runtime.comm import (
    BACKWARD,
    FORWARD,
    P2P,
    PeerFailure,
    TensorSpec,
    pack_tensors,
    packed_bytes,
    unpack_tensors,
)


def test_pack_round_trips_every_dtype_and_shape_aligned() -> None:
    tensors = [
        torch.randn(2, 3, 5),
        torch.tensor(7, dtype=torch.int64),  # a 0-d value
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.float64),
        torch.randn(0, 4),  # empty
        torch.arange(5, dtype=torch.int16),
        torch.randn(2, 2, dtype=torch.complex64),
        torch.randn(3).to(torch.bfloat16),
    ]
    specs = [TensorSpec.of(t) for t in tensors]
    packed = pack_tensors(tensors)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_bytes(specs)
    # 120 + 8 + 3 + 24 + 0 + 10 + 32 + 6 bytes, each rounded up to 16
    assert packed.numel() == 128 + 16 + 16 + 32 + 0 + 16 + 32 + 16
    out = unpack_tensors(packed, specs)
    for original, back in zip(tensors, out):
        assert back.dtype == original.dtype and back.shape == original.shape
        assert torch.equal(back, original)
        assert back.is_leaf and not back._is_view()  # a leaf the receiver may make require grad


def test_a_non_contiguous_value_packs_as_its_contiguous_copy() -> None:
    value = torch.arange(12.0).reshape(3, 4).t()
    out = unpack_tensors(pack_tensors([value.contiguous()]), [TensorSpec.of(value)])
    assert torch.equal(out[0], value)


class _FakeGloo:
    """isend/irecv matched by (source, destination, tag); the receive's wait copies the data.
    Records the thread that started each operation."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int, int], torch.Tensor] = {}
        self.threads: list[str] = []
        self.fail_sends = False

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> object:
        self.threads.append(threading.current_thread().name)
        if self.fail_sends:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        self.sent[(0, peer, tag)] = tensor.clone()
        return _Done()

    def irecv(self, buffer: torch.Tensor, peer: int, tag: int = 0) -> object:
        self.threads.append(threading.current_thread().name)
        return _Recv(self, buffer, (peer, 0, tag))


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


class _Recv:
    def __init__(self, gloo: _FakeGloo, buffer: torch.Tensor, key: tuple[int, int, int]) -> None:
        self.gloo, self.buffer, self.key = gloo, buffer, key

    def is_completed(self) -> bool:
        return self.key in self.gloo.sent

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.buffer.copy_(self.gloo.sent.pop(self.key))
        return True


@pytest.fixture
def gloo(monkeypatch: pytest.MonkeyPatch) -> _FakeGloo:
    fake = _FakeGloo()
    monkeypatch.setattr(comm_module.dist, "isend", fake.isend)
    monkeypatch.setattr(comm_module.dist, "irecv", fake.irecv)
    return fake


def test_activations_travel_as_one_message_per_unit_after_their_headers(gloo: _FakeGloo) -> None:
    """Rank 0 sends rank 1 three values of units 0 and 1; rank 1 (the same fake link, seen
    from the other end) gets them back by value, with each header's gradient flag."""
    sender = P2P(rank=0, values=3, device="cpu", timeout_s=5.0, tagged=True, post_thread=True)
    hidden, cos, mask = torch.randn(2, 4, 8), torch.randn(4, 2), torch.ones(2, 4, dtype=torch.bool)
    for unit in (0, 1):
        sender.send_activations(
            [hidden + unit, cos, mask], 1, [0, 1, 2], unit, f"send F{unit}", [True, False, False]
        )
    sender.finish()
    headers = [key for key in gloo.sent if key[2] % 2 == 1]
    data = [key for key in gloo.sent if key[2] % 2 == 0]
    assert len(headers) == 3  # once per (peer, value), before the first unit only
    assert len(data) == 2  # one message per unit, not three
    assert {gloo.sent[key].numel() for key in data} == {256 + 32 + 16}
    assert set(gloo.threads) == {"pipeplan-p2p"}  # none started on the calling thread

    # the receiving end: rank 1 hears from rank 0 on the same tags
    gloo.sent = {(1, 0, tag): tensor for (_, _, tag), tensor in gloo.sent.items()}
    receiver = P2P(rank=0, values=3, device="cpu", timeout_s=5.0, tagged=True, post_thread=True)
    for unit in (0, 1):
        pending = receiver.post_packed(1, [0, 1, 2], unit, FORWARD, f"F{unit} from rank 1")
        got = receiver.wait_packed(pending)
        assert torch.equal(got[0], hidden + unit) and torch.equal(got[1], cos) and torch.equal(got[2], mask)
    assert [receiver.expects_gradient(1, value) for value in (0, 1, 2)] == [True, False, False]
    assert gloo.sent == {}
    receiver.finish()


def test_gradients_travel_as_one_message_without_headers(gloo: _FakeGloo) -> None:
    """The consumer sends back the gradients of two values of a unit as one message; the
    producer, which knows their shapes, receives them without a header."""
    sender = P2P(rank=0, values=3, device="cpu", timeout_s=5.0, tagged=True, post_thread=True)
    hidden, bias = torch.randn(2, 4, 8), torch.randn(4, 4, dtype=torch.float64)
    sender.send_gradients([hidden, bias], 1, [0, 2], 5, "send B5")
    sender.finish()
    assert list(gloo.sent) == [(0, 1, comm_module.message_tag(0, 3, 5, BACKWARD))]  # one, no header
    assert gloo.sent[(0, 1, comm_module.message_tag(0, 3, 5, BACKWARD))].numel() == 256 + 128

    gloo.sent = {(1, 0, tag): tensor for (_, _, tag), tensor in gloo.sent.items()}
    receiver = P2P(rank=0, values=3, device="cpu", timeout_s=5.0, tagged=True, post_thread=True)
    specs = [TensorSpec.of(hidden), TensorSpec.of(bias)]
    got = receiver.wait_packed(receiver.post_packed(1, [0, 2], 5, BACKWARD, "B5 from rank 1", specs))
    assert torch.equal(got[0], hidden) and torch.equal(got[1], bias) and got[1].dtype == torch.float64
    assert gloo.sent == {}
    receiver.finish()


def test_one_gradient_or_gradients_to_itself_are_sent_one_by_one(gloo: _FakeGloo) -> None:
    p2p = P2P(rank=0, values=2, device="cpu", timeout_s=5.0, tagged=True)
    p2p.send_gradients([torch.ones(3)], 1, [1], 0, "send B0")
    p2p.finish()
    assert [tensor.numel() for tensor in gloo.sent.values()] == [3]
    p2p.send_gradients([torch.ones(3), torch.zeros(2)], 0, [0, 1], 0, "send B0")
    pending = [p2p.post(0, value, 0, BACKWARD, "B0 from itself") for value in (0, 1)]
    assert [p2p.wait(p).tolist() for p in pending] == [[1.0, 1.0, 1.0], [0.0, 0.0]]


def test_one_value_or_a_message_to_itself_is_sent_as_before(gloo: _FakeGloo) -> None:
    p2p = P2P(rank=0, values=2, device="cpu", timeout_s=5.0, tagged=True)
    p2p.send_activations([torch.ones(3)], 1, [1], 0, "send F0", [True])
    p2p.finish()
    assert sorted(tensor.numel() for tensor in gloo.sent.values()) == [3, 16]  # data, header
    p2p.send_activations([torch.ones(3), torch.zeros(2)], 0, [0, 1], 0, "send F0", [True, True])
    pending = [p2p.post(0, value, 0, FORWARD, "F0 from itself") for value in (0, 1)]
    assert [p2p.wait(p).tolist() for p in pending] == [[1.0, 1.0, 1.0], [0.0, 0.0]]


def test_a_send_that_fails_on_the_posting_thread_fails_its_wait(gloo: _FakeGloo) -> None:
    gloo.fail_sends = True
    p2p = P2P(rank=0, values=1, device="cpu", timeout_s=5.0, tagged=True, post_thread=True)
    with pytest.raises(PeerFailure, match=r"rank 0: sending send F0 \(header\) failed: connection lost"):
        p2p.send(torch.ones(2), 1, 0, 0, FORWARD, "send F0")  # seen by this send's reap, or:
        p2p.finish()


@pytest.mark.parametrize("tagged", [False, True])
def test_nccl_and_one_unit_at_a_time_post_on_the_calling_thread(gloo: _FakeGloo, tagged: bool) -> None:
    """NCCL (untagged) never takes the thread; gloo takes it only where asked (units overlap)."""
    p2p = P2P(rank=0, values=1, device="cpu", timeout_s=5.0, tagged=tagged, post_thread=not tagged)
    p2p.send(torch.ones(2), 1, 0, 0, FORWARD, "send F0")
    p2p.finish()
    assert gloo.threads == [threading.current_thread().name] * 2  # header and data
    assert {tag for _, _, tag in gloo.sent} == ({0, 1} if tagged else {0})  # data, header; NCCL: no tags
