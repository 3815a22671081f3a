"""Turn one stage module into a tensor-parallel one: DTensor parameters, replicated activations at its edges.

A stage module is a captured graph (``pipeplan.capture``): a ``torch.export`` capture of a
Hugging Face model holds ATen ops whose shapes are constants of the whole model (a view
to 4 heads), and reads each parameter from a bare container module. So the stage is
parallelised in DTensor's *global* view rather than by rewriting shapes:

- ``parallelize_module`` splits the planned parameters (``SplitParameters``, one per
  module: a ``ParallelStyle`` that shards by the module's kind, see
  ``tensor_parallel.plans``); every other parameter becomes a replicated DTensor (a
  tensor tied inside the stage stays one tensor);
- the stage's floating-point inputs enter as replicated DTensors, so every op runs on
  DTensors and DTensor's sharding propagation inserts the collectives: a
  column-parallel matmul yields activations sharded on features, a row-parallel one a
  partial sum that is all-reduced where a replicated value needs it, as in Megatron;
- the stage's outputs leave as full tensors (``full_tensor``), identical on every rank
  of the group, so point-to-point between stages sends plain, replicated activations.

Model code that creates tensors (masks, positions) mixes plain tensors with DTensors;
``compute_context`` treats those as replicated (``implicit_replication``). On CPU it also
selects the math attention kernel, whose ops DTensor can shard (its fused CPU kernel's
backward has no sharding rule). Random ops in a split region (dropout) draw per rank on
CPU: train with dropout 0 to compare against single-process runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.utils import _pytree as pytree

from pipeplan.tensor_parallel.sequence import gather_sequence, scatter_sequence, sequence_parallel_modules

__all__ = [
    "SplitParameters",
    "parallelize_stage",
    "compute_context",
    "settle_gradients",
    "local",
    "full",
    "counted_here",
    "replicate",
]


class SplitParameters(ParallelStyle):
    """Shard a module's parameters on ``dims`` (name -> dim) over the mesh; replicate the rest.

    Only the parameters change: activations follow DTensor's sharding propagation (the
    stage's graph does not call its container modules, so module hooks would not run).
    """

    def __init__(self, dims: dict[str, int]) -> None:
        super().__init__()
        self.dims = dict(dims)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            placement = Shard(self.dims[name]) if name in self.dims else Replicate()
            module.register_parameter(
                name,
                nn.Parameter(
                    distribute_tensor(param.detach(), device_mesh, [placement]),
                    requires_grad=param.requires_grad,
                ),
            )
        return module


def parallelize_stage(
    module: nn.Module, splits: dict[str, dict[str, int]], mesh: DeviceMesh, sequence_parallel: bool = False
) -> None:
    """Split ``module``'s planned parameters over the 1-D tensor ``mesh``, in place.

    ``splits``: local module path in ``module`` -> {parameter name: dim}. ``sequence_parallel``
    (``StagePlan.sequence_parallel``): Megatron's sequence parallelism
    (``pipeplan.tensor_parallel.sequence``).
    """
    from pipeplan.tensor_parallel.experts import register_expert_rules

    register_expert_rules()
    _drop_metadata_asserts(module)
    _reduce_after_embeddings(module)
    owners = _owners(module)
    parallelize_module(module, mesh, {path: SplitParameters(dims) for path, dims in splits.items()})
    if sequence_parallel:
        sequence_parallel_modules(module, mesh)
    _megatron_collectives(module, sequence_parallel)
    for holders in owners.values():  # every other parameter: one replicated DTensor per tensor
        first_owner, first_name = holders[0]
        param = first_owner._parameters[first_name]
        if param is None:
            continue
        if not isinstance(param, DTensor):
            param = nn.Parameter(
                distribute_tensor(param.detach(), mesh, [Replicate()]), requires_grad=param.requires_grad
            )
        for owner, name in holders:
            owner._parameters[name] = param
    module.register_forward_pre_hook(lambda _, args: _enter(args, mesh))
    module.register_forward_hook(lambda _, args, output: _leave(output))


def _drop_metadata_asserts(module: nn.Module) -> None:
    """Remove the capture's dtype/device assertions (``aten._assert_tensor_metadata``).

    They check a plain tensor's metadata at capture time, yield nothing, and DTensor has
    no sharding rule for them; the values they check are unchanged by the split.
    """
    import torch.fx as fx

    target = torch.ops.aten._assert_tensor_metadata.default
    for sub in module.modules():
        if isinstance(sub, fx.GraphModule):
            asserts = [
                node for node in sub.graph.nodes if node.op == "call_function" and node.target is target
            ]
            for node in asserts:
                sub.graph.erase_node(node)
            if asserts:
                sub.recompile()


def _reduce_after_embeddings(module: nn.Module) -> None:
    """All-reduce each embedding lookup's output where it is made (Megatron's vocabulary-parallel embedding).

    A lookup in a row-split table yields a masked partial sum whose mask lives only until
    the next op: an op in between (a dtype cast, as Llama's norm makes) loses it and
    DTensor then cannot reduce. Reducing at once is what Megatron does.
    """
    import torch.fx as fx

    target = torch.ops.aten.embedding.default
    for sub in module.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        lookups = [node for node in sub.graph.nodes if node.op == "call_function" and node.target is target]
        for node in lookups:
            with sub.graph.inserting_after(node):
                reduced = sub.graph.call_function(replicate_partial, (node,))
            node.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not reduced)
        if lookups:
            sub.recompile()


def _megatron_collectives(module: nn.Module, sequence_parallel: bool = False) -> None:
    """Communicate where Megatron does, around each matmul that reads a split weight.

    After it, a partial sum (a row-parallel output) is all-reduced at once; before it, the
    activation it reads gets its gradient all-reduced where that gradient is a partial sum
    (a column-parallel input; q, k and v reading one activation share one all-reduce).
    Left to itself, DTensor defers a partial sum through the residual add and then, on
    small layers, gathers the next column-parallel weight instead of splitting its matmul.
    Matmuls are ATen ops reading weights as graph attributes (a ``torch.export`` capture)
    or calls of ``nn.Linear`` modules (an fx capture). Under ``sequence_parallel`` the
    all-reduces become Megatron's sequence-parallel pair: a partial sum is reduce-scattered
    onto sequence shards (``scatter_sequence``) and a sequence-sharded activation all-gathered
    before the matmul (``gather_sequence``: its gradient reduce-scattered back).
    """
    before = gather_or_reduce if sequence_parallel else reduce_gradient
    after_split = scatter_or_replicate if sequence_parallel else replicate_partial
    import torch.fx as fx

    matmuls = {
        torch.ops.aten.linear.default,
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.matmul.default,
    }
    grouped = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if grouped is not None:  # MoE experts' grouped matmul (tensor_parallel.experts)
        matmuls.add(grouped.default)
    transposes = {torch.ops.aten.transpose.int, torch.ops.aten.t.default}
    for sub in module.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        split = {
            node for node in sub.graph.nodes if node.op == "get_attr" and _is_split(sub, str(node.target))
        }
        split |= {  # a split weight read transposed (the experts' grouped matmul)
            node
            for node in sub.graph.nodes
            if node.op == "call_function" and node.target in transposes and node.args[0] in split
        }
        reduced: dict[fx.Node, fx.Node] = {}  # activation -> its gradient-reducing identity
        changed = False
        for node in list(sub.graph.nodes):
            reads_split = (
                node.op == "call_function"
                and node.target in matmuls
                and any(a in split for a in node.args)
                or node.op == "call_module"
                and _holds_split(sub, str(node.target))
            )
            if not reads_split:
                continue
            for arg in node.args:
                if isinstance(arg, fx.Node) and arg not in split and arg.op != "get_attr":
                    if arg not in reduced:
                        with sub.graph.inserting_after(arg):
                            reduced[arg] = sub.graph.call_function(before, (arg,))
                    node.replace_input_with(arg, reduced[arg])
            with sub.graph.inserting_after(node):
                after = sub.graph.call_function(after_split, (node,))
            node.replace_all_uses_with(after, delete_user_cb=lambda user: user is not after)
            _gather_once_for_slices(sub, after)
            changed = True
        if changed:
            sub.recompile()


def _gather_once_for_slices(sub: torch.fx.GraphModule, value: torch.fx.Node) -> None:
    """Gather ``value`` once where several slices read it (Phi-3's fused qkv, split into q, k
    and v: ``colwise_gather_output``); left to DTensor, each slice gathers it again."""
    users = list(value.users)
    if len(users) < 2 or not all(
        user.op == "call_function" and user.target is torch.ops.aten.slice.Tensor for user in users
    ):
        return
    with sub.graph.inserting_after(value):
        whole = sub.graph.call_function(replicate, (value,))
    value.replace_all_uses_with(whole, delete_user_cb=lambda user: user is not whole)


def replicate(value: object) -> object:
    """``value`` replicated over its mesh when it is a split DTensor (an all-gather), else itself."""
    if isinstance(value, DTensor) and not all(p.is_replicate() for p in value.placements):
        return value.redistribute(value.device_mesh, [Replicate()] * len(value.placements))
    return value


def _holds_split(sub: nn.Module, target: str) -> bool:
    """Whether the module ``target`` (an fx capture's linear layer) holds a split weight."""
    module = sub.get_submodule(target)
    return isinstance(module, nn.Linear) and _is_split(module, "weight")


def _is_split(sub: nn.Module, target: str) -> bool:
    try:
        param = sub.get_parameter(target)
    except AttributeError:
        return False
    return isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)


def replicate_partial(value: object) -> object:
    """``value`` replicated when it is a partial-sum DTensor (an all-reduce), else itself.

    Its gradient is all-reduced where it arrives as a partial sum: DTensor cannot turn a
    plain partial sum back into an embedding's masked one.
    """
    if isinstance(value, DTensor) and any(p.is_partial() for p in value.placements):
        return _ReducedGradient.apply(
            value.redistribute(value.device_mesh, [Replicate()] * len(value.placements))
        )
    return value


def gather_or_reduce(value: object) -> object:
    """Sequence parallelism before a split matmul: a sequence-sharded activation all-gathered
    (``gather_sequence``), a replicated one with its gradient all-reduced (``reduce_gradient``)."""
    gathered = gather_sequence(value)
    return gathered if gathered is not value else reduce_gradient(value)


def scatter_or_replicate(value: object) -> object:
    """Sequence parallelism after a split matmul: a partial sum reduce-scattered onto sequence
    shards (``scatter_sequence``), else ``replicate_partial``."""
    scattered = scatter_sequence(value)
    return scattered if scattered is not value else replicate_partial(value)


def reduce_gradient(value: object) -> object:
    """``value`` itself; its gradient all-reduced where it is a partial sum (Megatron's f)."""
    if isinstance(value, DTensor) and value.requires_grad:
        return _ReducedGradient.apply(value)
    return value


class _ReducedGradient(torch.autograd.Function):
    """Identity forward; a partial-sum gradient leaves replicated (one all-reduce)."""

    @staticmethod
    def forward(ctx: FunctionCtx, value: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return value.view_as(value)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            return grad.redistribute(grad.device_mesh, [Replicate()] * len(grad.placements))
        return grad


def _owners(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Each parameter tensor -> every (module, name) holding it (a tie holds it twice)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((sub, name))
    return owners


def _enter(args: tuple[object, ...], mesh: DeviceMesh) -> tuple[object, ...]:
    """Floating-point inputs as replicated DTensors (their gradient comes back whole)."""
    return tuple(
        DTensor.from_local(a, mesh, [Replicate()], run_check=False)
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.is_floating_point()
        else a
        for a in args
    )


def _leave(output: object) -> object:
    return pytree.tree_map_only(DTensor, lambda t: t.full_tensor(), output)


@contextlib.contextmanager
def compute_context(device_type: str) -> Iterator[None]:
    """Where a tensor-parallel stage runs forward, backward and its step."""
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with contextlib.ExitStack() as stack:
        stack.enter_context(implicit_replication())
        if device_type == "cpu":
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        yield


def settle_gradients(module: nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements (collective in the tensor group).

    Sharding propagation may leave a gradient replicated or partial where its parameter
    is sharded; the data-parallel all-reduce and the optimizer work on local shards.
    """
    for param in module.parameters():
        grad = param.grad
        if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (its storage: writes land in the DTensor), else the tensor."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered over the tensor group for a DTensor: collective)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def counted_here(tensor: torch.Tensor, tp_index: int) -> bool:
    """Whether this rank counts ``tensor`` in a sum over its group: every rank its shards,
    rank 0 what every rank holds whole."""
    if isinstance(tensor, DTensor) and any(p.is_shard() for p in tensor.placements):
        return True
    return tp_index == 0
