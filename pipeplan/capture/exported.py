"""Capture a library model's graph with ``torch.export`` (non-strict) and name its layers.

``torch.fx`` symbolic tracing stops at data-dependent Python, which Hugging Face
transformers models have (mask helpers, slice bounds). ``torch.export.export(model,
args, strict=False)`` runs the Python code for real and records the ATen ops, each with
the module stack it ran in (``node.meta["nn_module_stack"]``). ``export_graph`` turns the
exported program into a plain ``fx.GraphModule`` over the user's model:

- parameters and buffers, which are graph inputs in an exported program, become
  ``get_attr`` nodes on their qualified names, so every stage built from the graph holds
  the model's own ``nn.Parameter`` objects (training a stage trains the model; a tied
  weight is one object wherever it is read);
- a buffer the forward updates (BatchNorm running statistics) is written back in place
  (``aten.copy_``), as the eager module would;
- the output is the flat list of the model's output tensors; ``out_spec`` rebuilds what
  the model returns (a ``ModelOutput``, dict, dataclass or tuple) from them.

Output values that are not tensors and that export cannot carry (a ``DynamicCache``
under ``past_key_values``) are dropped (set to ``None``) and named in ``dropped``.

Where export fails inside a module, that module's class is made opaque and export runs
again (``pipeplan.capture.opaque``: ``opaque_fallback`` decides, ``opaque_calls`` runs it).

*Layers* (``layer_of_node``): an op belongs to the outermost module of its stack that is
a layer module (``is_layer_module``): a class named in ``leaf_modules``; a module with no
children; or a child of a repeated block (an element of a ``ModuleList`` / ``Sequential``
holding two or more modules of its class) that holds no repeated block itself (an element
of a block's ``ModuleList``, which is iterated and never called, counts as its child: T5). A GPT-2
block gives 4 layers (``ln_1``, ``attn``, ``ln_2``, ``mlp``), a BERT layer 3
(``attention``, ``intermediate``, ``output``). Ops outside every layer module (a residual
add in a block's ``forward``, mask construction) are folded into neighbours by
``pipeplan.capture.grouping``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import sys
from collections.abc import Collection, Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from pipeplan.capture.captured import CapturedGraph, LayerModule
from pipeplan.capture.materialise import fake_mode_for
from pipeplan.capture.opaque import holds_any, opaque_calls, opaque_fallback, recorded_calls, run_opaque_calls
from pipeplan.errors import InputError
from pipeplan.model_inputs import ModelInputs

__all__ = [
    "export_graph",
    "is_layer_module",
    "capture_error",
    "preserved_buffers",
]


_PREFIX = "model."  # the user's model inside _UserCall


class _UserCall(nn.Module):
    """The user's model called as the user calls it, from its flat input tensors.

    ``forward(*tensors)`` puts the tensors back into the user's positional and keyword
    arguments (``ModelInputs.with_tensors``) and sets the output fields ``dropped`` to None.
    """

    def __init__(self, model: nn.Module, inputs: ModelInputs, dropped: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.inputs = inputs
        self.dropped = dropped

    def forward(self, *tensors: torch.Tensor) -> pytree.PyTree:
        output = self.inputs.with_tensors(tensors).call(self.model)
        for name in self.dropped:
            if isinstance(output, dict):
                output[name] = None
            else:
                output = dataclasses.replace(output, **{name: None})
        return output


def export_graph(
    model: nn.Module,
    sample_inputs: ModelInputs,
    leaf_modules: Collection[str] = (),
    opaque_modules: Collection[str] = (),
) -> CapturedGraph:
    """Export ``model`` on ``sample_inputs`` (shapes are specialised to them) and name layers.

    The graph's inputs are the flat tensors of ``sample_inputs`` (``ModelInputs.tensors``).
    Modules of the classes in ``opaque_modules`` are opaque layers (``pipeplan.capture.opaque``).
    Where export fails inside a module, that module's class becomes opaque too (one line on
    stderr says so: ``opaque_fallback``) and export runs again. Raises ``InputError`` (one
    line: exception, file:line, the way around) when export still fails. A model on meta is
    exported under ``fake_stand_ins`` (``build_layer_graph``). Runs the model eagerly once,
    plus once per attempt with opaque modules, and under export: O(ops).
    """
    with preserved_buffers(model):  # the sample run must not move BatchNorm statistics
        dropped = _register_outputs(model, sample_inputs)
    wrapped = bool(dropped) or not sample_inputs.positional
    root: nn.Module = _UserCall(model, sample_inputs, dropped) if wrapped else model
    prefix = _PREFIX if wrapped else ""
    opaque = tuple(dict.fromkeys(opaque_modules))
    while True:
        try:
            graph_module, out_spec = _export(model, root, sample_inputs.tensors(), prefix, opaque)
            break
        except _ExportFailed as failed:
            exc = failed.__cause__ or failed
            _, module_class = _failure_site(exc, model)
            more_opaque = opaque_fallback(module_class, opaque, _reason(exc))
            if more_opaque is None:
                raise InputError(capture_error(model, exc, "torch.export")) from exc
            opaque = more_opaque
    _out_of_place(graph_module.graph)
    graph_module.recompile()
    layer_call, layer_modules = _layers_of(model, graph_module, prefix, {*leaf_modules, *opaque})
    return CapturedGraph(graph_module, "export", layer_call, layer_modules, out_spec, dropped, opaque)


class _ExportFailed(Exception):
    """torch.export raised (the cause); ``export_graph`` may retry with an opaque module."""


def _export(
    model: nn.Module, root: nn.Module, tensors: tuple[torch.Tensor, ...], prefix: str, opaque: tuple[str, ...]
) -> tuple[fx.GraphModule, pytree.TreeSpec]:
    """One export attempt with ``opaque`` classes run as themselves; the graph and output spec."""
    stderr = io.StringIO()  # on a failure, torch.export prints the partial graph there
    with contextlib.ExitStack() as stack:
        calls = []
        if opaque and holds_any(model, opaque):  # one eager run learns the opaque calls' outputs
            with (
                recorded_calls(model, opaque) as calls,
                torch.no_grad(),
                preserved_buffers(model),
                fake_mode_for(model),
            ):
                root(*tensors)
            stack.enter_context(opaque_calls(model, opaque, calls))
        try:
            with quiet_torch_logs(), redirect_stderr(stderr):
                program = torch.export.export(root, tensors, strict=False)
        except Exception as exc:
            raise _ExportFailed() from exc
        sys.stderr.write(stderr.getvalue())
        graph_module = _as_graph_module(model, program, prefix)
        if calls:
            run_opaque_calls(graph_module, calls)
    return graph_module, program.call_spec.out_spec


def _reason(exc: BaseException) -> str:
    """``Type: first line`` of an exception, at most 120 characters."""
    message = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {message[:117] + '...' if len(message) > 120 else message}"


@contextmanager
def preserved_buffers(model: nn.Module) -> Iterator[None]:
    """Restore the model's buffers (BatchNorm running statistics) after the block."""
    saved = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


@contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """Silence torch's warnings (graph dumps on a failed guard) while exporting: a failure
    is reported as one line by ``capture_error``."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def _register_outputs(model: nn.Module, sample_inputs: ModelInputs) -> tuple[str, ...]:
    """Run the model once; register plain dataclass outputs with pytree; name fields to drop."""
    with torch.no_grad(), fake_mode_for(model):  # a model on meta: shapes only
        output = sample_inputs.call(model)
    if dataclasses.is_dataclass(output) and type(output) not in pytree.SUPPORTED_NODES:
        pytree.register_dataclass(type(output))
    if isinstance(output, dict):
        fields: list[tuple[str, Any]] = list(output.items())
    elif dataclasses.is_dataclass(output):
        fields = [(f.name, getattr(output, f.name)) for f in dataclasses.fields(output)]
    else:
        fields = []
    return tuple(name for name, value in fields if not _exportable(value))


def _exportable(value: pytree.PyTree) -> bool:
    return all(
        leaf is None or isinstance(leaf, (torch.Tensor, int, float, bool, str))
        for leaf in pytree.tree_leaves(value)
    )


def _as_graph_module(model: nn.Module, program: torch.export.ExportedProgram, prefix: str) -> fx.GraphModule:
    """The exported graph with parameters/buffers as ``get_attr`` on the user's model."""
    from torch.export.graph_signature import InputKind, OutputKind

    signature = program.graph_signature
    input_spec = {spec.arg.name: spec for spec in signature.input_specs}
    attributes: dict[str, Any] = {}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in program.graph.nodes:
        if node.op == "placeholder":
            spec = input_spec[node.name]
            if spec.kind == InputKind.USER_INPUT:
                env[node] = graph.placeholder(node.name)
                env[node].meta = dict(node.meta)
                continue
            if not node.users:
                continue
            target = _strip(spec.target, prefix)
            if spec.kind == InputKind.PARAMETER:
                attributes[target] = model.get_parameter(target)
            elif spec.kind == InputKind.BUFFER:
                attributes[target] = model.get_buffer(target)
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                target = f"_pipeplan_constant_{len(attributes)}"
                attributes[target] = program.constants[spec.target]
            else:
                raise InputError(
                    f"torch.export gave a {spec.kind.name} graph input, which pipeplan cannot run"
                )
            env[node] = graph.get_attr(target)
            env[node].meta = dict(node.meta)
        elif node.op == "output":
            outputs = list(node.args[0])
            user_outputs = []
            for spec, value in zip(signature.output_specs, outputs):
                if spec.kind == OutputKind.USER_OUTPUT:
                    user_outputs.append(env[value] if isinstance(value, fx.Node) else value)
                elif spec.kind == OutputKind.BUFFER_MUTATION:
                    buffer = graph.get_attr(_strip(spec.target, prefix))
                    attributes.setdefault(buffer.target, model.get_buffer(str(buffer.target)))  # type: ignore[arg-type]
                    graph.call_function(torch.ops.aten.copy_.default, (buffer, env[value]))
                else:
                    raise InputError(
                        f"torch.export gave a {spec.kind.name} output, which pipeplan cannot run"
                    )
            graph.output(tuple(user_outputs))
        else:
            if node.op == "get_attr":  # a higher-order op's body (an autocast or grad-mode region)
                attributes[str(node.target)] = getattr(program.graph_module, str(node.target))
            env[node] = graph.node_copy(node, lambda used: env[used])
    return fx.GraphModule(attributes, graph, class_name=type(model).__name__)


def _out_of_place(graph: fx.Graph) -> int:
    """Rewrite in-place ATen ops on activations (``x += r`` in a residual block) as
    out-of-place ops, later readers of ``x`` reading the result; return how many.

    A stage's inputs are leaf tensors that require grad, which autograd forbids
    modifying in place, and a layer must not change a value another layer (or stage)
    reads. Ops on attributes (a BatchNorm's ``num_batches_tracked``) stay in place; so do
    ops on a view (writing through it changes its base, which only in place can do).
    """
    order = {node: position for position, node in enumerate(graph.nodes)}
    rewritten = 0
    for node in list(graph.nodes):
        functional = _functional_variant(node)
        target = node.args[0] if node.args else None
        if (
            functional is None
            or not isinstance(target, fx.Node)
            or target.op == "get_attr"
            or _is_view(target)
        ):
            continue
        with graph.inserting_after(node):
            replacement = graph.call_function(functional, node.args, node.kwargs)
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        for user in list(target.users):
            if user is not replacement and order.get(user, -1) > order[node]:
                user.replace_input_with(target, replacement)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _functional_variant(node: fx.Node) -> Any:
    """``aten.add.Tensor`` for an ``aten.add_.Tensor`` node, else None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    name = schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_") or not schema.arguments:
        return None
    alias = schema.arguments[0].alias_info
    if alias is None or not alias.is_write:
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _is_view(node: fx.Node) -> bool:
    """Whether ``node`` returns a view of one of its inputs (its schema aliases the output)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return node.op == "call_function"  # an unknown function (getitem of a split): assume a view
    return any(ret.alias_info is not None for ret in target._schema.returns)


def _strip(target: str | None, prefix: str) -> str:
    text = str(target)
    return text[len(prefix) :] if prefix and text.startswith(prefix) else text


def _layers_of(
    model: nn.Module, graph_module: fx.GraphModule, prefix: str, leaf_modules: set[str]
) -> tuple[dict[str, str], dict[str, LayerModule]]:
    modules = dict(model.named_modules(remove_duplicate=False))
    blocks = _repeated_blocks(model)
    holds_blocks = {name for name in modules if any(b.startswith(f"{name}.") for b in blocks)}
    # a block's ModuleList / ModuleDict is iterated, never called (T5Block.layer): its
    # elements are the block's children as far as layers go
    parts = {
        f"{name}.{child}"
        for name, module in modules.items()
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and name.rpartition(".")[0] in blocks
        for child, _ in module.named_children()
    }
    layer_call: dict[str, str] = {}
    layer_modules: dict[str, LayerModule] = {}
    for node in graph_module.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        for key, (path, _) in stack.items():
            name = _strip(path, prefix) if path != prefix.rstrip(".") else ""
            module = modules.get(name)
            if not name or module is None:
                continue
            if is_layer_module(name, module, leaf_modules, blocks, holds_blocks, parts):
                layer_call[node.name] = key
                layer_modules[key] = LayerModule(name, type(module).__name__)
                break
    return layer_call, layer_modules


def _repeated_blocks(model: nn.Module) -> set[str]:
    """Qualified names of modules that are elements of a container with 2+ of their class."""
    blocks = set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            children = list(module.named_children())
            for child_name, child in children:
                if sum(type(other) is type(child) for _, other in children) >= 2:
                    blocks.add(f"{name}.{child_name}" if name else child_name)
    return blocks


def is_layer_module(
    name: str,
    module: nn.Module,
    leaf_modules: set[str],
    blocks: set[str],
    holds_blocks: set[str],
    parts: Collection[str] = (),
) -> bool:
    """Whether the module called ``name`` is one layer (see the module docstring); ``parts``:
    elements of a block's uncalled ModuleList / ModuleDict, which count as the block's children."""
    if type(module).__name__ in leaf_modules or not any(True for _ in module.children()):
        return True
    if name in holds_blocks or name in blocks:
        return False
    return name.rpartition(".")[0] in blocks or name in parts


def capture_error(model: nn.Module, exc: BaseException, tool: str) -> str:
    """One line: what failed, where (the deepest frame outside torch), and the way around it."""
    message = (str(exc).strip().splitlines() or [""])[0]
    if len(message) > 200:
        message = message[:197] + "..."
    where, module_class = _failure_site(exc, model)
    if "not a known type" in message or "pytree" in message:
        hint = (
            "the model returns a value that is not a tensor; return only tensors (for a "
            "Hugging Face model build it with use_cache=False)"
        )
    elif module_class:
        hint = (
            f"name {module_class} in --leaf-modules (or LEAF_MODULES in the model file) so "
            f"that torch.fx keeps it whole, or another module in --opaque-modules (OPAQUE_MODULES) "
            f"so that it runs as itself, or change the code there"
        )
    else:
        hint = "change the code there, or wrap the model as an nn.Sequential of its layers"
    at = f" at {where}" if where else ""
    return f"{tool} cannot capture {type(model).__name__}{at} ({type(exc).__name__}: {message}); {hint}"


def _failure_site(exc: BaseException, model: nn.Module) -> tuple[str, str]:
    """(file:line of the deepest frame outside torch, class of the innermost module there)."""
    torch_dir = str(Path(torch.__file__).parent)
    site, module_class = "", ""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        filename = frame.f_code.co_filename
        if not filename.startswith(torch_dir) and not filename.startswith("<") and filename != __file__:
            site = f"{filename}:{tb.tb_lineno}"
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and owner is not model and not isinstance(owner, _UserCall):
                module_class = type(owner).__name__
        tb = tb.tb_next
    return site, module_class
