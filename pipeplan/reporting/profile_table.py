"""Human-readable views of a ``Profile``: byte units, the rich table, the summary lines."""

from __future__ import annotations

from typing import Any

from pipeplan.profile import Profile

__all__ = ["format_bytes", "format_ms", "profile_table", "summary_lines", "batch_size_lines"]


def format_bytes(count: int) -> str:
    """Bytes with a binary unit.

    >>> format_bytes(512), format_bytes(1536), format_bytes(16793600)
    ('512 B', '1.50 KiB', '16.02 MiB')
    """
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_ms(median: float, spread: float) -> str:
    """``"1.234±0.010"``: median ± interquartile range, in ms (the unit is in the header)."""
    return f"{median:.3f}±{spread:.3f}"


def profile_table(profile: Profile) -> Any:
    """A ``rich.table.Table``: one row per layer, times in ms, sizes in binary units."""
    from rich import box
    from rich.table import Table

    title = (
        f"{profile.model}: batch {profile.batch_size}, {profile.dtype}, "
        f"{profile.device.type} ({profile.device.name}), median±IQR of {profile.repeats} runs"
    )
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("#", "name", "type", "inputs"):
        table.add_column(header, no_wrap=True, overflow="ellipsis")
    for header in ("fwd ms", "bwd ms", "output", "params", "saved"):
        table.add_column(header, justify="right", no_wrap=True)
    for layer in profile.layers:
        sources = [str(i) for i in layer.inputs] + [f"input:{k}" for k in layer.model_inputs]
        table.add_row(
            str(layer.index),
            layer.name,
            layer.type,
            ",".join(sources) or "-",
            format_ms(layer.forward_ms, layer.forward_ms_spread),
            format_ms(layer.backward_ms, layer.backward_ms_spread),
            format_bytes(layer.output_bytes),
            format_bytes(layer.param_bytes),
            format_bytes(layer.saved_bytes),
        )
    return table


def summary_lines(profile: Profile) -> list[str]:
    """The layers-vs-step comparison and the totals, each number with its unit."""
    forward = sum(layer.forward_ms for layer in profile.layers)
    backward = sum(layer.backward_ms for layer in profile.layers)
    saved = sum(layer.saved_bytes for layer in profile.layers)
    params = sum(layer.param_bytes for layer in profile.layers)
    layers = f"sum of layers: {profile.sum_layers_ms:.3f} ms (forward {forward:.3f} ms + backward {backward:.3f} ms)"
    if profile.step_not_measured:
        step = (
            f"{layers}, loss {profile.loss_ms:.3f} ms; whole step not measured: {profile.step_not_measured}"
        )
        whole = "not measured"
    else:
        step = (
            f"{layers}, measured step: {profile.step_ms:.3f} ± {profile.step_ms_spread:.3f} ms "
            f"(loss {profile.loss_ms:.3f} ms of it), ratio: {profile.layers_vs_step_ratio:.3f}"
        )
        whole = format_bytes(profile.step_saved_bytes)
    built: list[str] = []
    if profile.build == "meta":
        reused = sum(layer.reused_from >= 0 for layer in profile.layers)
        built = [
            f"built on meta, one layer in memory at a time: {len(profile.layers) - reused} layers timed, "
            f"{reused} reuse an identical layer's times"
        ]
    sample = (
        f" (timed on {format_bytes(profile.optimizer_sample_bytes)} of parameters, scaled by bytes)"
        if profile.optimizer_sample_bytes
        else ""
    )
    return (
        [
            step,
            f"saved for backward: sum of layers {format_bytes(saved)}, whole model "
            f"{whole}; parameters: sum of layers {format_bytes(params)}; "
            f"input: {format_bytes(profile.input_bytes)}",
        ]
        + built
        + (
            [
                "optimizer step (not in the step above): "
                + ", ".join(f"{name} {ms:.3f} ms" for name, ms in profile.optimizer_ms.items())
                + sample
            ]
            if profile.optimizer_ms
            else []
        )
        + _split_lines(profile)
        + batch_size_lines(profile)
        + (
            [
                f"capture: {profile.capture}, {len(profile.layers)} layers"
                + (f", leaf modules: {', '.join(profile.leaf_modules)}" if profile.leaf_modules else "")
                + (f", opaque modules: {', '.join(profile.opaque_modules)}" if profile.opaque_modules else "")
                + (
                    f"; output fields set to None (not tensors): {', '.join(profile.dropped_outputs)}"
                    if profile.dropped_outputs
                    else ""
                )
            ]
            if profile.capture
            else []
        )
    )


def _split_lines(profile: Profile) -> list[str]:
    """What tensor parallelism splits, summed over the splitting layers (none: no line)."""
    import math

    split = [layer for layer in profile.layers if layer.splits]
    if not split:
        return []
    units = math.gcd(*(layer.tp_units for layer in split))
    measured = (
        "shares not measured: built on meta"
        if profile.build == "meta"
        else (f"shares measured at t={next((t for t in range(2, units + 1) if units % t == 0), 1)}")
    )
    return [
        f"tensor parallelism: {len(split)} layers split (t must divide {units}); of their forward "
        f"{sum(l.forward_ms for l in split):.3f} ms, {sum(l.tp_split_forward_ms for l in split):.3f} ms divide by t, "
        f"of backward {sum(l.backward_ms for l in split):.3f} ms, {sum(l.tp_split_backward_ms for l in split):.3f} ms "
        f"({measured}); parameters {format_bytes(sum(l.tp_split_param_bytes for l in split))} of "
        f"{format_bytes(sum(l.param_bytes for l in split))} split, saved "
        f"{format_bytes(sum(l.tp_split_saved_bytes for l in split))} of {format_bytes(sum(l.saved_bytes for l in split))}"
    ]


def batch_size_lines(profile: Profile) -> list[str]:
    """The sum of the layers at each measured batch size against the proportional model, or
    that a micro-batch's time is taken as proportional to its size (no sizes measured)."""
    sizes = profile.timed_batch_sizes
    if len(sizes) < 2:
        return [
            "not timed at smaller batch sizes: the planner takes a micro-batch's time as "
            "proportional to its samples"
        ]
    sums = [
        sum(layer.forward_ms_at[k] + layer.backward_ms_at[k] for layer in profile.layers)
        for k in range(len(sizes))
    ]
    proportional = sums[-1] * sizes[0] / sizes[-1]
    return [
        "sum of layers at batch "
        + ", ".join(f"{b}: {ms:.3f} ms" for b, ms in zip(sizes, sums))
        + f" (proportional to the batch, {sizes[0]} sample(s) would take {proportional:.3f} ms)"
    ]
