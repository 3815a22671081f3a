"""Train a model with torch.distributed.pipelining, split as ``pipeplan export`` says.

Run under torchrun with as many ranks as the plan has pipeline ranks::

    pipeplan export plan.json --to pipelining --model mlp -o split.py
    torchrun --nproc-per-node 2 docs/export/train_with_pipelining.py split.py --model mlp \
        --batch-size 32 --steps 5 --lr 0.05

``split.py`` is the exported snippet, used as a user would: its stages (``build_stages``:
torch's ``pipeline()`` with its ``SPLIT_SPEC``, or pipeplan's stage modules in torch's
``PipelineStage``) and its schedule class (``build_pipeline_schedule``); after each
backward ``sync_tied_gradients`` sums the gradient of a weight two stages hold (a tied
embedding and head) before the optimizer steps. With ``--csv schedule.csv`` (``pipeplan
export ... --format csv``) the plan's own action table runs instead, on
``_PipelineScheduleRuntime``. The model is built under
``torch.manual_seed(--seed)`` and step k trains on ``sample_batch`` drawn under seed
``--seed + k``, as ``pipeplan run`` does, so the losses of the two runs compare. SGD,
gloo, CPU. The last stage's rank prints each step's loss (mean over micro-batches) and
writes them to ``--losses`` as JSON, with the micro-batches of each step and the
parameter names each rank's stage holds, and the largest difference between the copies of
each tied weight after training (``tied_spread``: 0.0 when they stayed equal).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from datetime import timedelta
from types import ModuleType

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from pipeplan.modelfile import load_model_file, resolve_model_path


def load_snippet(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("exported_split", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"error: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_pipelined(
    split: ModuleType,
    model_path: str,
    batch_size: int,
    steps: int,
    lr: float,
    seed: int = 0,
    csv: str | None = None,
) -> dict:
    """Train on this rank (the process group is up) as the snippet ``split`` says.

    Returns, on the last stage's rank, ``{"losses", "microbatches", "csv", "parameters_by_rank",
    "tied_spread"}`` (every rank's stage parameter names; per tied weight, the largest absolute
    difference between its copies after training); an empty dict elsewhere.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    # the snippet's stage placement (a loop, or zb-v's V); snippets from before it: a loop
    stage_ids = getattr(split, "stage_ids", lambda r, n=split.N_STAGES: tuple(range(r, n, world)))
    model_file = load_model_file(resolve_model_path(model_path))
    torch.manual_seed(seed)
    model = model_file.build()
    batches = [model_file.batch(batch_size, seed=seed + k) for k in range(steps)]
    example = tuple(t.tensor_split(split.N_MICROBATCHES)[0] for t in batches[0][0].tensors())
    device = torch.device("cpu")
    if csv:
        stages = split.build_stages(model, example, rank, device)
        modules = [stage.submod for stage in stages]
        schedule = _PipelineScheduleRuntime(
            stages, n_microbatches=split.N_MICROBATCHES, loss_fn=split.stage_loss(modules, model_file.loss_fn)
        )
        schedule._load_csv(csv)
    else:
        schedule, modules = split.build_pipeline_schedule(model, example, model_file.loss_fn, rank, device)
    # a weight two stages of this rank hold (interleaved) is one tensor: step it once
    parameters = list({id(p): p for m in modules for p in m.parameters()}.values())
    # a stage of parameter-free layers (an activation, a pooling) has nothing to step
    optimizer = torch.optim.SGD(parameters, lr=lr) if parameters else None
    first = rank == 0
    last = (split.N_STAGES - 1) in stage_ids(rank, split.N_STAGES)
    losses: list[float] = []
    microbatches: list[int] = []
    for inputs, targets in batches:
        if optimizer:
            optimizer.zero_grad()
        micro: list[torch.Tensor] = []
        schedule.step(
            *(inputs.tensors() if first else ()), **({"target": targets, "losses": micro} if last else {})
        )
        split.sync_tied_gradients(modules)
        if optimizer:
            optimizer.step()
        if last:
            microbatches.append(len(micro))
            losses.append(float(torch.stack([loss.detach() for loss in micro]).mean()))
            print(f"step {len(losses)}: loss {losses[-1]:.6f}", flush=True)
    held = [sorted(_qualified_names(m)) for m in modules]
    every_rank: list[list[list[str]]] = [[] for _ in range(world)]
    dist.all_gather_object(every_rank, [sorted(name for names in held for name in names)])
    spread = _tied_spread(modules, getattr(split, "TIED", {}), world)
    if not last:
        return {}
    return {
        "losses": losses,
        "microbatches": microbatches,
        "csv": bool(csv),
        "parameters_by_rank": [names[0] for names in every_rank],
        "tied_spread": spread,
    }


def _qualified_names(module: torch.nn.Module) -> list[str]:
    """The model's names of a stage module's parameters (pipeplan's stage modules map them)."""
    mapped = getattr(module, "parameter_names", None)
    if isinstance(mapped, dict):
        return sorted(set(mapped.values()))
    return [name for name, _ in module.named_parameters()]


def _tied_spread(modules: list[torch.nn.Module], tied: dict, world: int) -> dict[str, float]:
    """Per tied weight, the largest absolute difference between the copies the ranks hold."""
    spread = {}
    for name in sorted(tied):
        local = [
            p.detach()
            for m in modules
            for local_name, p in m.named_parameters(remove_duplicate=False)
            if getattr(m, "parameter_names", {}).get(local_name) == name
        ]
        mine = local[0] if local else None
        copies: list[torch.Tensor | None] = [None] * world
        dist.all_gather_object(copies, mine)
        held = [c for c in copies if c is not None]
        spread[name] = max(float((c - held[0]).abs().max()) for c in held)
    return spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snippet", help="the .py written by `pipeplan export --to pipelining`")
    parser.add_argument("--model", required=True, help="model.py or a bundled model name")
    parser.add_argument("--batch-size", type=int, required=True, help="samples per step (the plan's)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default=None, help="run this CSV action table (_PipelineScheduleRuntime)")
    parser.add_argument("--losses", default=None, help="write the per-step losses here (JSON)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for every collective")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        record = train_pipelined(
            load_snippet(args.snippet), args.model, args.batch_size, args.steps, args.lr, args.seed, args.csv
        )
        if record and args.losses:
            with open(args.losses, "w") as handle:
                json.dump(record, handle)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
