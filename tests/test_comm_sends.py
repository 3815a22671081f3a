"""Pending sends stay few and cheap to look at (issue 31): ``P2P.reap`` scans a bounded
number of them and ``P2P.release`` frees those a flush schedule knows were received.

gloo's point-to-point sends report ``is_completed()`` False until waited on, so a reap over
every pending send cost O(sends so far) per action, and each held its tensor until the run
ended. The fake ``isend`` below behaves the same way.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pipeplan.runtime import comm as comm_module
from pipeplan.runtime.comm import BACKWARD, FORWARD, P2P, REAP_SCAN
from pipeplan.runtime.executor import Executor
from pipeplan.runtime.recorder import Recorder
from pipeplan.schedules import Action, schedule_kind


class _GlooLikeSend:
    """A send that says it is incomplete until ``wait`` (as gloo's p2p work does)."""

    checks = 0

    def __init__(self) -> None:
        self.waited = False

    def is_completed(self) -> bool:
        _GlooLikeSend.checks += 1
        return self.waited

    def wait(self, timeout: object = None) -> bool:
        self.waited = True
        return True


def _p2p(monkeypatch: object, sent: list[_GlooLikeSend], tagged: bool = True) -> P2P:
    def isend(tensor: torch.Tensor, peer: int, tag: int = 0) -> _GlooLikeSend:
        work = _GlooLikeSend()
        sent.append(work)
        return work

    monkeypatch.setattr(comm_module.dist, "isend", isend)  # type: ignore[attr-defined]
    return P2P(rank=0, values=2, device="cpu", timeout_s=5.0, tagged=tagged, post_thread=tagged)


def test_reap_looks_at_a_bounded_number_of_pending_sends(monkeypatch: object) -> None:
    sent: list[_GlooLikeSend] = []
    p2p = _p2p(monkeypatch, sent, tagged=False)  # NCCL's sends report completion: a scan may find some
    for unit in range(200):
        p2p.send(torch.ones(4), 1, 0, unit, FORWARD, f"send F{unit}")
    assert p2p.pending_sends == 201  # a header, then one message per unit: none completed
    _GlooLikeSend.checks = 0
    p2p.reap()
    assert _GlooLikeSend.checks == REAP_SCAN  # not 201
    for work in sent[:3]:
        work.waited = True
    p2p.reap()
    assert p2p.pending_sends == 198  # the completed ones are forgotten


def test_on_gloo_reap_looks_at_no_send(monkeypatch: object) -> None:
    """gloo's sends never read complete before their wait: a scan would find none."""
    sent: list[_GlooLikeSend] = []
    p2p = _p2p(monkeypatch, sent)
    for unit in range(20):
        p2p.send(torch.ones(4), 1, 0, unit, FORWARD, f"send F{unit}")
    assert p2p._poster is not None
    p2p._poster.submit(lambda: None).result()  # every send posted by the posting thread
    _GlooLikeSend.checks = 0
    p2p.reap()
    assert _GlooLikeSend.checks == 0 and p2p.pending_sends == 21
    p2p.finish()


def test_release_waits_for_and_drops_the_sends_of_earlier_units(monkeypatch: object) -> None:
    sent: list[_GlooLikeSend] = []
    p2p = _p2p(monkeypatch, sent)
    for unit in range(12):
        p2p.send(torch.ones(4), 1, 0, unit, FORWARD, f"send F{unit}")
        p2p.send(torch.ones(4), 1, 1, unit, BACKWARD, f"send B{unit}")
    assert p2p.release(8) == 1 + 16  # the header and units 0..7, both directions
    assert p2p.pending_sends == 8
    assert all(work.waited for work in sent[:17]) and not any(work.waited for work in sent[17:])
    assert p2p.release(8) == 0
    p2p.finish()
    assert p2p.pending_sends == 0 and all(work.waited for work in sent)


def test_a_gradient_received_releases_the_forward_messages_it_proves_taken(monkeypatch: object) -> None:
    """The peer sent value 0's gradient of a unit back: it took that unit's message carrying
    value 0 (and its header), not another unit's nor a message without value 0."""
    sent: list[_GlooLikeSend] = []
    p2p = _p2p(monkeypatch, sent)
    for unit in range(4):
        p2p.send(torch.ones(4), 1, 0, unit, FORWARD, f"send F{unit}")
    p2p.send(torch.ones(4), 1, 1, 2, FORWARD, "send F2 value 1")  # its header, then the data
    p2p.send(torch.ones(4), 1, 0, 2, BACKWARD, "send B2")
    assert p2p.pending_sends == 1 + 4 + 2 + 1
    assert p2p.release_taken(1, 0, 2) == 1 and p2p.pending_sends == 7
    assert sent[3].waited and not any(work.waited for i, work in enumerate(sent) if i != 3)
    assert p2p.release_taken(1, 0, 0) == 2  # unit 0's data and the channel's header
    assert p2p.release_taken(2, 0, 1) == 0 and p2p.release_taken(1, 0, 2) == 0  # another peer; done
    assert p2p.release_taken(1, 0, 2) == 0 and p2p.pending_sends == 5  # B2 is no forward message
    assert p2p.release_gradients(1, 2, frozenset({1})) == 0  # not value 1's gradient
    assert p2p.release_gradients(1, 2, frozenset({0, 3})) == 1 and p2p.pending_sends == 4
    p2p.finish()


class _Comm:
    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, before_unit: int) -> int:
        self.released.append(before_unit)
        return 0


class _Sync:
    def reduce(self) -> None:
        pass


def _executor(
    schedule: str, comm: object, spec: object = None, microbatches: int = 4, **fields: object
) -> Executor:
    """An executor with ``comm``, and ``spec`` (default: what ``_step`` reads)."""
    executor = Executor(
        spec=spec or SimpleNamespace(replicas=(1, 1)),  # type: ignore[arg-type]
        actions=(),
        microbatches=microbatches,
        comm=comm,  # type: ignore[arg-type]
        data=None,  # type: ignore[arg-type]
        loss_fn=lambda output, target: output,
        optimizer=None,
        sync=_Sync(),  # type: ignore[arg-type]
        recorder=Recorder(rank=0, stage=0, replica=0, trace=False),
        schedule=schedule,
        **fields,  # type: ignore[arg-type]
    )
    executor._kind = schedule_kind(schedule)
    return executor


def test_a_flush_step_releases_the_sends_of_earlier_minibatches() -> None:
    comm = _Comm()
    executor = _executor("1f1b-flush", comm)
    for minibatch in range(3):
        executor._step(Action("S", minibatch, 0, 0))
    assert comm.released == [0, 4, 8]  # before minibatch k's units: k * M


def test_without_a_flush_a_step_releases_the_sends_beyond_the_minibatches_in_flight() -> None:
    comm = _Comm()
    executor = _executor("2bw", comm)  # 2 minibatches in flight: 4 kept as a margin
    executor._step(Action("S", 6, 0, 0))
    assert comm.released == [2 * 4]  # minibatches 0 and 1, 4 micro-batches each


class _Releases:
    """A comm that records which gradient sends an executor frees."""

    rank = 1

    def __init__(self) -> None:
        self.freed: list[tuple[int, int, frozenset[int]]] = []

    def release_gradients(self, peer: int, unit: int, values: frozenset[int]) -> int:
        self.freed.append((peer, unit, values))
        return 1


def test_a_producers_forward_frees_the_gradients_its_earlier_backwards_took() -> None:
    """Stage 0 (rank 0) runs 1F1B-RR with 2 minibatches in flight: F0 F1 B0 F2 B1 F3 B2. Its
    activation of minibatch 2 reaching rank 1 proves B0 ran, so rank 1's gradient of
    minibatch 0 was taken; minibatch 3's proves B1."""
    peer = tuple(Action.parse(a) for a in ("F0", "F1", "B0", "F2", "B1", "F3", "B2", "S0"))
    comm = _Releases()
    spec = SimpleNamespace(
        stages=2, chunks=(SimpleNamespace(producers={"x:0": -1, "h": 0}),), value_ids={"h": 7}
    )
    executor = _executor("1f1b-rr", comm, spec, microbatches=1, peer_actions={0: peer})
    executor._gradients_taken(0, 0, Action("F", 1))
    assert comm.freed == []  # F1 comes before any backward
    executor._gradients_taken(0, 0, Action("F", 2))
    assert comm.freed == [(0, 0, frozenset({7}))]
    executor._gradients_taken(0, 0, Action("F", 1))  # behind the peer's cursor: frees nothing
    executor._gradients_taken(2, 0, Action("F", 3))  # a rank whose actions are unknown: nothing
    executor._gradients_taken(0, 0, Action("F", 3))
    assert comm.freed == [(0, 0, frozenset({7})), (0, 1, frozenset({7}))]
