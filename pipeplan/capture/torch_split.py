"""torch.distributed.pipelining's own split of a model, traced once in-process: what each piece holds and reads.

``pipeline(model, mb_args, split_spec={name: SplitPoint.BEGINNING})`` cuts the traced
graph where the Python code calls each named module, so the parameter-free ops between
two cuts run where the Python code runs them (an attention mask built once before the
blocks lands in the piece that holds that code), not where pipeplan's layer graph folds
them (into the first layer that reads them). The pieces and the values they pass are
read here from the traced ``Pipe`` (no process group, nothing run): the profiler
records, for every boundary, how far torch's pieces reach back over it, and ``export``
checks the split it writes against the plan before a user's run would crash.
"""

from __future__ import annotations

import io
import operator
import sys
import warnings
from bisect import bisect_right
from collections.abc import Sequence
from contextlib import redirect_stderr
from dataclasses import dataclass
from typing import Any, cast

import torch.fx as fx
from torch import nn

from pipeplan.model_inputs import ModelInputs
from pipeplan.profile import ModuleRecord

__all__ = [
    "TorchPiece",
    "TorchSplit",
    "outermost_split_point",
    "pipelining_split",
    "recorded_split",
    "split_faults",
    "torch_pipe",
    "trace_torch_split",
]

INPUT = -1  # the producer of a model input (it comes before every piece)


@dataclass(frozen=True)
class TorchPiece:
    """One piece of torch's split: the parameters it holds (the model's qualified names)
    and, for each value it reads, the piece that computes it (``INPUT``: a model input)."""

    parameters: frozenset[str]
    reads: tuple[tuple[str, int], ...]  # (value name, producing piece or INPUT)
    part: int  # torch's partition: the number of cuts the Python code passed before this piece
    strided: frozenset[str] = frozenset()  # values read that are not contiguous (a slice, a transposed view)


@dataclass(frozen=True)
class TorchSplit:
    """The pieces of ``pipeline()``'s split in torch's stage order (the order its top graph
    calls them); a cut whose piece would hold no op makes none."""

    points: tuple[str, ...]
    pieces: tuple[TorchPiece, ...]

    def readers(self) -> dict[tuple[str, int], list[int]]:
        """(value, producer) -> the pieces reading it, in order."""
        out: dict[tuple[str, int], list[int]] = {}
        for k, piece in enumerate(self.pieces):
            for read in piece.reads:
                out.setdefault(read, []).append(k)
        return out


def outermost_split_point(layer_names: Sequence[str], calls: dict[str, int], first: int) -> str:
    """The module ``SplitPoint.BEGINNING`` names for a stage beginning at layer ``first`` (a module
    called once): the outermost module called once whose first layer is ``first``
    (``blocks.1`` rather than ``blocks.1.ln1``). O(layers * depth)."""
    name = layer_names[first]
    point, parts = name, name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:depth])
        starts = [
            i for i, layer in enumerate(layer_names) if layer == prefix or layer.startswith(prefix + ".")
        ]
        if min(starts) != first:
            break
        if calls.get(prefix, 0) == 1:
            point = prefix
    return point


def torch_pipe(model: nn.Module, inputs: ModelInputs, points: Sequence[str]) -> Any:
    """``pipeline(model, ...)`` traced with a cut before each module of ``points`` (torch's ``Pipe``).

    torch marks the cuts by replacing each named module's ``forward``; they are put back
    afterwards, so ``model`` is left as it was. Raises what ``pipeline()`` raises (the
    model does not trace, a point names no module). O(graph nodes).
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    from pipeplan.capture.exported import preserved_buffers, quiet_torch_logs
    from pipeplan.capture.materialise import on_meta

    modules = dict(model.named_modules())
    saved = {name: modules[name].__dict__.get("forward") for name in points if name in modules}
    if on_meta(
        model
    ):  # a model built on meta traces on meta inputs (shapes alone), as pipeplan's capture does
        inputs = inputs.map(lambda tensor: tensor.to("meta"))
    try:
        # torch.export prints the partial graph on stderr when it fails: the caller reports it in one line
        with (
            preserved_buffers(model),
            quiet_torch_logs(),
            warnings.catch_warnings(),
            redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecations while it copies
            pipe = pipeline(
                model,
                mb_args=tuple(inputs.args),
                mb_kwargs=dict(inputs.kwargs) or None,
                split_spec=dict.fromkeys(points, SplitPoint.BEGINNING),
            )
    finally:
        # torch's non-strict export keeps its last trace's nodes (and their fake tensors) in a
        # module-level map until the next export; nothing reads it after the trace
        from torch.fx.experimental import proxy_tensor

        proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT.clear()
        for name, forward in saved.items():
            module = modules[name]
            module.__dict__.pop("_orig_forward", None)
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
    return pipe


def trace_torch_split(model: nn.Module, inputs: ModelInputs, points: Sequence[str]) -> TorchSplit:
    """Trace ``pipeline(model, ...)`` with a cut before each module of ``points`` and read its pieces
    (``torch_pipe``). Raises what ``pipeline()`` raises. O(graph nodes)."""
    pipe = torch_pipe(model, inputs, points)
    graph = pipe.split_gm.graph
    calls = [node for node in graph.nodes if node.op == "call_module"]
    piece_of = {node.name: k for k, node in enumerate(calls)}

    def producer(node: fx.Node) -> tuple[str, int]:
        source = node
        while source.op == "call_function" and source.target is operator.getitem:
            source = cast(fx.Node, source.args[0])  # a getitem of a piece's tuple of outputs
        if source.op == "placeholder":
            return node.name, INPUT
        return node.name, piece_of[source.name]

    pieces = []
    for node in calls:
        submodule: Any = pipe.split_gm.get_submodule(node.target)
        args = [a for a in (*node.args, *node.kwargs.values()) if hasattr(a, "op")]
        placeholders = [
            p for p in submodule.graph.nodes if p.op == "placeholder"
        ]  # 1:1 with node.args (torch's zip)
        strided = {
            arg.name
            for arg, p in zip(node.args, placeholders)
            if hasattr(arg, "op") and not _contiguous(p.meta.get("val"))
        }
        pieces.append(
            TorchPiece(
                parameters=frozenset(name for name, _ in submodule.named_parameters()),
                reads=tuple(producer(a) for a in args),
                part=int(
                    str(node.target).rsplit("_", 1)[-1]
                ),  # torch names the piece of partition K submod_pp_K
                strided=frozenset(strided),
            )
        )
    return TorchSplit(tuple(points), tuple(pieces))


def _contiguous(value: Any) -> bool:
    return not hasattr(value, "is_contiguous") or bool(value.is_contiguous())


def split_faults(split: TorchSplit) -> list[str]:
    """What torch.distributed.pipelining refuses when each piece is a stage, one phrase each:
    a model input read after the first stage (schedule.step feeds stage 0 alone), a value
    sent past the next stage or to several stages ("Backward of skip connections not
    supported yet"), a tensor that is not contiguous sent at all ("input tensor has to be
    contiguous")."""
    faults = []
    for (value, producer), readers in sorted(split.readers().items(), key=lambda item: item[0][1]):
        later = [k for k in readers if k != producer]
        if producer == INPUT and any(k > 0 for k in readers):
            faults.append(
                f"model input {value} is read by stage {max(readers)}, not only by stage 0 "
                f"(the schedule feeds the inputs to stage 0 alone)"
            )
        elif producer != INPUT and any(k != producer + 1 for k in later):
            faults.append(
                f"a value stage {producer} computes ({value}) is read by stages "
                f"{', '.join(map(str, sorted(set(later))))}, not by the next stage alone (torch sends "
                f'a value to the next stage only: "Backward of skip connections not supported yet")'
            )
        elif producer != INPUT and any(value in split.pieces[k].strided for k in later):
            faults.append(
                f"stage {producer} would send stage {producer + 1} a tensor that is not contiguous "
                f"({value}, a view such as a slice), which torch's send refuses (\"input tensor has "
                f'to be contiguous")'
            )
    return faults


def pipelining_split(
    model: nn.Module, inputs: ModelInputs, layer_names: Sequence[str], calls: dict[str, int]
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(Profile.pipelining_reach, Profile.pipelining_blocked)`` from one forward pass (the
    order of the module calls) and one trace of ``pipeline()`` cutting before every layer
    that is a module called once (n = number of layers):

    - reach: entry a, for a = 0 and each such layer a, is the last layer of the furthest
      piece of torch's split that reads a value computed before layer a (a model input is
      computed before layer 0), -1 when none; a piece holding no op reaches to the next
      piece's first layer (torch makes no stage of it); -1 for every other layer.
    - blocked: entry a says why torch cannot cut before layer a as the layer order does
      ("" where it can, or where a is no such cut): the Python code calls a later layer's
      module first, no op follows the last cut, or the cut would send a tensor that is not
      contiguous.

    Raises what ``pipeline()`` raises. O(layers * depth + graph nodes).
    """
    from pipeplan.capture.exported import preserved_buffers
    from pipeplan.capture.modules import module_calls

    n = len(layer_names)
    starts = [c for c in range(1, n) if calls.get(layer_names[c], 0) == 1]
    point = {c: outermost_split_point(layer_names, calls, c) for c in starts}
    with preserved_buffers(model):
        called = module_calls(model, inputs)
    points = set(point.values())
    rank = {name: k + 1 for k, name in enumerate(dict.fromkeys(name for name in called if name in points))}
    ranks = [rank.get(point[c], 0) for c in starts]  # torch's partition beginning at c (0: never called)
    reach = [-1] * n
    blocked: dict[int, str] = {}
    faithful = [0]  # 0, then the cuts whose partition order follows the layer order
    for k, c in enumerate(starts):
        if ranks[k] > max([0, *ranks[:k]]) and ranks[k] < min([len(starts) + 1, *ranks[k + 1 :]]):
            faithful.append(c)
        else:
            blocked[c] = "the Python code calls a later layer's module before it"
    split = trace_torch_split(model, inputs, [point[c] for c in starts])
    first_part = [
        0,
        *(rank[point[c]] for c in faithful[1:]),
    ]  # group g: partitions [first_part[g], first_part[g+1])
    group = [bisect_right(first_part, piece.part) - 1 for piece in split.pieces]
    ends = [*faithful[1:], n]  # group g holds layers [faithful[g], ends[g])
    last = [-1] * (len(faithful) + 1)  # last[g + 1]: the last group reading a value group g computes
    for (value, producer), readers in split.readers().items():
        source = INPUT if producer == INPUT else group[producer]
        last[source + 1] = max(last[source + 1], *(group[k] for k in readers))
        for k in readers:  # a view crosses every cut between its producer and this reader
            if producer != INPUT and value in split.pieces[k].strided:
                for g in range(source + 1, group[k] + 1):
                    blocked.setdefault(faithful[g], "the cut would send a tensor that is not contiguous")
    held, far = set(group), -1
    for g, start in enumerate(faithful):
        far = max(far, last[g])  # values of groups INPUT .. g - 1
        reach[start] = ends[far] - 1 if far >= 0 else -1
        if g not in held and g + 1 < len(faithful):  # no op: torch makes no stage of this group alone
            reach[start] = max(reach[start], faithful[g + 1])
        elif g not in held:
            blocked[start] = "no op follows the cut"
    return tuple(reach), tuple(blocked.get(a, "") for a in range(n))


def recorded_split(
    model: nn.Module,
    inputs: ModelInputs,
    layer_names: Sequence[str],
    records: Sequence[ModuleRecord],
    opaque: Sequence[str] = (),
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``pipelining_split`` for the profile; ((), ()) and one line on stderr when ``pipeline()``
    cannot trace the model (``partition --for pipelining`` then goes by the layer graph
    alone and ``export`` checks the split it writes). ((), ()) without a line when the
    capture made ``opaque`` modules: torch.export fails inside them, so ``pipeline()`` would
    too (the capture's own line said so)."""
    if opaque:
        return (), ()
    try:
        return pipelining_split(model, inputs, layer_names, {record.name: record.calls for record in records})
    except Exception as exc:  # whatever torch raises: the profile goes on without the fields
        message = (str(exc).strip().splitlines() or [""])[0][:160]
        sys.stderr.write(
            f"pipeplan: torch.distributed.pipelining's pipeline() cannot trace the model "
            f"({type(exc).__name__}: {message}); the profile records no pipelining_reach, so "
            f"partition --for pipelining goes by pipeplan's layers alone and export checks the split\n"
        )
        return (), ()
