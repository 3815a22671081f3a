"""Every schedule on measured CPU profiles: predicted time, bubble and peak memory per rank.

``--gloo STEPS``: instead, every schedule of ``bench/deep_mlp.py`` trained on 4 local gloo
ranks, measured time per minibatch against predicted. ``--sail``: only pipeplan's simulated
bubbles beside sail-sg/zero-bubble's published formulas. ``--zb-paper``: only the Zero Bubble
paper's GPT table (``bench/zb_paper.py``: its profiled T_F, T_B, T_W, T_comm) beside
pipeplan's simulated bubble rates for the same settings.

Three models profiled on this CPU (one thread; the bundled GPT, a small Hugging Face Llama
``bench/llama_small.py``, the bundled ResNet), each planned with every schedule of the
registry on 4 and 8 simulated ranks (straight pipelines, 10 GB/s links, 2 x ranks
micro-batches; interleaved-1f1b with 2 chunks per device) and simulated: time per
minibatch, bubble (each rank's idle share of the period, averaged over ranks), peak memory
of each rank. For the split-backward schedules (zb-h1, zb-v, v-half, v-min, dualpipev) the same plan is simulated
again with the backward's halves assumed 50/50, as before they were measured: the column
"50/50 ms" says what the measured split changed. Prints a markdown table, writes JSON.

    python bench/bench_schedules.py --out bench/results/schedules.json
    python bench/bench_schedules.py --models gpt --ranks 4
    python bench/bench_schedules.py --gloo 30 --out bench/results/schedules-gloo.json
    python bench/bench_schedules.py --zb-paper --out bench/results/zb-paper.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from pipeplan.errors import InfeasibleError, InputError
from pipeplan.jsonio import write_json_atomic
from pipeplan.plan import Plan
from pipeplan.planner.partition import PartitionOptions, partition
from pipeplan.planner.simulate import SimResult, simulate_plan
from pipeplan.profile import DeviceInfo, LayerProfile, Profile
from pipeplan.profiler.profile_model import profile_model
from pipeplan.schedules import SCHEDULE_KINDS, SCHEDULE_NAMES
from pipeplan.topology import DeviceSpec, Level, Topology

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zb_paper import ROWS, SOURCE, bubble_rate, paper_profile  # noqa: E402

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Model:
    key: str
    model: str  # a bundled model's name or a model file
    batch_size: int


MODELS = (
    Model("gpt", "gpt", 32),
    Model("llama", str(HERE / "llama_small.py"), 16),
    Model("cnn", "resnet", 16),
)


LINK_BYTES_PER_S = 10e9


def cpu_ranks(ranks: int) -> Topology:
    """``ranks`` CPU devices of 64 GiB joined by 10 GB/s links (memory never binds here)."""
    return Topology(
        f"cpu-{ranks}", DeviceSpec("cpu", 64 * 2**30), (Level("host", ranks, LINK_BYTES_PER_S, 0.0),)
    )


def measured_profile(model: Model, folder: Path) -> Profile:
    """The model's CPU profile, measured once into ``folder`` and read back after."""
    path = folder / f"{model.key}.json"
    if path.exists():
        return Profile.load(path)
    profile = profile_model(
        model.model, batch_size=model.batch_size, device="cpu", threads=1, warmup=2, repeats=5
    )
    folder.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    return profile


def halves_assumed(profile: Profile) -> Profile:
    """``profile`` as before the split was measured: every backward's halves assumed 50/50."""
    return replace(profile, layers=tuple(replace(layer, backward_input_ms=None) for layer in profile.layers))


def plan_schedule(profile: Profile, ranks: int, name: str, microbatches: int | None = None) -> Plan | str:
    """The straight plan of ``name`` on ``ranks`` devices (2 x ranks micro-batches unless
    given), or the one-line reason there is none."""
    kind = SCHEDULE_KINDS[name]
    options = PartitionOptions(
        schedule=name,
        microbatches=1 if kind.whole_minibatches else microbatches or 2 * ranks,
        straight=True,
        virtual_stages=2 if kind.virtual_stages else None,
        max_stages=ranks,
    )
    try:
        return partition(profile, cpu_ranks(ranks), options)
    except (InputError, InfeasibleError) as exc:
        return str(exc)


def row(
    model: Model, ranks: int, name: str, plan: Plan, result: SimResult, assumed: SimResult | None
) -> dict:
    positions = len(result.stages) // result.virtual_stages
    bubbles = [stage.bubble_fraction for stage in result.stages[:positions]]
    return {
        "model": model.key,
        "ranks": ranks,
        "schedule": name,
        "pipeline_positions": positions,
        "microbatches": result.microbatches,
        "ms_per_minibatch": result.time_per_minibatch_ms,
        "bubble": sum(bubbles) / len(bubbles),
        "peak_bytes_per_rank": list(result.device_memory_bytes),
        "ms_per_minibatch_halves_assumed": assumed.time_per_minibatch_ms if assumed else None,
        "stage_layers": [list(stage.layers) for stage in plan.stages],
    }


def markdown(rows: list[dict]) -> str:
    head = "| model | ranks | schedule | M | ms/minibatch | 50/50 ms | bubble | peak MiB per rank |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "refused" in r:
            lines.append(
                f"| {r['model']} | {r['ranks']} | {r['schedule']} | | refused: {r['refused']} | | | |"
            )
            continue
        assumed = r["ms_per_minibatch_halves_assumed"]
        memory = ", ".join(f"{b / 2**20:.1f}" for b in r["peak_bytes_per_rank"])
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['schedule']} | {r['microbatches']} | {r['ms_per_minibatch']:.2f} "
            f"| {'' if assumed is None else f'{assumed:.2f}'} | {r['bubble'] * 100:.1f}% | {memory} |"
        )
    return "\n".join(lines)


# sail-sg/zero-bubble's README (its published comparison, T_F = T_B = T_W): the bubble rate of
# 1F1B is B = (p - 1)/(m + p - 1); ZB1P (ZB-H1's memory) B/3; ZBV 0; V-Half B/2; V-Min 2B/3
# (plus O(p) overhead). Rates as a share of 1F1B's time per minibatch, so B/3 is a third of
# 1F1B's idle time.
SAIL_CASES = ((4, 8), (4, 16), (8, 16), (8, 24), (8, 32), (16, 32), (16, 64))


def equal_layers(count: int) -> Profile:
    """``count`` equal layers: 1 ms forward, 2 ms backward (half of it the input gradient)."""
    layers = tuple(
        LayerProfile(
            i, f"layer{i}", "Linear", (i - 1,) if i else (), 1.0, 2.0, 0, 0, 0, backward_input_ms=1.0
        )
        for i in range(count)
    )
    return Profile("equal layers", f"equal-{count}", DeviceInfo("cpu", "none"), 192, "float32", layers)


def sail_comparison() -> list[dict]:
    """pipeplan's simulated bubbles beside sail-sg's formulas, on p equal stages of 4 layers
    (F = 1 ms, B = 2 ms per layer: I = W = 1 ms, the 50/50 split being T_B = T_W)."""
    out = []
    for p, m in SAIL_CASES:
        profile = equal_layers(4 * p)
        ideal_ms = 4 * p * 3.0 / p
        periods = {}
        for name in ("1f1b-flush", "zb-h1", "zb-v", "v-half", "v-min"):
            plan = plan_schedule(profile, p, name, microbatches=m)
            assert not isinstance(plan, str), plan
            periods[name] = simulate_plan(plan, profile).time_per_minibatch_ms
        flush = periods["1f1b-flush"]
        b = (p - 1) / (m + p - 1)
        out.append(
            {
                "p": p,
                "m": m,
                "sail_1f1b": b,
                "sail_zb1p": b / 3,
                "sail_zbv": 0.0,
                "sail_vhalf": b / 2,
                "sail_vmin": 2 * b / 3,
                # idle time over 1F1B's period (float noise below 1e-12 of it read as none)
                **{
                    f"pipeplan_{name}": round((periods[name] - ideal_ms) / flush, 12) + 0.0
                    for name in periods
                },
            }
        )
    return out


def sail_markdown(rows: list[dict]) -> str:
    lines = [
        "| p | m | 1F1B: sail-sg B | pipeplan 1f1b-flush | ZB1P: sail-sg B/3 | pipeplan zb-h1 "
        "| ZBV: sail-sg | pipeplan zb-v | V-Half: sail-sg B/2 | pipeplan v-half | V-Min: sail-sg 2B/3 "
        "| pipeplan v-min |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['p']} | {r['m']} | {r['sail_1f1b']:.2%} | {r['pipeplan_1f1b-flush']:.2%} | {r['sail_zb1p']:.2%} "
            f"| {r['pipeplan_zb-h1']:.2%} | {r['sail_zbv']:.2%} | {r['pipeplan_zb-v']:.2%} "
            f"| {r['sail_vhalf']:.2%} | {r['pipeplan_v-half']:.2%} | {r['sail_vmin']:.2%} | {r['pipeplan_v-min']:.2%} |"
        )
    return "\n".join(lines)


ZB_PAPER_SCHEDULES = ("1f1b-flush", "zb-h1", "zb-v", "v-half", "v-min", "dualpipev")


def zb_paper_comparison() -> list[dict]:
    """pipeplan's simulated bubble rates (``zb_paper.bubble_rate``) on every setting of the
    Zero Bubble paper's GPT table, with its T_comm and without, beside the paper's rates."""
    out = []
    for r in ROWS:
        simulated: dict[str, float] = {}
        for comm in (True, False):
            profile = paper_profile(r, LINK_BYTES_PER_S if comm else None)
            for name in ZB_PAPER_SCHEDULES:
                plan = plan_schedule(profile, r.p, name, microbatches=r.m)
                if isinstance(plan, str):
                    raise InfeasibleError(f"{name} on the paper's {r.model} p={r.p} m={r.m}: {plan}")
                period = simulate_plan(plan, profile).time_per_minibatch_ms
                simulated[name if comm else f"{name} no comm"] = round(bubble_rate(r, period), 6)
        out.append(
            {
                "model": r.model,
                "p": r.p,
                "m": r.m,
                "t_f_ms": r.forward_ms,
                "t_b_ms": r.input_grad_ms,
                "t_w_ms": r.weight_grad_ms,
                "t_comm_ms": r.comm_ms,
                "paper": {
                    "1F1B": r.rate_1f1b,
                    "ZB-H1": r.rate_zb_h1,
                    "ZB-H2": r.rate_zb_h2,
                    "ZB-1p": r.rate_zb_1p,
                    "ZB-2p": r.rate_zb_2p,
                },
                "pipeplan": simulated,
            }
        )
    return out


def zb_paper_markdown(rows: list[dict]) -> str:
    lines = [
        "| model | p | m | 1F1B: paper | pipeplan 1f1b-flush | ZB-H1: paper | pipeplan zb-h1 "
        "| ZB-1p: paper | ZB-H2: paper | ZB-2p: paper | pipeplan zb-v | pipeplan v-half | pipeplan v-min "
        "| pipeplan dualpipev |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        paper, ours = r["paper"], r["pipeplan"]
        lines.append(
            f"| {r['model']} | {r['p']} | {r['m']} | {paper['1F1B']:.4f} | {ours['1f1b-flush']:.4f} "
            f"| {paper['ZB-H1']:.4f} | {ours['zb-h1']:.4f} | {paper['ZB-1p']:.4f} | {paper['ZB-H2']:.4f} "
            f"| {paper['ZB-2p']:.4f} | {ours['zb-v']:.4f} | {ours['v-half']:.4f} | {ours['v-min']:.4f} "
            f"| {ours['dualpipev']:.4f} |"
        )
    return "\n".join(lines)


def gloo_runs(folder: Path, steps: int) -> list[dict]:
    """Every schedule of ``bench/deep_mlp.py`` (batch 128, profiled here) planned on 4 ranks and
    trained under torchrun on 4 local gloo ranks (one thread each): measured time per
    minibatch (``pipeplan run``'s steady period) against the plan's prediction."""
    sys.path.insert(0, str(HERE))
    from launch import torchrun_pipeplan  # bench/launch.py

    model = Model("deep_mlp", str(HERE / "deep_mlp.py"), 128)
    profile = measured_profile(model, folder)
    out = []
    for name in SCHEDULE_NAMES:
        plan = plan_schedule(profile, 4, name)
        if isinstance(plan, str):
            out.append({"schedule": name, "refused": plan})
            continue
        path = folder / f"plan-{name}.json"
        plan.save(path)
        run_args = [str(path), "--model", model.model, "--steps", str(steps), "--no-progress"]
        metrics, _ = torchrun_pipeplan(
            4, run_args, folder / f"metrics-{name}.json", threads=1, timeout_s=600, what=name
        )
        measured, predicted = metrics["time_per_minibatch_ms"], metrics["predicted_time_per_minibatch_ms"]
        out.append(
            {
                "schedule": name,
                "microbatches": plan.microbatches,
                "measured_ms": measured,
                "predicted_ms": predicted,
                "ratio": measured / predicted,
            }
        )
        print(f"{name}: measured {measured:.2f} ms, predicted {predicted:.2f} ms per minibatch", flush=True)
    return out


def gloo_markdown(rows: list[dict]) -> str:
    lines = [
        "| schedule | M | measured ms/minibatch | predicted | measured / predicted |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['schedule']} | | refused: {r['refused']} | | |")
        else:
            lines.append(
                f"| {r['schedule']} | {r['microbatches']} | {r['measured_ms']:.2f} | {r['predicted_ms']:.2f} "
                f"| {r['ratio']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file (default bench/results/schedules.json, zb-paper.json)")
    parser.add_argument(
        "--zb-paper",
        action="store_true",
        help="only the Zero Bubble paper's GPT table beside pipeplan's simulated bubble rates",
    )
    parser.add_argument(
        "--profiles", default="bench/results/profiles", help="where the CPU profiles are kept"
    )
    parser.add_argument("--models", default=",".join(m.key for m in MODELS))
    parser.add_argument("--ranks", default="4,8", help="comma-separated simulated rank counts")
    parser.add_argument(
        "--sail", action="store_true", help="only sail-sg/zero-bubble's comparison of bubbles"
    )
    parser.add_argument(
        "--gloo",
        type=int,
        default=0,
        metavar="STEPS",
        help="only the runs on 4 gloo ranks, of STEPS steps each",
    )
    args = parser.parse_args()
    args.out = args.out or f"bench/results/{'zb-paper' if args.zb_paper else 'schedules'}.json"
    if args.gloo:
        runs = gloo_runs(Path(args.profiles), args.gloo)
        print(gloo_markdown(runs))
        write_json_atomic(args.out, {"schema": "pipeplan.bench.schedules/1", "gloo": runs})
        return
    if args.zb_paper:
        table = zb_paper_comparison()
        print(zb_paper_markdown(table))
        print(
            f"\nbubble rate: (iteration - m (T_F + T_B + T_W)) / iteration, simulated with T_comm as "
            f"a {LINK_BYTES_PER_S / 1e9:.0f} GB/s send; paper figures from {SOURCE}"
        )
        write_json_atomic(args.out, {"schema": "pipeplan.bench.zb_paper/1", "source": SOURCE, "rows": table})
        return
    sail = sail_comparison()
    print(sail_markdown(sail))
    print()
    if args.sail:
        return
    rows: list[dict] = []
    for model in (m for m in MODELS if m.key in args.models.split(",")):
        profile = measured_profile(model, Path(args.profiles))
        assumed_profile = halves_assumed(profile)
        for ranks in (int(r) for r in args.ranks.split(",")):
            for name in SCHEDULE_NAMES:
                plan = plan_schedule(profile, ranks, name)
                if isinstance(plan, str):
                    rows.append({"model": model.key, "ranks": ranks, "schedule": name, "refused": plan})
                    continue
                result = simulate_plan(plan, profile)
                assumed = (
                    simulate_plan(plan, assumed_profile) if SCHEDULE_KINDS[name].split_backward else None
                )
                rows.append(row(model, ranks, name, plan, result, assumed))
            print(markdown([r for r in rows if r["model"] == model.key and r["ranks"] == ranks]), flush=True)
    print()
    print(markdown(rows))
    print("\nms: simulated per minibatch on profiles measured on this CPU (one thread, other jobs' load)")
    write_json_atomic(args.out, {"schema": "pipeplan.bench.schedules/1", "rows": rows, "sail": sail})


if __name__ == "__main__":
    main()
