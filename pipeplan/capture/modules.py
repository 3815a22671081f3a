"""The model's module tree with each module's calls per forward pass, as the profile records it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from pipeplan.model_inputs import ModelInputs
from pipeplan.profile import ModuleRecord

__all__ = ["module_calls", "module_records"]


def module_records(model: nn.Module, inputs: ModelInputs | Sequence[Any]) -> tuple[ModuleRecord, ...]:
    """Every module of ``model`` in ``named_modules()`` order, with the calls one forward
    pass on ``inputs`` makes to it (forward pre-hooks; no gradients are recorded).

    A module called twice (a dropout or activation reused) counts 2, a container that is
    iterated but never called (``nn.ModuleList``) 0. O(modules + calls).
    """
    named = list(model.named_modules())
    calls = dict.fromkeys((name for name, _ in named), 0)
    for name in module_calls(model, inputs):
        calls[name] += 1
    return tuple(
        ModuleRecord(
            name=name,
            type=type(module).__name__,
            calls=calls[name],
            container=isinstance(module, (nn.ModuleList, nn.ModuleDict)),
        )
        for name, module in named
    )


def module_calls(model: nn.Module, inputs: ModelInputs | Sequence[Any]) -> list[str]:
    """The qualified names of the modules one forward pass on ``inputs`` calls, in the order
    it calls them (a module once per call). A model on meta runs on shapes alone. O(calls)."""
    import torch

    from pipeplan.capture.materialise import fake_mode_for

    order: list[str] = []

    def recorder(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def record(_module: nn.Module, _args: tuple[Any, ...]) -> None:
            order.append(name)

        return record

    hooks = [module.register_forward_pre_hook(recorder(name)) for name, module in model.named_modules()]
    try:
        with torch.no_grad(), fake_mode_for(model):
            if isinstance(inputs, ModelInputs):
                inputs.call(model)
            else:
                model(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return order
