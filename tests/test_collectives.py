"""``runtime.collectives.sum_over``: on gloo a group of two swaps tensors and adds; the sum is
``all_reduce``'s to the bit, on both ranks, and larger groups keep ``all_reduce``."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
from spawned_ranks import run_ranks

WORLD = 3
DEADLINE_S = 120.0


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("all_reduce was called")


def _sums_agree(rank: int, port: int) -> None:
    import torch.distributed as dist

    from pipeplan.runtime.collectives import sum_over

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        pair, everyone = (0, 2), (0, 1, 2)
        pair_group = dist.new_group(list(pair))
        all_group = dist.new_group(list(everyone))
        for dtype, numel in ((torch.float32, 3072), (torch.float64, 1), (torch.bfloat16, 257)):
            torch.manual_seed(rank)
            mine = torch.randn(numel).to(dtype) * (10.0 ** torch.randint(-3, 4, (numel,))).to(dtype)
            if rank in pair:
                swapped, reduced = mine.clone(), mine.clone()
                all_reduce, dist.all_reduce = dist.all_reduce, _refuse  # a pair never calls it
                try:
                    sum_over(swapped, pair_group, pair)
                finally:
                    dist.all_reduce = all_reduce
                dist.all_reduce(reduced, group=pair_group)
                assert torch.equal(swapped, reduced), (rank, dtype)
                gathered = [torch.empty_like(mine) for _ in pair]
                dist.all_gather(gathered, swapped, group=pair_group)
                assert torch.equal(gathered[0], gathered[1]), dtype  # both ranks hold one sum
            three = mine.clone()
            sum_over(three, all_group, everyone)  # three ranks: all_reduce itself
            expected = mine.clone()
            dist.all_reduce(expected, group=all_group)
            assert torch.equal(three, expected), (rank, dtype)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # passed: skip interpreter teardown, where torch's store threads sometimes abort


@pytest.mark.multiprocess
def test_a_pair_on_gloo_sums_as_all_reduce_does() -> None:
    run_ranks(_sums_agree, WORLD, DEADLINE_S)
