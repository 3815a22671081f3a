"""The schedule executor: one worker walks its ``Action`` list (``pipeplan.schedules``).

- ``F`` (unit u = minibatch * M + microbatch, chunk c = model stage c*P + position): wait
  for the inputs (received from the producing model stage's replica ``u % n``, or drawn
  from the data for a model input), run the chunk forward (on a weight version for
  1F1B-RR and 2BW), start sending each output to every consuming stage's replica
  ``u % n``; the loss stage computes the loss (scaled by 1/M for micro-batches).
- ``B``: wait for the gradients of the outputs (summed over consumers; the loss stage
  differentiates its loss), backward, start sending each received input's gradient back
  to its producer. With ``recompute`` (GPipe re-materialisation) the forward kept only
  its inputs and RNG state and is re-run here.
- ``I`` / ``W`` (zero bubble): ``I`` computes and sends the input gradients only,
  keeping the graph and the gradients at the weight-consuming nodes
  (``pipeplan.split_backward``); ``W`` computes the weight gradients from them.
- ``S``: all-reduce gradients (replicas, tied stages), measure (and clip) the gradient
  norm (``pipeplan.runtime.clip``), optimizer step. With weight versions, the gradients
  of the minibatch's units (coalesced, 2BW) go on the live weights first.

Mixed precision (``precision``; ``pipeplan.runtime.mixed_precision``): chunks run on
bf16 compute copies of the float32 masters (or on bf16 weight versions), the loss is
computed on the float32 model output, gradients reach the masters in float32 and the
copies are refreshed after the optimizer step.

Receives are posted ahead (``lookahead`` actions, gloo) so no wait is for a message the
schedule could have asked for earlier; sends never block the worker.
Routing uses the schedule's own unit ids, which every rank shares; ``minibatch_offset``
maps them to global minibatch ids for data (a resumed run continues the data stream).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_map_only

from pipeplan.capture import MODEL_OUTPUT, StageModule
from pipeplan.errors import RuntimeFailure
from pipeplan.runtime.clip import GradNorm
from pipeplan.runtime.comm import BACKWARD, FORWARD, P2P, PendingRecv, TensorSpec
from pipeplan.runtime.data import BatchSource
from pipeplan.runtime.mixed_precision import MixedPrecision
from pipeplan.runtime.recorder import Recorder, now_ms
from pipeplan.runtime.stage import PipelineSpec
from pipeplan.runtime.stash import WeightStash, WeightVersion
from pipeplan.runtime.sync import GradSync
from pipeplan.schedules import Action, ScheduleKind, schedule_kind
from pipeplan.split_backward import WeightGradients, add_gradient, backward_input, backward_weight

__all__ = ["Executor", "UnitRecord"]

_Key = tuple[int, int]  # (unit, chunk)
_PEER_SCAN = 1024  # actions of a peer looked through for the forward that sent a message
_T = TypeVar("_T")


@dataclass
class _Saved:
    inputs: list[torch.Tensor]
    outputs: dict[str, torch.Tensor]
    loss: torch.Tensor | None
    version: WeightVersion | None
    rng: Any = None  # CPU (and CUDA) RNG state for re-materialisation
    weight_work: WeightGradients | None = None  # after "I": what "W" still computes


class _Message:
    """A packed message (activations, or gradients) shared by the values it holds: waited for
    once, by the first value taken."""

    def __init__(self, names: list[str], pending: PendingRecv) -> None:
        self.names = names
        self.pending = pending
        self.tensors: dict[str, torch.Tensor] | None = None

    def take(self, name: str, wait: Callable[[PendingRecv], list[torch.Tensor]]) -> torch.Tensor:
        if self.tensors is None:
            self.tensors = dict(zip(self.names, wait(self.pending)))
        return self.tensors[name]


@dataclass
class UnitRecord:
    """What one unit's forward and backward used (for ``--record`` and the stashing test)."""

    minibatch: int
    microbatch: int
    forward_version: int
    backward_version: int = -1


@dataclass
class Executor:
    spec: PipelineSpec
    actions: tuple[Action, ...]
    microbatches: int
    comm: P2P
    data: BatchSource
    loss_fn: Callable[[Any, Any], Any]
    optimizer: torch.optim.Optimizer | None
    sync: GradSync
    recorder: Recorder
    stash: WeightStash | None = None  # weight versions (1F1B-RR stashing, 2BW)
    recompute: bool = False
    minibatch_offset: int = 0
    lookahead: int = 6
    on_step: Callable[[int], None] | None = None  # called with the global minibatch after its S
    schedule: str = "1f1b-flush"  # the schedule's name: which weight version a forward runs on
    grad_norm: GradNorm | None = None  # measures (and clips) the gradient norm at each step
    # where the actions run (a tensor-parallel stage's DTensor settings); None: as they are
    compute_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    precision: MixedPrecision | None = None  # mixed precision without weight versions: the compute copies
    loss_dtype: torch.dtype | None = None  # mixed precision: the model output is cast to it for the loss
    losses: dict[int, float] = field(default_factory=dict)  # global minibatch -> loss
    units: dict[int, UnitRecord] = field(default_factory=dict)  # unit -> versions used
    done_ms: dict[int, float] = field(default_factory=dict)  # global minibatch -> its S ended (ms from t0)
    grad_squares: dict[int, float] = field(
        default_factory=dict
    )  # global minibatch -> counted squared gradient sum (before clipping)
    lrs: dict[int, float] = field(default_factory=dict)  # global minibatch -> lr of its S (first group)
    _kind: ScheduleKind | None = None
    _steps: int = 0  # "S" done
    _saved: dict[_Key, _Saved] = field(default_factory=dict)
    _posted: dict[tuple[str, int, int], dict[str, list[PendingRecv | _Message]]] = field(default_factory=dict)
    _minibatch_grads: dict[int, dict[str, torch.Tensor | None]] = field(
        default_factory=dict
    )  # summed per minibatch
    # A value crosses to a rank once per unit, however many of its chunks read it:
    _inbound: dict[tuple[str, int], list[Any]] = field(
        default_factory=dict
    )  # (name, unit) -> [pending|tensor, uses left]
    _outbound: dict[tuple[str, int], list[Any]] = field(
        default_factory=dict
    )  # (name, unit) -> [grad sum, grads left]
    _readers: dict[str, int] = field(default_factory=dict)  # value name -> this rank's chunks reading it
    _sources: dict[int, list[str]] = field(default_factory=dict)  # producer stage -> values read from it
    # peer rank -> its actions (the schedule every rank shares): a peer's forward proves it
    # took this rank's gradients of its backwards before it (``_gradients_taken``)
    peer_actions: Mapping[int, Sequence[Action]] = field(default_factory=dict)
    _peer_cursor: dict[int, int] = field(default_factory=dict)  # peer -> its first action not yet passed
    _gradient_values: dict[int, frozenset[int]] = field(default_factory=dict)  # producer stage -> value ids

    # ------------------------------------------------------------------ driver
    def run(self) -> None:
        self._kind = schedule_kind(self.schedule)
        for chunk in self.spec.chunks:
            for name in chunk.input_names:
                self._readers[name] = self._readers.get(name, 0) + 1
        handlers = {
            "F": self._forward,
            "B": self._backward,
            "I": self._backward,
            "W": self._weights,
            "S": self._step,
        }
        with self.compute_context() if self.compute_context is not None else contextlib.nullcontext():
            for position, action in enumerate(self.actions):
                self._prefetch(position)
                handlers[action.kind](action)
                self.comm.reap()
        self.comm.finish()
        if self._saved:
            raise RuntimeFailure(f"units {sorted(self._saved)[:5]} ran forward but no backward")

    def _chunk(self, action: Action) -> StageModule:
        return self.spec.chunks[action.chunk]

    def _is_loss_stage(self, stage: StageModule) -> bool:
        return MODEL_OUTPUT in stage.output_names

    def _unit(self, action: Action) -> int:
        return action.minibatch * self.microbatches + action.microbatch

    def _in_message_order(self, names: Iterable[str]) -> list[str]:
        """``names`` by global message id: the order both ends of a link send and receive.

        NCCL matches point-to-point messages between two ranks by the order they are
        posted (it has no tags), so a sender and its receiver must walk their values in
        one agreed order; each stage's own input/output order would differ.
        """
        return sorted(names, key=lambda name: self.spec.value_ids.get(name, -1))

    # ---------------------------------------------------------------- receives
    def _prefetch(self, position: int) -> None:
        for action in self.actions[position : position + self.lookahead]:
            unit = self._unit(action)
            key = (action.kind, unit, action.chunk)
            if action.kind in ("S", "W") or key in self._posted:
                continue
            if action.kind == "F":
                self._posted[key] = self._post_inputs(action, unit)
            elif (unit, action.chunk) in self._saved:
                self._posted[key] = self._post_grads(action, unit)

    def _post_inputs(self, action: Action, unit: int) -> dict[str, list[PendingRecv]]:
        """Post the chunk's input receives; a value another chunk here also reads is posted once.

        What one producing stage sends this rank for a unit is one message
        (``P2P.send_activations``): every value this rank's chunks read from that stage."""
        stage = self._chunk(action)
        for name in self._in_message_order(stage.input_names):
            producer = stage.producers[name]
            if producer < 0 or (name, unit) in self._inbound:
                continue
            peer = self.spec.recv_peer(producer, unit)
            names = self._read_from(producer)
            if len(names) == 1 or peer == self.comm.rank:
                pending = self.comm.post(
                    peer, self.spec.value_ids[name], unit, FORWARD, f"{name!r} of {action} from rank {peer}"
                )
                self._inbound[(name, unit)] = [pending, self._readers[name]]
                continue
            values = [self.spec.value_ids[n] for n in names]
            message = _Message(
                names, self.comm.post_packed(peer, values, unit, FORWARD, f"{action} from rank {peer}")
            )
            for other in names:
                self._inbound[(other, unit)] = [message, self._readers[other]]
        return {}

    def _read_from(self, producer: int) -> list[str]:
        """The values this rank's chunks read from model stage ``producer``, in message order."""
        if producer not in self._sources:
            self._sources[producer] = self._in_message_order(
                {n for chunk in self.spec.chunks for n, p in chunk.producers.items() if p == producer}
            )
        return self._sources[producer]

    def _take_input(self, name: str, unit: int, action: Action) -> torch.Tensor:
        """The received value (waited for by its first reader on this rank), as a fresh leaf."""
        entry = self._inbound[(name, unit)]
        if isinstance(entry[0], PendingRecv):
            entry[0] = self._wait(entry[0], action)
        elif isinstance(entry[0], _Message):
            entry[0] = entry[0].take(name, lambda pending: self._wait_message(pending, action))
        entry[1] -= 1
        value = entry[0] if entry[1] == 0 else entry[0].detach()
        if entry[1] == 0:
            del self._inbound[(name, unit)]
        return value

    def _gradients_taken(self, peer: int, producer: int, action: Action) -> None:
        """``peer`` sent model stage ``producer``'s activations of ``action``'s unit, so it had
        run every action before that forward: free this rank's gradient sends that its
        backwards among them took. gloo keeps a send until it is waited on, and a step alone
        released them: a last stage held a minibatch's gradients, or 1F1B-RR's twice
        ``minibatches_in_flight`` (issue 31)."""
        actions = self.peer_actions.get(peer)
        if actions is None or peer == self.comm.rank:
            return
        positions = self.spec.stages
        chunk = producer // positions
        start = self._peer_cursor.get(peer, 0)
        forward = next(
            (
                i
                for i in range(start, min(len(actions), start + _PEER_SCAN))
                if actions[i].kind == "F"
                and actions[i].chunk == chunk
                and (actions[i].minibatch, actions[i].microbatch) == (action.minibatch, action.microbatch)
            ),
            None,
        )
        if forward is None:  # not within reach (taken out of the peer's order): the step frees them
            return
        for done in actions[start:forward]:
            if done.kind in ("B", "I"):
                values = self._gradient_values_of(done.chunk * positions + producer % positions)
                if values:
                    self.comm.release_gradients(peer, self._unit(done), values)
        self._peer_cursor[peer] = forward + 1

    def _gradient_values_of(self, producer: int) -> frozenset[int]:
        """The ids of the values model stage ``producer`` sends this rank's chunks."""
        if producer not in self._gradient_values:
            self._gradient_values[producer] = frozenset(
                self.spec.value_ids[name]
                for chunk in self.spec.chunks
                for name, p in chunk.producers.items()
                if p == producer
            )
        return self._gradient_values[producer]

    def _post_grads(self, action: Action, unit: int) -> dict[str, list[PendingRecv | _Message]]:
        """Post the receives of the gradients of the chunk's outputs: one per consuming rank
        (summed there over its chunks), the values whose readers there are the same chunks
        in one message (``P2P.send_gradients``; ``_send_gradients`` groups them the same way)."""
        stage = self._chunk(action)
        saved = self._saved[(unit, action.chunk)]
        messages: dict[tuple[int, frozenset[int]], list[str]] = {}  # (peer, its readers) -> values
        posted: dict[str, list[PendingRecv | _Message]] = {}  # in message order
        for name in self._in_message_order(stage.output_names):
            if name == MODEL_OUTPUT:
                continue
            value = saved.outputs[name]
            if not value.is_floating_point() or not self._takes_gradient(value):
                continue
            posted[name] = []
            readers: dict[int, list[int]] = {}
            for consumer in stage.consumers[name]:
                readers.setdefault(self.spec.recv_peer(consumer, unit), []).append(consumer)
            for peer, chunks in readers.items():
                messages.setdefault((peer, frozenset(chunks)), []).append(name)
        for (peer, _), names in messages.items():
            label = f"gradient of {', '.join(map(repr, names))} for {action} from rank {peer}"
            ids = [self.spec.value_ids[name] for name in names]
            specs = [TensorSpec.of(saved.outputs[name]) for name in names]
            if len(names) == 1 or peer == self.comm.rank:
                for name, value_id, spec in zip(names, ids, specs):
                    posted[name].append(self.comm.post(peer, value_id, unit, BACKWARD, label, spec))
                continue
            message = _Message(names, self.comm.post_packed(peer, ids, unit, BACKWARD, label, specs))
            for name in names:
                posted[name].append(message)
        return posted

    def _takes_gradient(self, output: torch.Tensor) -> bool:
        """Whether this rank takes the gradient of its ``output`` back from the consumers: it
        requires grad (an output computed from buffers alone, like a rotary embedding's cos
        and sin, does not), or its forward ran without a graph (``recompute``). Its consumers
        then make the received value require grad, as the profiler does (issue 31)."""
        return self.recompute or output.requires_grad

    def _wait(self, pending: PendingRecv, action: Action) -> torch.Tensor:
        return self._recorded_wait(self.comm.wait, pending, action)

    def _wait_message(self, pending: PendingRecv, action: Action) -> list[torch.Tensor]:
        return self._recorded_wait(self.comm.wait_packed, pending, action)

    def _recorded_wait(self, wait: Callable[[PendingRecv], _T], pending: PendingRecv, action: Action) -> _T:
        """``wait(pending)``, traced as the action's receive."""
        start = now_ms()
        received = wait(pending)
        if pending.buffer is not None:  # as it came: a packed one with its alignment
            size = pending.buffer.nbytes
        else:  # from this rank itself
            size = received.nbytes if isinstance(received, torch.Tensor) else -1
        self.recorder.add(
            "recv",
            f"recv {action} <-r{pending.peer}",
            start,
            now_ms(),
            action.minibatch + self.minibatch_offset,
            action.microbatch,
            message=(size, len(pending.packed) or 1),
        )
        return received

    # ----------------------------------------------------------------- forward
    def _forward(self, action: Action) -> None:
        unit = self._unit(action)
        stage = self._chunk(action)
        if ("F", unit, action.chunk) not in self._posted:
            self._post_inputs(action, unit)
        self._posted.pop(("F", unit, action.chunk), None)
        minibatch = action.minibatch + self.minibatch_offset
        needs_data = self._is_loss_stage(stage) or any(p < 0 for p in stage.producers.values())
        data_inputs, targets = (
            self.data.microbatch(minibatch, action.microbatch) if needs_data else ((), None)
        )
        received: dict[str, torch.Tensor] = {}
        for name in self._in_message_order(stage.input_names):
            if stage.producers[name] < 0:
                continue
            value = self._take_input(name, unit, action)
            peer = self.spec.recv_peer(stage.producers[name], unit)
            if value.is_floating_point() and self.comm.expects_gradient(peer, self.spec.value_ids[name]):
                value.requires_grad_(True)  # as its producer's output: a gradient goes back
            received[name] = value
        inputs: list[torch.Tensor] = [
            data_inputs[int(name.split(":")[1])] if stage.producers[name] < 0 else received[name]
            for name in stage.input_names
        ]
        for producer in {p for p in stage.producers.values() if p >= 0}:
            self._gradients_taken(self.spec.recv_peer(producer, unit), producer, action)
        with self.recorder.span("forward", str(action), minibatch, action.microbatch):
            rng = _rng_state() if self.recompute else None
            version = None
            if self.stash is not None:
                assert self._kind is not None
                version = self.stash.acquire(self._kind.forward_version(action.minibatch, self._steps))
            with torch.set_grad_enabled(not self.recompute):
                outputs, loss = self._run_stage(stage, inputs, targets, version)
        if version is not None:
            self.units[unit] = UnitRecord(action.minibatch, action.microbatch, version.id)
        if loss is not None:
            self.losses[minibatch] = self.losses.get(minibatch, 0.0) + float(loss.detach())
        to_peer: dict[int, list[str]] = {}  # one message per peer (P2P.send_activations)
        for name in self._in_message_order(stage.output_names):
            for peer in dict.fromkeys(
                p for c in stage.consumers[name] for p in self.spec.send_peers(c, unit)
            ):
                to_peer.setdefault(peer, []).append(name)
        for peer, names in to_peer.items():
            self.comm.send_activations(
                [outputs[name] for name in names],
                peer,
                [self.spec.value_ids[name] for name in names],
                unit,
                f"send {action} ->r{peer}",
                [self._takes_gradient(outputs[name]) for name in names],
            )
        if self.recompute:
            outputs = {n: v.detach() if isinstance(v, torch.Tensor) else v for n, v in outputs.items()}
            loss = None
        # no backward reads the model's output: the loss keeps what its function saved (a
        # language model's logits, b x s x vocabulary per unit, were held until "B")
        outputs.pop(MODEL_OUTPUT, None)
        self._saved[(unit, action.chunk)] = _Saved(inputs, outputs, loss, version, rng)

    def _run_stage(
        self,
        stage: StageModule,
        inputs: list[torch.Tensor],
        targets: object,  # the loss_fn's
        version: WeightVersion | None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        if version is not None:
            assert self.stash is not None
            result = self.stash.forward(version, tuple(inputs))
        elif self.precision is not None:
            result = self.precision.forward(stage.module, inputs)
        else:
            result = stage.module(*inputs)
        values = result if isinstance(result, tuple) else (result,)
        outputs = dict(zip(stage.output_names, values))
        loss = None
        if self._is_loss_stage(stage):
            output = outputs[MODEL_OUTPUT]
            if self.loss_dtype is not None:  # its floating tensors (HF: a ModelOutput's logits)
                dtype = self.loss_dtype
                output = tree_map_only(
                    torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, output
                )
            loss = self.loss_fn(output, targets)
            if self.microbatches > 1:
                loss = loss / self.microbatches
        return outputs, loss

    # ---------------------------------------------------------------- backward
    def _backward(self, action: Action) -> None:
        """ "B" (whole backward) or "I" (input gradients now, weight gradients at "W")."""
        unit = self._unit(action)
        stage = self._chunk(action)
        saved = self._saved[(unit, action.chunk)]
        posted = self._posted.pop((action.kind, unit, action.chunk), None) or self._post_grads(action, unit)
        grads_in: dict[str, torch.Tensor] = {}
        for name, pendings in posted.items():
            total = None
            for pending in pendings:
                if isinstance(pending, _Message):
                    g = pending.take(name, lambda message: self._wait_message(message, action))
                    peer = pending.pending.peer
                else:
                    g, peer = self._wait(pending, action), pending.peer
                self.comm.release_taken(peer, self.spec.value_ids[name], unit)  # the peer took the forward's
                total = g if total is None else total + g
            if total is not None:
                grads_in[name] = total
        minibatch = action.minibatch + self.minibatch_offset
        with self.recorder.span("backward", str(action), minibatch, action.microbatch):
            outputs, loss = saved.outputs, saved.loss
            if self.recompute:
                outputs, loss = self._rematerialise(stage, saved, minibatch, action.microbatch)
            tensors, grads = [], []
            if loss is not None:
                tensors.append(loss)
                grads.append(torch.ones_like(loss))
            for name, g in grads_in.items():
                if outputs[name].requires_grad:
                    tensors.append(outputs[name])
                    grads.append(g)
            if action.kind == "I":
                params = (
                    list(saved.version.params.values())
                    if saved.version is not None
                    else self.precision.parameters(action.chunk)
                    if self.precision is not None
                    else list(stage.module.parameters())
                )
                input_grads, saved.weight_work = backward_input(tensors, grads, saved.inputs, params)
            else:
                del self._saved[(unit, action.chunk)]
                if tensors:
                    torch.autograd.backward(tensors, grads)
                input_grads = [x.grad for x in saved.inputs]
                self._weights_done(action, saved)
        self._send_gradients(action, unit, dict(zip(stage.input_names, zip(saved.inputs, input_grads))))

    def _send_gradients(
        self, action: Action, unit: int, inputs: dict[str, tuple[torch.Tensor, torch.Tensor | None]]
    ) -> None:
        """Send the gradients of the chunk's received ``inputs`` (name -> (value, gradient))
        back to their producers: one message per peer, producing stage and readers here, so
        the values a backward completes together travel together (``_post_grads`` groups the
        same way). A value several chunks here read goes once, their sum, after the last."""
        messages: dict[tuple[int, int, frozenset[int]], list[tuple[str, torch.Tensor]]] = {}
        for name in self._in_message_order(inputs):
            value, grad = inputs[name]
            producer = self._chunk(action).producers[name]
            if producer < 0 or not value.is_floating_point() or not value.requires_grad:
                continue  # a model input, or its producer takes no gradient back (its header said)
            grad = grad if grad is not None else torch.zeros_like(value)
            if self._readers[name] > 1:  # several chunks here read it: send their sum once
                entry = self._outbound.setdefault((name, unit), [None, self._readers[name]])
                entry[0] = grad if entry[0] is None else entry[0] + grad
                entry[1] -= 1
                if entry[1]:
                    continue
                grad = self._outbound.pop((name, unit))[0]
            readers = self._reader_chunks(name)
            for peer in self.spec.send_peers(producer, unit):
                messages.setdefault((peer, producer, readers), []).append((name, grad))
        for (peer, _, _), sent in messages.items():
            self.comm.send_gradients(
                [grad for _, grad in sent],
                peer,
                [self.spec.value_ids[name] for name, _ in sent],
                unit,
                f"send {action} ->r{peer}",
            )

    def _reader_chunks(self, name: str) -> frozenset[int]:
        """The model stages of this rank's chunks that read value ``name``."""
        return frozenset(chunk.index for chunk in self.spec.chunks if name in chunk.input_names)

    def _weights(self, action: Action) -> None:
        """ "W": the weight gradients an earlier "I" of the same unit deferred."""
        saved = self._saved.pop((self._unit(action), action.chunk))
        with self.recorder.span(
            "backward", str(action), action.minibatch + self.minibatch_offset, action.microbatch
        ):
            if saved.weight_work is not None:
                backward_weight(saved.weight_work)
            if self.precision is not None:
                self.precision.accumulate()  # backward_weight set the copies' .grad: no hook ran
            self._weights_done(action, saved)

    def _weights_done(self, action: Action, saved: _Saved) -> None:
        """The unit's weight gradients are complete: move them out of its version."""
        if saved.version is None:
            return
        assert self.stash is not None
        grads = self.stash.collect_grads(saved.version)
        total = self._minibatch_grads.setdefault(action.minibatch, {})
        for name, g in grads.items():
            if g is not None:
                total[name] = add_gradient(total.get(name), g)
        self.units[self._unit(action)].backward_version = saved.version.id

    def _rematerialise(
        self, stage: StageModule, saved: _Saved, minibatch: int, microbatch: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        targets = self.data.microbatch(minibatch, microbatch)[1] if self._is_loss_stage(stage) else None
        with torch.random.fork_rng(devices=_cuda_devices()):
            _set_rng_state(saved.rng)
            with torch.enable_grad():
                return self._run_stage(stage, saved.inputs, targets, saved.version)

    # -------------------------------------------------------------------- step
    def _step(self, action: Action) -> None:
        minibatch = action.minibatch + self.minibatch_offset
        start = now_ms()
        if self.stash is not None:
            self.stash.load_grads(self._minibatch_grads.pop(action.minibatch, {}))
        self.sync.reduce()
        if self.grad_norm is not None:
            self.grad_squares[minibatch] = self.grad_norm.apply()
        self.recorder.add("allreduce", f"allreduce {action}", start, now_ms(), minibatch)
        if self.optimizer is not None:
            self.lrs[minibatch] = float(self.optimizer.param_groups[0]["lr"])
            with self.recorder.span("step", str(action), minibatch):
                if self.stash is not None:
                    self.stash.before_step()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                if self.precision is not None:
                    self.precision.refresh()
        if self.stash is not None:
            self.stash.stepped()
        if self._kind is not None:
            self.comm.release(self._received_before(action.minibatch) * self.microbatches)
        self._steps += 1
        self.done_ms[minibatch] = now_ms() - self.recorder.t0_ms
        if self.on_step is not None:
            self.on_step(minibatch)

    def _received_before(self, minibatch: int) -> int:
        """At the step of ``minibatch``: the minibatches before this one every peer consumed
        all this rank's messages of. Flush: every earlier one (a peer runs a minibatch's
        actions before its step, and its step before the next minibatch's actions, whose
        messages came here). Otherwise the pipeline holds at most ``minibatches_in_flight``
        minibatches (1F1B-RR: NOAM; 2BW: 2): the input stage admitted this minibatch once
        that many before it had left every stage; twice that is kept as a margin."""
        assert self._kind is not None
        if self._kind.flushes:
            return minibatch
        return minibatch - 2 * self._kind.minibatches_in_flight(self.spec.replicas)


def _cuda_devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def _rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state() if _cuda_devices() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
