"""Training precision: the compute dtype and, for mixed precision, the master weights' dtype.

Mixed precision (``master_dtype`` set, as torchtitan and Megatron train in bf16): the
layers run on ``dtype`` copies of the weights (activations, and the values sent between
stages, are ``dtype``); the optimizer steps ``master_dtype`` master weights with
``master_dtype`` state, gradients are accumulated (and all-reduced among replicas) in
``master_dtype`` and the compute copies are refreshed from the masters after each step. Without it every tensor of
training is ``dtype`` (plans written before mixed precision existed).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.errors import InputError

__all__ = ["DTYPE_BYTES", "MASTER_DTYPES", "Precision"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # element size in bytes
MASTER_DTYPES = ("float32",)


@dataclass(frozen=True)
class Precision:
    dtype: str = "float32"  # compute: the weights the layers run on, activations, values sent between stages
    master_dtype: str | None = None  # master weights, gradients, optimizer state; None: all in ``dtype``

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise InputError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if self.master_dtype is not None and self.master_dtype not in MASTER_DTYPES:
            raise InputError(f"master dtype {self.master_dtype!r} is not one of {', '.join(MASTER_DTYPES)}")

    @classmethod
    def for_dtype(cls, dtype: str) -> Precision:
        """The training precision pipeplan plans and runs for compute in ``dtype``: float32
        masters for a lower precision, else none (float32 trains in float32)."""
        return cls(dtype, "float32" if DTYPE_BYTES.get(dtype, 4) < 4 else None)

    @property
    def mixed(self) -> bool:
        return self.master_dtype is not None and self.master_dtype != self.dtype

    @property
    def gradient_ratio(self) -> float:
        """Bytes of a gradient, as accumulated and all-reduced, per compute-weight byte:
        ``master / dtype`` under mixed precision (gradients are float32), else 1.

        >>> Precision("bfloat16", "float32").gradient_ratio, Precision("float32").gradient_ratio
        (2.0, 1.0)
        """
        if not self.mixed:
            return 1.0
        assert self.master_dtype is not None
        return DTYPE_BYTES[self.master_dtype] / DTYPE_BYTES[self.dtype]

    def state_copies(self, optimizer_states: int) -> float:
        """Parameter-sized buffers beside the compute weights, in bytes per compute-weight byte.

        Pure: 1 gradient + the optimizer's states, all in ``dtype``. Mixed: master weights,
        a master-dtype gradient and the optimizer's states, each ``master / dtype`` bytes
        per compute byte (bf16 with float32 masters and Adam: 2 * (1 + 1 + 2) = 8, so
        with one compute copy 2 + 4 + 4 + 8 = 18 bytes per parameter).

        >>> Precision("bfloat16", "float32").state_copies(2), Precision("bfloat16").state_copies(2)
        (8.0, 3.0)
        """
        if not self.mixed:
            return float(1 + optimizer_states)
        return self.gradient_ratio * (2 + optimizer_states)

    def describe(self) -> str:
        """``bfloat16 compute, float32 master weights`` or ``float32``."""
        return f"{self.dtype} compute, {self.master_dtype} master weights" if self.mixed else self.dtype
