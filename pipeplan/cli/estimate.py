"""``pipeplan estimate``: a what-if profile of a GPT on a device not at hand (marked estimated)."""

from __future__ import annotations

import click

__all__ = ["estimate"]

DEVICES = ("a100-80gb", "a100-40gb", "h100-sxm")  # pipeplan.profiler.estimate.DEVICE_RATES


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    required=True,
    help="Device whose datasheet rates price the layers.",
)
@click.option("--layers", type=int, required=True, help="Transformer blocks.")
@click.option("--hidden", type=int, required=True, help="Hidden size h.")
@click.option(
    "--heads", type=int, required=True, help="Attention heads (tensor-parallel degrees must divide it)."
)
@click.option("--seq-len", type=int, default=2048, show_default=True, help="Tokens per sequence.")
@click.option("--vocab", type=int, default=51200, show_default=True, help="Vocabulary size (padded).")
@click.option("--batch-size", type=int, required=True, help="Sequences per minibatch (the global batch).")
@click.option(
    "--recompute/--no-recompute",
    default=True,
    show_default=True,
    help="Full activation recomputation baked into the profile (Megatron's setting in the PTD-P paper); "
    "--no-recompute leaves it to the planner: each block carries its full and selective "
    "(attention-core) options, and partition --recompute chooses per stage.",
)
@click.option(
    "--matmul-efficiency",
    type=float,
    default=None,
    help="Share of the datasheet GEMM rate the compute-bound kernels reach (default: the calibrated 0.687, see the README).",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="profile.json", show_default=True)
def estimate(
    device: str,
    layers: int,
    hidden: int,
    heads: int,
    seq_len: int,
    vocab: int,
    batch_size: int,
    recompute: bool,
    matmul_efficiency: float | None,
    output: str,
) -> None:
    """Write the estimated profile of a Megatron GPT on DEVICE (no GPU needed).

    \b
    pipeplan estimate --device a100-80gb --layers 128 --hidden 25600 --heads 160 --batch-size 3072 -o gpt-1t.json
    pipeplan partition gpt-1t.json --topology megatron-a100 --schedule 1f1b-flush --microbatches 3072
    """
    from pipeplan.profiler.estimate import DEVICE_RATES, MATMUL_EFFICIENCY, GPTShape, estimate_gpt

    shape = GPTShape(layers, hidden, heads, seq_len, vocab)
    profile = estimate_gpt(
        shape,
        DEVICE_RATES[device],
        batch_size,
        recompute=recompute,
        matmul_efficiency=MATMUL_EFFICIENCY if matmul_efficiency is None else matmul_efficiency,
    )
    profile.save(output)
    total_ms = sum(layer.compute_ms for layer in profile.layers)
    click.echo(
        f"{profile.model}: {len(profile.layers)} layers, {total_ms / 1e3:.1f} s forward+backward per "
        f"minibatch of {batch_size} sequences on one {DEVICE_RATES[device].name}"
    )
    click.echo(f"ESTIMATED: {profile.estimated}")
    click.echo(f"wrote {output}")
