"""The split kinds every tensor-parallel plan comes down to (Megatron's column- and row-parallel)."""

from __future__ import annotations

__all__ = ["COLWISE", "ROWWISE"]

# column-parallel: a module's output features (an embedding's dimension) split over the ranks;
# row-parallel: its input features (an embedding's rows: the vocabulary-parallel embedding)
COLWISE, ROWWISE = "colwise", "rowwise"
