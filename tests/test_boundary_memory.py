"""What a pipeline stage holds beside its layers' saved bytes: the values it received and the
outputs it sent, kept until their backward, where none of its own layers counts them."""

from __future__ import annotations

from dataclasses import replace

import torch
from test_profiler import measure
from test_simulate import make_profile, make_topology
from torch import nn

from pipeplan.planner.costs import ValueGraph, stage_boundary_bytes
from pipeplan.planner.options import PartitionOptions
from pipeplan.planner.partition import partition
from pipeplan.planner.simulate import simulate_plan
from pipeplan.profile import Profile
from pipeplan.topology import DeviceSpec


def _tanh_stack() -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    _, (layers, _) = measure(model, (torch.randn(6, 8),), torch.randint(0, 4, (6,)))
    return layers


def test_the_profiler_records_who_saved_each_output() -> None:
    linear, tanh, head = _tanh_stack()
    # tanh saves its own result, which the head's weight gradient reads too: one storage,
    # counted in tanh's saved bytes; nothing saves the first linear's output (tanh saves its
    # result, not its input) nor the head's (the loss saves its log-probabilities)
    assert [layer.output_saved_by for layer in (linear, tanh, head)] == [(), (1, 2), ()]
    assert tanh.saved_bytes == tanh.output_bytes == 6 * 16 * 4 and head.saved_bytes == 0
    assert [layer.output_tensors for layer in (linear, tanh, head)] == [1, 1, 1]


def test_a_stage_holds_what_it_receives_and_sends_where_no_layer_of_its_own_counts_it() -> None:
    layers = _tanh_stack()
    graph = ValueGraph.of(_profile(layers))
    out = [layer.output_bytes for layer in layers]
    # cut after the first linear: its output, saved by no one, is held by both sides
    assert stage_boundary_bytes(graph, [0], False) == out[0]
    assert stage_boundary_bytes(graph, [1, 2], False) == out[0]
    # cut after tanh: the sender counted its output (tanh saved it); the head holds its own copy
    assert stage_boundary_bytes(graph, [0, 1], False) == 0
    assert stage_boundary_bytes(graph, [2], False) == out[1]
    # on gloo several tensors to one peer travel as a packed copy, kept until their gradients
    two = replace(graph, tensors=(2, 1, 1))
    assert stage_boundary_bytes(two, [0], True) == 2 * out[0]
    assert stage_boundary_bytes(two, [0], False) == stage_boundary_bytes(graph, [0], True) == out[0]
    # a profile that did not record who saved what charges nothing
    assert stage_boundary_bytes(replace(graph, saved_by=(None, (1, 2), ())), [0], True) == 0.0


def _profile(layers: list) -> Profile:
    return replace(make_profile([1.0] * len(layers)), layers=tuple(layers))


def test_planner_and_simulator_charge_the_boundaries_alike() -> None:
    base = make_profile([1.0] * 4, output_bytes=1000, param_bytes=5000, saved_bytes=3000)
    savers = [(2,), (1,), (), ()]  # layer 1 saves its own output; nothing saves layer 2's
    profile = replace(
        base, layers=tuple(replace(layer, output_saved_by=s) for layer, s in zip(base.layers, savers))
    )
    topology = make_topology(per_server=2, servers=1)
    topology = replace(topology, device=DeviceSpec("cpu", topology.device.memory_bytes, "cpu"))
    options = PartitionOptions(schedule="1f1b-flush", microbatches=4, straight=True)
    plan = partition(profile, topology, options)
    before = partition(base, topology, options)
    assert [s.layers for s in plan.stages] == [(0, 1), (2, 3)]
    # stage 0 sent layer 1's output, which it counted (layer 1 saved it); stage 1 received it
    # and no layer of its own saved it: 1000 bytes a minibatch, 1 of 4 micro-batches in flight
    extra = [s.memory_bytes - b.memory_bytes for s, b in zip(plan.stages, before.stages)]
    assert extra == [0, 1000 // 4]
    simulated = simulate_plan(plan, profile)
    assert [s.memory_bytes for s in simulated.stages] == [s.memory_bytes for s in plan.stages]
