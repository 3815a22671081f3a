"""The DP's band of stage boundaries (``planner.boundary``) against ``stage_boundary_bytes``
range by range, on random graphs of values, both cut families."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.planner.boundary import boundary_range
from pipeplan.planner.costs import LayerArrays, ValueGraph, layer_arrays, stage_boundary_bytes
from pipeplan.planner.cuts import cut_family
from pipeplan.profile import DeviceInfo, LayerProfile, Profile


@st.composite
def graphs(draw) -> ValueGraph:
    """Layers reading up to three earlier ones; each output saved by some of its readers
    (the first counts it) and made of one to three tensors (-1: not measured, one)."""
    n = draw(st.integers(1, 9))
    inputs = [
        tuple(sorted(draw(st.sets(st.integers(0, q - 1), max_size=min(q, 3))))) if q else () for q in range(n)
    ]
    readers = [tuple(q for q in range(n) if p in inputs[q]) for p in range(n)]
    saved_by = tuple(tuple(draw(st.lists(st.sampled_from(rs), unique=True))) if rs else () for rs in readers)
    sizes = tuple(float(draw(st.integers(0, 100))) for _ in range(n))
    tensors = tuple(draw(st.sampled_from([-1, 1, 2, 3])) for _ in range(n))
    return ValueGraph(tuple(inputs), readers, sizes, saved_by, tensors)


def _arrays(graph: ValueGraph, downsets: bool = False) -> LayerArrays:
    """The arrays of a profile of ``graph``'s layers, over the prefix family or, with
    ``downsets``, the planner's family of the DAG (its downsets: ``cuts.cut_family``)."""
    layers = tuple(
        LayerProfile(p, f"l{p}", "x", graph.inputs[p], 1.0, 1.0, int(graph.output_bytes[p]), 0, 0)
        for p in range(len(graph.inputs))
    )
    profile = Profile("m", "fp", DeviceInfo("cpu", "x"), 8, "float32", layers)
    arrays = layer_arrays(profile, "sgd", cut_family(profile)) if downsets else layer_arrays(profile)
    return replace(arrays, values=graph)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(), st.booleans())
def test_every_prefix_range_is_priced_as_stage_boundary_bytes(graph: ValueGraph, packed_copy: bool) -> None:
    arrays = _arrays(graph)
    n = arrays.layers
    starts, ends = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    got = boundary_range(arrays, starts, ends, packed_copy)
    for i in range(n + 1):
        for j in range(n + 1):
            want = stage_boundary_bytes(graph, range(i, j), packed_copy) if i < j else 0.0
            assert got[i, j] == want, (i, j, got[i, j], want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(), st.booleans())
def test_every_range_of_a_downset_family_is_priced_as_its_stage(graph: ValueGraph, packed_copy: bool) -> None:
    """Over the downsets of a DAG a stage is state j less state i, whatever their order."""
    arrays = _arrays(graph, downsets=True)
    family = arrays.cut_family
    states = family.states
    starts, ends = np.meshgrid(np.arange(states), np.arange(states), indexing="ij")
    got = boundary_range(arrays, starts, ends, packed_copy)
    for i in range(states):
        for j in range(i + 1, states):
            if arrays.nested(i, j):
                want = stage_boundary_bytes(graph, family.stage_layers(i, j), packed_copy)
                assert got[i, j] == want, (i, j, got[i, j], want)


def test_a_profile_that_did_not_record_who_saved_what_is_charged_nothing() -> None:
    graph = ValueGraph(((), (0,), (1,)), ((1,), (2,), ()), (8.0, 16.0, 4.0), ((1,), None, (2,)))
    got = boundary_range(_arrays(graph), np.array([0, 1, 0]), np.array([1, 3, 3]), packed_copy=True)
    assert got.tolist() == [0.0, 0.0, 0.0]
    # recorded: the first layer's output is counted by its saver, layer 1, in the stage [1, 3)
    measured = replace(graph, saved_by=((1,), (), ()))
    got = boundary_range(_arrays(measured), np.array([0, 1, 0]), np.array([1, 3, 3]), packed_copy=False)
    assert got.tolist() == [8.0, 0.0, 0.0]
