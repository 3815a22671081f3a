"""Benchmark: does a split stage run at its layers' speed? One process, side by side.

For each model (bundled names and ``hf:<family>``: the tiny configs of
``tests/fixtures/models/hf_family.py``, as ``bench/bench_predict.py`` picks them) and each
micro-batch size, in one process (one thread), interleaving the variants pass by pass so
the machine's load from other processes cancels out of the ratios:

- **layers**: the graph cut into its layers, run layer by layer the profiler's way
  (``pipeplan.profiler.measure.run_pass``): what a profile sums for a stage;
- **stages**: the same graph split into 2 stages at the half of the layers' time (what
  ``pipeplan run`` builds: ``LayerGraph.split``), run stage by stage the same way: each stage
  one module call and one ``torch.autograd.backward`` per micro-batch, as the executor does;
- **runtime**: the 2 stages the executor's way (``_runtime_pass``), with every received float
  requiring grad (the runtime before issue 31: a Llama's rotary cos and sin got gradients in
  every attention layer) and with only those their producer's output did (now);
- **fixed**: the per-call cost of an empty stage (a detached input that requires grad, one
  module call, one ``autograd.backward``): what every stage pays per micro-batch whatever
  its layers.

Prints, per model and size: the minima over passes (ms, the passes least disturbed by
other processes) of the forward + backward sums, stages over
layers, and how many per-layer calls the split saves; then, on 2 gloo ranks, the round trip
of one activation-sized message (``--no-p2p`` skips it), against the ``local-cpu`` preset's
latency, and the cost of one ``P2P.reap`` (after every send and action) with many gloo sends
pending, scanning all of them (before issue 31) vs the oldest ``REAP_SCAN``. Writes JSON (``--out``, default bench/results/stage_overhead.json).

    python bench/bench_stage_overhead.py
    python bench/bench_stage_overhead.py --models hf:llama hf:gpt2 --sizes 2 8 --passes 30

The machine's load moves the absolute times (not much the ratios): say so next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pipeplan.capture import StageModule

ROOT = Path(__file__).resolve().parent.parent
HF_MODEL = ROOT / "tests" / "fixtures" / "models" / "hf_family.py"
DEFAULT_MODELS = ("mlp", "gpt", "hf:llama", "hf:gpt2", "hf:mixtral", "hf:bert", "hf:t5", "hf:vit")


def _target(name: str) -> tuple[str, dict[str, str]]:
    if name.startswith("hf:"):
        return str(HF_MODEL), {"PIPEPLAN_HF_FAMILY": name[3:]}
    from pipeplan.modelfile import bundled_model_path

    return str(bundled_model_path(name)), {}


def _halves(times: Sequence[float]) -> list[int]:
    """Stage of each layer: 0 up to half the total time, then 1 (each stage non-empty)."""
    total, acc, out = sum(times), 0.0, []
    for k, t in enumerate(times):
        out.append(0 if (acc + t / 2 < total / 2 and k < len(times) - 1) or k == 0 else 1)
        acc += t
    return out


def _empty_stage_ms(passes: int) -> float:
    """Least ms of one empty stage call: detach, requires_grad, module call, autograd.backward."""
    import torch

    lin = torch.nn.Identity()
    x = torch.randn(2, 16)
    samples = []
    for _ in range(passes * 10):
        start = time.perf_counter()
        inp = x.detach().requires_grad_(True)
        out = lin(inp) * 1.0
        torch.autograd.backward([out], [torch.ones_like(out)])
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


def _runtime_pass(
    stages: Sequence[StageModule],
    inputs: Sequence[torch.Tensor],
    targets: object,
    loss_fn: Any,
    every_float: bool,
) -> float:
    """ms of one micro-batch through ``stages`` as the executor runs them: each stage one
    module call, a received float a fresh leaf, one ``autograd.backward`` per stage. With
    ``every_float`` every received float requires grad (the runtime before issue 31);
    otherwise only those their producer's output did (the profiler's way, the runtime's now)."""
    import torch

    from pipeplan.capture import MODEL_OUTPUT

    start = time.perf_counter()
    values: dict[str, Any] = {f"input:{k}": value for k, value in enumerate(inputs)}
    runs = []
    for stage in stages:
        args = [values[name] for name in stage.input_names]
        outputs = dict(zip(stage.output_names, stage.module(*args)))
        runs.append((args, outputs))
        for name, out in outputs.items():
            if name != MODEL_OUTPUT:
                needs = out.is_floating_point() and (every_float or out.requires_grad)
                values[name] = out.detach().requires_grad_(needs)
    loss = loss_fn(runs[-1][1][MODEL_OUTPUT], targets)
    heads, grads = [loss], [torch.ones_like(loss)]
    for stage in reversed(stages):
        torch.autograd.backward(heads, grads)
        received = {name: values[name] for name in stage.input_names if not name.startswith("input:")}
        previous = {n: o for _, outs in runs for n, o in outs.items() if n in received}
        pairs = [
            (previous[n], v.grad if v.grad is not None else torch.zeros_like(v))
            for n, v in received.items()
            if v.requires_grad
        ]
        heads = [o for o, _ in pairs if o.requires_grad]
        grads = [g for o, g in pairs if o.requires_grad]
        if not heads:
            break
    return (time.perf_counter() - start) * 1e3


def measure_model(name: str, sizes: Sequence[int], passes: int) -> list[dict[str, Any]]:
    """In this process: layer sums vs stage sums at each size (see the module docstring)."""
    import torch

    from pipeplan.capture import build_layer_graph
    from pipeplan.modelfile import load_model_file
    from pipeplan.profiler.measure import disable_inplace, run_pass
    from pipeplan.profiler.timing import CpuTimer

    torch.set_num_threads(1)
    path, env = _target(name)
    os.environ.update(env)
    model_file = load_model_file(path)
    network = model_file.build().train()
    disable_inplace(network)
    timer = CpuTimer()
    fixed = _empty_stage_ms(passes)
    rows = []
    for size in sizes:
        inputs, targets = model_file.batch(size, seed=0)
        graph = build_layer_graph(network, inputs, model_file.leaf_modules, model_file.opaque_modules)
        layers = graph.layer_modules()
        first = run_pass(layers, inputs.tensors(), targets, model_file.loss_fn, timer)
        owner = _halves([f + b for f, b in zip(first.forward_ms, first.backward_ms)])
        variants = {"layers": layers, "stages": graph.split(owner), "whole": graph.split([0] * len(layers))}
        totals: dict[str, list[float]] = {key: [] for key in variants}
        for _ in range(3 + passes):  # 3 warm-up passes each, then interleaved
            for key, modules in variants.items():
                for module in modules:
                    for parameter in module.module.parameters():
                        parameter.grad = None
                sample = run_pass(modules, inputs.tensors(), targets, model_file.loss_fn, timer)
                totals[key].append(sum(sample.forward_ms) + sum(sample.backward_ms))
        # the minimum over passes: the run least disturbed by other processes (a shared machine)
        medians = {key: min(values[3:]) for key, values in totals.items()}
        stages = variants["stages"]
        if len(stages) == 2:  # the runtime's way, before and after issue 31, interleaved
            tensors = inputs.tensors()
            runtime: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(3 + passes):
                for every_float in (True, False):
                    for module in stages:
                        for parameter in module.module.parameters():
                            parameter.grad = None
                    runtime[every_float].append(
                        _runtime_pass(stages, tensors, targets, model_file.loss_fn, every_float)
                    )
            medians["runtime_before"] = min(runtime[True][3:])
            medians["runtime_after"] = min(runtime[False][3:])
        rows.append(
            {
                "model": name,
                "batch": size,
                "layers": len(layers),
                "stage_layers": [owner.count(0), owner.count(1)],
                "layers_ms": medians["layers"],
                "stages_ms": medians["stages"],
                "whole_ms": medians["whole"],
                "stages_over_layers": medians["stages"] / medians["layers"],
                # the executor's way: every received float requiring grad (before) or as produced
                "runtime_every_float_ms": medians.get("runtime_before"),
                "runtime_as_produced_ms": medians.get("runtime_after"),
                "fixed_call_ms": fixed,
                "calls_saved": 2 * (len(layers) - 2),
                "fixed_share_of_layers": 2 * len(layers) * fixed / medians["layers"],
            }
        )
    return rows


class _GlooLikeSend:
    """A send that reports completion only once waited on, as gloo's point-to-point work does."""

    def __init__(self) -> None:
        self.waited = False

    def is_completed(self) -> bool:
        return self.waited

    def wait(self, timeout: object = None) -> bool:
        self.waited = True
        return True


def reap_us(pending: int, scan: int, calls: int = 2000) -> float:
    """Least microseconds of one ``P2P.reap`` with ``pending`` gloo-like sends outstanding,
    looking at ``scan`` of them (the runtime's ``REAP_SCAN``; before issue 31: all)."""
    import torch

    from pipeplan.runtime import comm

    isend, scan_was = comm.dist.isend, comm.REAP_SCAN
    comm.dist.isend = lambda tensor, peer, tag=0: _GlooLikeSend()  # type: ignore[assignment]
    comm.REAP_SCAN = scan
    try:
        p2p = comm.P2P(rank=0, values=4, device="cpu", timeout_s=5.0, tagged=True)
        for unit in range(pending):
            p2p.send(torch.ones(1), 1, 0, unit, comm.FORWARD, "send")
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            p2p.reap()
            samples.append((time.perf_counter() - start) * 1e6)
        return min(samples)
    finally:
        comm.dist.isend, comm.REAP_SCAN = isend, scan_was  # type: ignore[assignment]


def p2p_round_trip_ms(numel: int, rounds: int) -> float:
    """Median round trip (ms) of a float32 tensor of ``numel`` between 2 gloo ranks (torchrun)."""
    code = (
        "import time,statistics,torch,torch.distributed as d;torch.set_num_threads(1);"
        f"d.init_process_group('gloo');r=d.get_rank();x=torch.zeros({numel});s=[]\n"
        f"for i in range({rounds + 10}):\n"
        " t=time.perf_counter()\n"
        " if r==0: d.send(x,1);d.recv(x,1)\n"
        " else: d.recv(x,0);d.send(x,0)\n"
        " s.append((time.perf_counter()-t)*1e3)\n"
        "r==0 and print(statistics.median(s[10:]))\n"
        "d.destroy_process_group()"
    )
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"pipeplan_p2p_{os.getpid()}.py"
    script.write_text(code)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(29400 + os.getpid() % 500), str(script)],
            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    finally:
        script.unlink(missing_ok=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"gloo round trip failed: {done.stderr.strip()[-300:]}")
    return float(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 8], help="micro-batch sizes (samples)")
    parser.add_argument("--passes", type=int, default=20, help="timed passes per variant")
    parser.add_argument("--no-p2p", action="store_true", help="skip the 2-rank gloo round trip")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child: measure one model, print JSON
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "stage_overhead.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_model(args.one, args.sizes, args.passes)))
        return
    rows: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for name in args.models:  # one process per model: an HF family is picked at import
        command = [sys.executable, __file__, "--one", name, "--passes", str(args.passes), "--sizes"]
        done = subprocess.run(
            [*command, *map(str, args.sizes)],
            capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        if done.returncode != 0:
            failures[name] = (done.stderr.strip().splitlines() or ["failed"])[-1][:300]
            print(f"{name}: not measured: {failures[name]}")
            continue
        rows.extend(json.loads(done.stdout.strip().splitlines()[-1]))
    for r in rows:
        if r["runtime_every_float_ms"] is not None:
            print(
                f"{r['model']} batch {r['batch']}: 2 stages the executor's way "
                f"{r['runtime_every_float_ms']:.3f} ms with every received float requiring grad "
                f"(before issue 31), {r['runtime_as_produced_ms']:.3f} ms as produced "
                f"({r['runtime_every_float_ms'] / r['runtime_as_produced_ms']:.2f}x)"
            )
    header = (
        f"{'model':<12} {'batch':>5} {'layers':>6} {'layers ms':>10} {'stages ms':>10} {'whole ms':>9} "
        f"{'stages/layers':>13} {'empty call ms':>13} {'calls x empty / layers':>22}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['model']:<12} {r['batch']:>5} {r['layers']:>6} {r['layers_ms']:>10.3f} "
            f"{r['stages_ms']:>10.3f} {r['whole_ms']:>9.3f} {r['stages_over_layers']:>13.2f} "
            f"{r['fixed_call_ms']:>13.4f} {r['fixed_share_of_layers']:>22.2f}"
        )
    if rows:
        ratios = [r["stages_over_layers"] for r in rows]
        print(
            f"stages / layers: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}"
        )
    # a 30-step run of 4 micro-batches sending 3 values a micro-batch has 360 sends pending
    # at its end when none is released (gloo's sends report completion only when waited on)
    from pipeplan.runtime.comm import REAP_SCAN

    reap = {
        f"{n} pending": {"all": reap_us(n, 10**9), f"{REAP_SCAN}": reap_us(n, REAP_SCAN)} for n in (36, 360)
    }
    for key, figures in reap.items():
        print(
            f"P2P.reap with {key} gloo-like sends: {figures['all']:.1f} us scanning all of them "
            f"(before issue 31), {figures[str(REAP_SCAN)]:.1f} us scanning the oldest {REAP_SCAN}; "
            f"2 reaps an action"
        )
    p2p: dict[str, float] = {}
    if not args.no_p2p:
        for numel in (1024, 65536):
            p2p[str(numel * 4)] = p2p_round_trip_ms(numel, 200)
            print(f"gloo round trip of {numel * 4} bytes on 2 ranks: {p2p[str(numel * 4)]:.3f} ms "
                  f"(local-cpu preset: 2 x 0.020 ms latency)")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"rows": rows, "reap_us": reap, "p2p_round_trip_ms": p2p, "failures": failures}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
