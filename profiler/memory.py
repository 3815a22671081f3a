"""Byte counts of a layer: outputs, parameters, and what autograd saves for backward.

``saved_bytes`` is measured, not estimated: during one forward pass,
``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd packs for the
backward pass. We count each underlying storage once (deduplicated by the data pointer
of ``untyped_storage()``, at its full size, since a saved view keeps its whole storage
alive) and leave out the storages of parameters, which exist once per device whatever
the number of minibatches in flight. A saved layer *input* does count: autograd keeps
it alive until the backward pass, once per minibatch in flight.

``backward_working_bytes`` is what a layer's backward holds beyond that: the output
gradients handed in plus the most bytes its backward's new storages hold at once
(``pipeplan.profiler.live_bytes``), less the parameter gradients it leaves, which the
planner charges as gradients.

``deferred_weight_bytes`` is what a zero-bubble input pass ("I") leaves for its weight pass
("W"), beside the saved activations the retained graph keeps: the gradients it records at
the layer's boundary nodes (``pipeplan.split_backward``, the runtime's own split).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from pipeplan.profile import shared_parameters

if TYPE_CHECKING:  # typing only: torch is imported where it is used
    import torch

__all__ = [
    "tensors_in",
    "tensor_bytes",
    "output_bytes",
    "param_bytes",
    "storage_key",
    "SavedTensorCounter",
    "PackCounter",
    "counting_hooks",
    "count_saved",
    "backward_working_bytes",
    "deferred_weight_bytes",
    "shared_parameter_bytes",
]


def tensors_in(value: object) -> list[torch.Tensor]:
    """Every tensor in ``value`` (a tensor, or nested tuples / lists / dicts of them)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in tensors_in(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in tensors_in(item)]
    return []


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements: ``numel * element_size`` (what a transfer sends)."""
    return int(tensor.numel()) * int(tensor.element_size())


def output_bytes(outputs: object) -> int:
    """Bytes of every tensor in ``outputs``, each distinct tensor object counted once."""
    seen: dict[int, int] = {}
    for tensor in tensors_in(outputs):
        seen[id(tensor)] = tensor_bytes(tensor)
    return sum(seen.values())


def param_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct parameters (a parameter listed twice counts once)."""
    seen: dict[int, int] = {}
    for parameter in parameters:
        seen[storage_key(parameter)] = tensor_bytes(parameter)
    return sum(seen.values())


def largest_param_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the largest parameter (0 for none): the gradient temporary autograd makes for it."""
    return max((tensor_bytes(parameter) for parameter in parameters), default=0)


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the memory behind ``tensor``: its untyped storage's data pointer."""
    try:
        pointer = int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses)
        return id(tensor)
    return pointer if pointer else id(tensor)


def _storage_nbytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return tensor_bytes(tensor)


class SavedTensorCounter:
    """Collects the distinct storages autograd packs for backward (parameters excluded).

    It keeps each counted tensor alive, so no storage it counted can be freed and its
    address reused by another (which would then go uncounted).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {storage_key(tensor) for tensor in exclude}
        self.storages: dict[int, int] = {}  # storage key -> bytes
        self.packed: set[int] = set()  # every storage packed since ``take_packed``, counted or not
        self.seen: set[int] = set()  # every storage packed, the excluded ones too
        self._alive: list[torch.Tensor] = []

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor``; what autograd saves is a detached alias (same storage): a saved
        output returned as itself would hold its own ``grad_fn`` through the saved variable,
        a cycle in C++ the collector cannot free."""
        key = storage_key(tensor)
        alias = tensor.detach()
        self.seen.add(key)
        if key not in self._excluded:
            self.packed.add(key)
            if key not in self.storages:
                self.storages[key] = _storage_nbytes(tensor)
                self._alive.append(alias)
        return alias

    def take_packed(self) -> set[int]:
        """The storages packed since the last call (parameters excluded), each once."""
        packed, self.packed = self.packed, set()
        return packed

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def saved_bytes(self) -> int:
        return sum(self.storages.values())


@contextmanager
def count_saved(
    exclude: Iterable[torch.Tensor] = (), counter: SavedTensorCounter | None = None
) -> Iterator[SavedTensorCounter]:
    """Within the block, record what autograd saves; ``exclude`` (parameters) is not counted.

    Pass ``counter`` to add to an earlier block's record (a storage counts once in all).

    >>> import torch
    >>> layer = torch.nn.Linear(4, 8)
    >>> with count_saved(exclude=layer.parameters()) as counter:
    ...     _ = layer(torch.randn(2, 4, requires_grad=True))
    >>> counter.saved_bytes  # the (2, 4) float32 input: 2 * 4 * 4 bytes
    32
    """

    if counter is None:
        counter = SavedTensorCounter(exclude)
    with counting_hooks(counter):
        yield counter


class PackCounter(Protocol):
    """What ``counting_hooks`` hands packed tensors to (``SavedTensorCounter`` and the like)."""

    def pack(self, tensor: torch.Tensor) -> torch.Tensor: ...


def counting_hooks(counter: PackCounter) -> torch.autograd.graph.saved_tensors_hooks:
    """``saved_tensors_hooks`` that hand each packed tensor to ``counter.pack`` through a weak
    reference. The autograd graph keeps its pack hook and the counter keeps the graph's
    tensors alive: strong both ways, that cycle runs through C++ where the collector cannot
    see it, and no counted activation was ever freed (measured: the layer-by-layer profile
    of a 32-layer Llama held every layer's saved tensors, 11.7 GiB of a GPU)."""
    import weakref

    import torch

    ref = weakref.ref(counter)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        alive = ref()
        return tensor if alive is None else alive.pack(tensor)

    return torch.autograd.graph.saved_tensors_hooks(pack, SavedTensorCounter.unpack)


def _distinct_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        seen[storage_key(tensor)] = _storage_nbytes(tensor)
    return sum(seen.values())


def backward_working_bytes(
    heads: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    parameters: Iterable[torch.Tensor],
    inputs: Iterable[object] = (),
) -> int:
    """Run ``torch.autograd.backward(heads, grads)`` and return the most bytes it held beyond
    what the forward saved: ``grads`` (each storage once) plus the peak of the storages made
    during the call, less the gradients of ``parameters`` made during it and alive at its end.

    The gradients already on ``parameters`` and on the layer's ``inputs`` (the leaves it
    reads) are set aside for the call and added back after it, so the figure is what the
    backward makes when it is the first to give them a gradient, whatever ran before. Added
    into an existing gradient, it would make no storage of its own (a layer passing its input
    through) or a temporary of the parameter's size (which the planner charges as
    ``largest_param_bytes``). So layers measured alone (``pipeplan.profiler.layerwise``) and
    in one pass (``pipeplan.profiler.measure``) agree where values and weights have several
    readers (a tied weight, a residual stream).

    >>> import torch
    >>> layer = torch.nn.Linear(1024, 1024)  # a 4 MiB weight, tiny activations
    >>> x = torch.randn(2, 1024, requires_grad=True)
    >>> y = layer(x)
    >>> backward_working_bytes([y], [torch.ones_like(y)], layer.parameters(), [x])  # dy in, dx out
    16384
    """
    import torch

    from pipeplan.profiler.live_bytes import LiveBytes

    owned = list({id(p): p for p in parameters}.values())
    leaves = [t for t in tensors_in(list(inputs)) if t.requires_grad and t.is_leaf]
    aside = list({id(t): t for t in (*owned, *leaves)}.values())
    earlier = [t.grad for t in aside]
    for tensor in aside:
        tensor.grad = None
    try:
        with LiveBytes() as live:
            torch.autograd.backward(list(heads), list(grads))
            made = {storage_key(g): live.storage_bytes(g) for p in owned if (g := p.grad) is not None}
            peak = live.peak
    finally:
        for tensor, grad in zip(aside, earlier):
            if grad is not None:
                tensor.grad = grad if tensor.grad is None else grad + tensor.grad
    return _distinct_storage_bytes(grads) + max(0, peak - sum(made.values()))


def deferred_weight_bytes(
    heads: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    parameters: Iterable[torch.Tensor],
    inputs: Iterable[object] = (),
) -> int:
    """Bytes of the gradients a zero-bubble input pass from ``heads`` (given ``grads``) to the
    layer's ``inputs`` records for the weight pass of ``parameters`` (each storage once): what
    the runtime holds from "I" to "W" beyond the saved activations. The graph is kept for the
    caller's backward and no ``.grad`` changes; 0 where no input needs a gradient (a first
    stage's "W" is then its whole backward, and records nothing).

    >>> import torch
    >>> layer = torch.nn.Linear(4, 8)
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> y = layer(x)
    >>> deferred_weight_bytes([y], [torch.ones_like(y)], layer.parameters(), [x])  # dy: 2 x 8 float32
    64
    """
    from pipeplan.split_backward import backward_input

    leaves = [t for t in tensors_in(list(inputs)) if t.requires_grad]
    params = [p for p in parameters if p.requires_grad]
    if not leaves or not params:
        return 0
    _, work = backward_input(list(heads), list(grads), leaves, params)
    return _distinct_storage_bytes(work.recorded())


def shared_parameter_bytes(model: torch.nn.Module, users: Iterable[Iterable[str]]) -> dict[str, int]:
    """Bytes of each of ``model``'s parameters named by more than one layer (``users``: each
    layer's qualified parameter names, as ``LayerProfile.parameters``): a tied weight. Sizes
    only, so a model on the meta device answers too.

    >>> import torch
    >>> shared_parameter_bytes(torch.nn.Linear(4, 2), [("weight",), ("weight", "bias")])
    {'weight': 32}
    """
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    return {name: sizes[name] for name in shared_parameters(enumerate(users)) if name in sizes}
