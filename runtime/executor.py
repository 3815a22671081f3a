"""The schedule executor: one worker walks its ``Action`` list (``pipeplan.schedule``).

- ``F`` (unit u = minibatch * M + microbatch): wait for the inputs (received from the
  producing stage's replica ``u % n``, or drawn from the data for a model input), run the
  stage forward (on a stashed weight version for 1F1B-RR), start sending each output to
  every consuming stage's replica ``u % n``; the loss stage computes the loss (scaled by
  1/M for micro-batches).
- ``B``: wait for the gradients of the outputs (summed over consumers; the loss stage
  differentiates its loss), backward, start sending each received input's gradient back
  to its producer. With ``recompute`` (GPipe re-materialisation) the forward kept only
  its inputs and RNG state and is re-run here.
- ``S``: all-reduce gradients (replicas, tied stages), optimizer step.

Receives are posted ahead (``lookahead`` actions, gloo) so no wait is for a message the
schedule could have asked for earlier; sends never block the worker.
Routing uses the schedule's own unit ids, which every rank shares; ``minibatch_offset``
maps them to global minibatch ids for data (a resumed run continues the data stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pipeplan.errors import RuntimeFailure
from pipeplan.graph import MODEL_OUTPUT
from pipeplan.runtime.comm import BACKWARD, FORWARD, P2P, PendingRecv, TensorSpec
from pipeplan.runtime.data import BatchSource
from pipeplan.runtime.recorder import Recorder, now_ms
from pipeplan.runtime.stage import PipelineSpec
from pipeplan.runtime.stash import WeightStash, WeightVersion
from pipeplan.runtime.sync import GradSync
from pipeplan.schedule import Action

__all__ = ["Executor", "UnitRecord"]


@dataclass
class _Saved:
    inputs: list[torch.Tensor]
    outputs: dict[str, torch.Tensor]
    loss: torch.Tensor | None
    version: WeightVersion | None
    rng: Any = None  # CPU (and CUDA) RNG state for re-materialisation


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
    stash: WeightStash | None = None  # 1F1B-RR weight stashing
    recompute: bool = False
    minibatch_offset: int = 0
    lookahead: int = 6
    on_step: Callable[[int], None] | None = None  # called with the global minibatch after its S
    losses: dict[int, float] = field(default_factory=dict)  # global minibatch -> loss
    units: dict[int, UnitRecord] = field(default_factory=dict)  # unit -> versions used
    done_ms: dict[int, float] = field(default_factory=dict)  # global minibatch -> its S ended (ms from t0)
    _saved: dict[int, _Saved] = field(default_factory=dict)
    _posted: dict[tuple[str, int], dict[str, list[PendingRecv]]] = field(default_factory=dict)
    _unit_grads: dict[int, dict[str, torch.Tensor | None]] = field(default_factory=dict)

    # ------------------------------------------------------------------ driver
    def run(self) -> None:
        for position, action in enumerate(self.actions):
            self._prefetch(position)
            if action.kind == "F":
                self._forward(action)
            elif action.kind == "B":
                self._backward(action)
            else:
                self._step(action)
            self.comm.reap()
        self.comm.finish()
        if self._saved:
            raise RuntimeFailure(f"units {sorted(self._saved)[:5]} ran forward but no backward")

    @property
    def _stage(self) -> Any:
        return self.spec.stage

    @property
    def _is_loss_stage(self) -> bool:
        return MODEL_OUTPUT in self._stage.output_names

    def _unit(self, action: Action) -> int:
        return action.minibatch * self.microbatches + action.microbatch

    def _in_message_order(self, names: Any) -> list[str]:
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
            key = (action.kind, unit)
            if action.kind == "S" or key in self._posted:
                continue
            if action.kind == "F":
                self._posted[key] = self._post_inputs(action, unit)
            elif unit in self._saved:
                self._posted[key] = self._post_grads(action, unit)

    def _post_inputs(self, action: Action, unit: int) -> dict[str, list[PendingRecv]]:
        posted = {}
        for name in self._in_message_order(self._stage.input_names):
            producer = self._stage.producers[name]
            if producer < 0:
                continue
            peer = self.spec.rank_of(producer, unit)
            posted[name] = [self.comm.post(peer, self.spec.value_ids[name], unit, FORWARD,
                                           f"{name!r} of {action} from rank {peer}")]
        return posted

    def _post_grads(self, action: Action, unit: int) -> dict[str, list[PendingRecv]]:
        saved = self._saved[unit]
        posted = {}
        for name in self._in_message_order(self._stage.output_names):
            value = saved.outputs[name]
            if name == MODEL_OUTPUT or not value.is_floating_point():
                continue
            spec = TensorSpec.of(value)
            posted[name] = [
                self.comm.post(peer, self.spec.value_ids[name], unit, BACKWARD,
                               f"gradient of {name!r} for {action} from rank {peer}", spec)
                for peer in (self.spec.rank_of(c, unit) for c in self._stage.consumers[name])
            ]
        return posted

    def _wait(self, pending: PendingRecv, action: Action) -> torch.Tensor:
        start = now_ms()
        value = self.comm.wait(pending)
        self.recorder.add("recv", f"recv {action} <-r{pending.peer}", start, now_ms(),
                          action.minibatch + self.minibatch_offset, action.microbatch)
        return value

    # ----------------------------------------------------------------- forward
    def _forward(self, action: Action) -> None:
        unit = self._unit(action)
        posted = self._posted.pop(("F", unit), None) or self._post_inputs(action, unit)
        minibatch = action.minibatch + self.minibatch_offset
        needs_data = self._is_loss_stage or any(p < 0 for p in self._stage.producers.values())
        data_inputs, targets = (
            self.data.microbatch(minibatch, action.microbatch) if needs_data else ((), None)
        )
        received: dict[str, torch.Tensor] = {}
        for name in posted:  # in message order
            value = self._wait(posted[name][0], action)
            if value.is_floating_point():
                value.requires_grad_(True)
            received[name] = value
        inputs: list[torch.Tensor] = [
            data_inputs[int(name.split(":")[1])] if self._stage.producers[name] < 0 else received[name]
            for name in self._stage.input_names
        ]
        with self.recorder.span("forward", str(action), minibatch, action.microbatch):
            rng = _rng_state() if self.recompute else None
            version = self.stash.acquire() if self.stash is not None else None
            with torch.set_grad_enabled(not self.recompute):
                outputs, loss = self._run_stage(inputs, targets, version)
        if version is not None:
            self.units[unit] = UnitRecord(action.minibatch, action.microbatch, version.id)
        if loss is not None:
            self.losses[minibatch] = self.losses.get(minibatch, 0.0) + float(loss.detach())
        for name in self._in_message_order(self._stage.output_names):
            for consumer in self._stage.consumers[name]:
                peer = self.spec.rank_of(consumer, unit)
                self.comm.send(outputs[name], peer, self.spec.value_ids[name], unit, FORWARD,
                               f"send {action} ->r{peer}")
        if self.recompute:
            outputs = {n: v.detach() if isinstance(v, torch.Tensor) else v for n, v in outputs.items()}
            loss = None
        self._saved[unit] = _Saved(inputs, outputs, loss, version, rng)

    def _run_stage(self, inputs: list[torch.Tensor], targets: Any,
                   version: WeightVersion | None) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        if version is not None:
            assert self.stash is not None
            result = self.stash.forward(version, tuple(inputs))
        else:
            result = self._stage.module(*inputs)
        values = result if isinstance(result, tuple) else (result,)
        outputs = dict(zip(self._stage.output_names, values))
        loss = None
        if self._is_loss_stage:
            loss = self.loss_fn(outputs[MODEL_OUTPUT], targets)
            if self.microbatches > 1:
                loss = loss / self.microbatches
        return outputs, loss

    # ---------------------------------------------------------------- backward
    def _backward(self, action: Action) -> None:
        unit = self._unit(action)
        saved = self._saved[unit]
        posted = self._posted.pop(("B", unit), None) or self._post_grads(action, unit)
        grads_in: dict[str, torch.Tensor] = {}
        for name, pendings in posted.items():
            total = None
            for pending in pendings:
                g = self._wait(pending, action)
                total = g if total is None else total + g
            if total is not None:
                grads_in[name] = total
        del self._saved[unit]
        minibatch = action.minibatch + self.minibatch_offset
        with self.recorder.span("backward", str(action), minibatch, action.microbatch):
            outputs, loss = saved.outputs, saved.loss
            if self.recompute:
                outputs, loss = self._rematerialise(saved, minibatch, action.microbatch)
            tensors, grads = [], []
            if loss is not None:
                tensors.append(loss)
                grads.append(torch.ones_like(loss))
            for name, g in grads_in.items():
                if outputs[name].requires_grad:
                    tensors.append(outputs[name])
                    grads.append(g)
            if tensors:
                torch.autograd.backward(tensors, grads)
            if saved.version is not None:
                assert self.stash is not None
                self._unit_grads[unit] = self.stash.collect_grads(saved.version)
                self.units[unit].backward_version = saved.version.id
        inputs_by_name = dict(zip(self._stage.input_names, saved.inputs))
        for name in self._in_message_order(self._stage.input_names):
            value = inputs_by_name[name]
            producer = self._stage.producers[name]
            if producer < 0 or not value.is_floating_point():
                continue
            grad = value.grad if value.grad is not None else torch.zeros_like(value)
            peer = self.spec.rank_of(producer, unit)
            self.comm.send(grad, peer, self.spec.value_ids[name], unit, BACKWARD,
                           f"send {action} ->r{peer}")

    def _rematerialise(self, saved: _Saved, minibatch: int, microbatch: int) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        targets = self.data.microbatch(minibatch, microbatch)[1] if self._is_loss_stage else None
        with torch.random.fork_rng(devices=_cuda_devices()):
            _set_rng_state(saved.rng)
            with torch.enable_grad():
                return self._run_stage(saved.inputs, targets, saved.version)

    # -------------------------------------------------------------------- step
    def _step(self, action: Action) -> None:
        minibatch = action.minibatch + self.minibatch_offset
        start = now_ms()
        if self.stash is not None:
            self.stash.load_grads(self._unit_grads.pop(self._unit(action), {}))
        self.sync.reduce()
        self.recorder.add("allreduce", f"allreduce {action}", start, now_ms(), minibatch)
        if self.optimizer is not None:
            with self.recorder.span("step", str(action), minibatch):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        if self.stash is not None:
            self.stash.stepped()
        self.done_ms[minibatch] = now_ms() - self.recorder.t0_ms
        if self.on_step is not None:
            self.on_step(minibatch)


def _cuda_devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def _rng_state() -> tuple[Any, Any]:
    cuda = torch.cuda.get_rng_state() if _cuda_devices() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Any, Any]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
