"""``pipeplan export-weights CHECKPOINT --model model.py -o DIR``: a checkpoint as the library's weights."""

from __future__ import annotations

import click

__all__ = ["export_weights"]


@click.command(
    "export-weights",
    epilog="""\b
Examples:
  pipeplan export-weights ckpt --model hf_gpt2.py -o trained/      # from_pretrained("trained/")
  pipeplan export-weights ckpt/step-000040 --model model.py -o out/  # out/model.safetensors
""",
)
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.option(
    "--model",
    "model_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="The model.py the checkpoint was trained from (or a bundled model: mlp, vgg, resnet, gpt).",
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(),
    help="A new (or empty) folder: a save_pretrained folder for a Hugging Face model, "
    "else model.safetensors (read it with safetensors.torch.load_model).",
)
def export_weights(checkpoint: str, model_path: str, output: str) -> None:
    """Write a run's newest complete checkpoint step (or the step folder given) as one state dict.

    Every stage's tensors are gathered by their qualified names, tied weights once; the
    result loads into the model as the library builds it, with no pipeplan installed.
    """
    from pipeplan.modelfile import load_model_file, resolve_model_path
    from pipeplan.runtime.checkpoint.write_weights import export_weights as write

    kind = write(checkpoint, load_model_file(resolve_model_path(model_path)), output)
    reader = "from_pretrained" if kind == "save_pretrained" else "safetensors.torch.load_model"
    click.echo(f"wrote {output} ({kind}; load it with {reader})")
