"""``ModelInputs``: a model's inputs as the user calls it, positional and keyword, and their flat tensors.

``sample_batch`` and ``data_loader`` return inputs as a tensor, a tuple (positional) or a
dict (keyword arguments, ``model(**inputs)``: a tokenizer's output). Values are tensors,
``None``, or plain constants (bool, int, float, str) that are the same in every batch.
Everything downstream of capture sees only the *flat tensors*: the tensor values, the
positional ones first, then the keyword ones in the dict's order; the captured graph
takes them as its inputs, in that order, and a stage reads model input ``k`` by that
position (``input:k``). ``names()`` says which argument each flat tensor is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from pipeplan.errors import InputError

__all__ = ["ModelInputs", "model_inputs"]

_CONSTANTS = (bool, int, float, str)


@dataclass(frozen=True)
class ModelInputs:
    args: tuple[Any, ...]  # positional: tensors, None or constants
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword: tensors, None or constants

    def tensors(self) -> tuple[Any, ...]:
        """The flat tensors: positional ones, then keyword ones in the dict's order."""
        return tuple(value for value in (*self.args, *self.kwargs.values()) if _is_tensor(value))

    def names(self) -> tuple[str, ...]:
        """The argument of each flat tensor: its position (``"0"``) or its keyword."""
        return tuple(
            name
            for name, value in (*((str(i), v) for i, v in enumerate(self.args)), *self.kwargs.items())
            if _is_tensor(value)
        )

    @property
    def positional(self) -> bool:
        """Only tensors, all positional: the model is called as ``model(*tensors)``."""
        return not self.kwargs and all(_is_tensor(value) for value in self.args)

    def call(self, model: Callable[..., Any]) -> Any:
        """``model(*args, **kwargs)``."""
        return model(*self.args, **self.kwargs)

    def with_tensors(self, tensors: tuple[Any, ...] | list[Any]) -> ModelInputs:
        """The same arguments with the flat tensors replaced, in order, by ``tensors``."""
        supply = iter(tensors)

        def swap(value: object) -> object:
            return next(supply) if _is_tensor(value) else value

        args = tuple(swap(value) for value in self.args)
        kwargs = {name: swap(value) for name, value in self.kwargs.items()}
        return ModelInputs(args, kwargs)

    def map(self, fn: Callable[[Any], Any]) -> ModelInputs:
        """``fn`` applied to every flat tensor."""
        return self.with_tensors([fn(tensor) for tensor in self.tensors()])

    def __iter__(self) -> Iterator[Any]:
        """The positional inputs, so that ``model(*inputs)`` keeps working where there are
        no keyword inputs; with keyword inputs it raises (use ``inputs.call(model)``)."""
        if self.kwargs:
            raise TypeError(
                "these model inputs have keyword arguments: call the model with inputs.call(model)"
            )
        return iter(self.args)

    def __getitem__(self, position: int) -> Any:
        """Positional input ``position`` (as for a tuple)."""
        return self.args[position]

    def __len__(self) -> int:
        return len(self.args) + len(self.kwargs)


def model_inputs(value: object, where: str) -> ModelInputs:
    """``value`` (a tensor, tuple/list or dict, as ``sample_batch`` returns inputs) as ``ModelInputs``.

    ``InputError`` (one line) for a value that is neither a tensor, ``None`` nor a constant.
    """
    if isinstance(value, ModelInputs):
        return value
    if _is_mapping(value):
        items: dict[str, object] = {}
        for name, item in value.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise InputError(f"{where}: sample_batch input key {name!r} is not a keyword argument name")
            items[name] = item
        result = ModelInputs((), items)
    elif isinstance(value, (tuple, list)):
        result = ModelInputs(tuple(value), {})
    else:
        result = ModelInputs((value,), {})
    for name, item in (*((str(i), v) for i, v in enumerate(result.args)), *result.kwargs.items()):
        if not (_is_tensor(item) or item is None or isinstance(item, _CONSTANTS)):
            raise InputError(
                f"{where}: sample_batch input {name} is {type(item).__name__}, expected a Tensor, "
                f"None or a constant (bool, int, float, str)"
            )
    if not result.tensors():
        raise InputError(f"{where}: sample_batch gave no input tensor")
    return result


def _is_tensor(value: object) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _is_mapping(value: object) -> TypeGuard[Mapping[object, object]]:
    """A dict-like batch (a tokenizer's ``BatchEncoding`` is a ``UserDict``)."""
    from collections.abc import Mapping

    return isinstance(value, Mapping)
