"""torch.export capture of library models (pipeplan.capture via build_layer_graph).

Models are tiny Hugging Face transformers built from config objects: nothing is
downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from pipeplan.capture import MODEL_OUTPUT, build_layer_graph  # noqa: E402
from pipeplan.errors import InputError  # noqa: E402
from pipeplan.model_inputs import ModelInputs  # noqa: E402
from pipeplan.modelfile import load_model_file  # noqa: E402
from pipeplan.profile import Profile  # noqa: E402
from pipeplan.profiler.profile_model import profile_model  # noqa: E402
from pipeplan.reporting.profile_table import summary_lines  # noqa: E402

ROOT = Path(__file__).parent.parent
GPT2_FILE = ROOT / "docs" / "tutorial" / "hf_gpt2.py"
FIXTURES = Path(__file__).parent / "fixtures" / "models"


def tiny_gpt2(layers: int = 2) -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=layers,
        n_embd=32,
        n_head=2,
        vocab_size=100,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def run_stages(stages, inputs):
    values = {f"input:{k}": value for k, value in enumerate(inputs)}
    for stage in stages:
        outputs = stage.module(*(values[name] for name in stage.input_names))
        values.update(zip(stage.output_names, outputs))
    return values[MODEL_OUTPUT]


def test_gpt2_layers_are_modules_of_each_block() -> None:
    model = tiny_gpt2()
    graph = build_layer_graph(model, (torch.randint(0, 100, (2, 8)),))
    assert graph.kind == "export"
    assert graph.dropped_outputs == ("past_key_values",)  # a DynamicCache: not a tensor
    names = [layer.name for layer in graph.layers]
    assert names == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.drop",
        "transformer.h.0.ln_1",
        "transformer.h.0.attn",
        "transformer.h.0.ln_2",
        "transformer.h.0.mlp",
        "transformer.h.1.ln_1",
        "transformer.h.1.attn",
        "transformer.h.1.ln_2",
        "transformer.h.1.mlp",
        "transformer.ln_f",
        "lm_head",
    ]
    by_name = {layer.name: layer for layer in graph.layers}
    # the residual add after attn joins attn's layer; the MLP reads it over a skip
    assert by_name["transformer.h.0.mlp"].inputs == (
        by_name["transformer.h.0.attn"].index,
        by_name["transformer.h.0.ln_2"].index,
    )
    assert by_name["transformer.h.0.attn"].type == "GPT2Attention"


def test_gpt2_stages_return_its_output_and_train_the_tied_model_parameters() -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, 100, (2, 8))
    targets = torch.randint(0, 100, (2, 8))
    graph = build_layer_graph(model, (ids,))
    stages = graph.split([0] * 6 + [1] * (len(graph) - 6))
    result = run_stages(stages, (ids,))
    assert type(result).__name__ == "CausalLMOutputWithCrossAttentions"
    assert result.past_key_values is None
    F.cross_entropy(result.logits.reshape(-1, 100), targets.reshape(-1)).backward()
    staged = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    expected = model(ids)
    torch.testing.assert_close(result.logits, expected.logits)
    F.cross_entropy(expected.logits.reshape(-1, 100), targets.reshape(-1)).backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(staged[name], parameter.grad, msg=name)
    # the embedding (stage 0) and the head (stage 1) hold the model's one tied tensor
    held = [stage.parameters_by_qualified_name() for stage in stages]
    assert held[0]["transformer.wte.weight"] is model.transformer.wte.weight
    assert held[1]["transformer.wte.weight"] is model.lm_head.weight is model.transformer.wte.weight


def test_leaf_modules_keep_each_block_whole() -> None:
    model = tiny_gpt2()
    graph = build_layer_graph(model, (torch.randint(0, 100, (2, 8)),), leaf_modules=("GPT2Block",))
    assert [(layer.name, layer.type) for layer in graph.layers][3:5] == [
        ("transformer.h.0", "GPT2Block"),
        ("transformer.h.1", "GPT2Block"),
    ]
    assert len(graph) == 7


def test_bert_reads_the_attention_mask_in_every_attention_layer() -> None:
    model_file = load_model_file(FIXTURES / "hf_bert.py")
    torch.manual_seed(0)
    model = model_file.build()
    inputs, targets = model_file.batch(4, seed=0)
    graph = build_layer_graph(model, inputs)
    readers = [layer.name for layer in graph.layers if 1 in layer.model_inputs]
    assert {"bert.encoder.layer.0.attention", "bert.encoder.layer.1.attention"} <= set(readers)
    assert [layer.name for layer in graph.layers if layer.name.startswith("bert.encoder.layer.0.")] == [
        "bert.encoder.layer.0.attention",
        "bert.encoder.layer.0.intermediate",
        "bert.encoder.layer.0.output",
    ]
    # stage 1 (from layer 1 on's second block) reads the mask itself: no model input is ever sent
    cut = next(layer.index for layer in graph.layers if layer.name == "bert.encoder.layer.1.attention")
    stages = graph.split([0] * cut + [1] * (len(graph) - cut))
    assert "input:1" in stages[1].input_names and stages[1].producers["input:1"] == -1
    result = run_stages(stages, inputs)
    torch.testing.assert_close(result.logits, model(*inputs).logits)
    padded = inputs[1].clone()
    padded[:, -1] = 1 - padded[:, -1]  # the mask changes the result: it is really read
    assert not torch.allclose(run_stages(stages, (inputs[0], padded)).logits, result.logits)


def test_leaf_module_keeps_a_module_export_cannot_trace_whole_under_fx() -> None:
    model_file = load_model_file(FIXTURES / "gated.py")  # `if x.sum() > 0` inside Gate, line 14
    x = torch.randn(2, 4)
    # without it, export runs Gate as an opaque layer (tests/test_capture_regions.py); with it, fx keeps Gate whole
    graph = build_layer_graph(model_file.build(), (x,), leaf_modules=("Gate",))
    assert graph.kind == "fx" and [layer.name for layer in graph.layers] == ["gate", "out"]


def test_cache_output_that_cannot_be_dropped_says_use_cache() -> None:
    class Cache:
        pass

    class ReturnsCache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x), Cache()  # a tuple: no field to drop

    with pytest.raises(InputError, match="return only tensors.*use_cache=False"):
        build_layer_graph(ReturnsCache(), (torch.randn(2, 4),))


def test_loss_that_reads_a_dropped_cache_says_use_cache(tmp_path: Path) -> None:
    model = tmp_path / "cache_loss.py"
    model.write_text(
        GPT2_FILE.read_text()
        + (
            "\n\ndef loss_fn(output, target):\n"
            "    return output.logits.float().mean() * output.past_key_values.get_seq_length()\n"
        )
    )
    with pytest.raises(
        InputError, match=r"loss_fn raised .*AttributeError.*past_key_values to None.*use_cache=False"
    ):
        profile_model(model, batch_size=2, device="cpu", warmup=0, repeats=1)


def test_segmentation_dict_output_profiles_with_the_default_loss() -> None:
    profile = profile_model(FIXTURES / "segmentation.py", batch_size=4, device="cpu", warmup=0, repeats=1)
    assert profile.capture == "export"  # a dict output: fx gives no single tensor
    assert [layer.name for layer in profile.layers] == ["stem", "body.0", "body.1", "body.2", "head"]
    assert profile.layers[-1].output_bytes == 4 * 4 * 8 * 8 * 4  # (B, C, H, W) float32 logits
    assert profile.step_ms > 0 and all(layer.forward_ms > 0 for layer in profile.layers)


def test_profile_records_capture_and_old_profiles_load(tmp_path: Path) -> None:
    profile = profile_model(FIXTURES / "residual.py", batch_size=4, device="cpu", warmup=0, repeats=1)
    assert (profile.capture, profile.leaf_modules) == ("fx", ())
    data = profile.to_dict()
    assert Profile.from_dict(data) == profile
    del data["capture"], data["leaf_modules"]  # a profile from before these fields
    assert Profile.from_dict(data).capture == ""


def test_unknown_leaf_module_class_is_one_line() -> None:
    with pytest.raises(InputError, match="leaf module class 'GPT3Block' is not in the model"):
        profile_model(GPT2_FILE, batch_size=2, device="cpu", warmup=0, repeats=1, leaf_modules=("GPT3Block",))


@pytest.mark.slow
@pytest.mark.timing
def test_twelve_block_gpt2_granularity_and_sum_of_layers_vs_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default granularity: 4 layers per GPT-2 block plus 5 (embeddings, dropout, ln_f, head)."""
    monkeypatch.setenv("HF_GPT2_LAYERS", "12")
    monkeypatch.setenv("HF_GPT2_WIDTH", "256")
    monkeypatch.setenv("HF_GPT2_SEQ", "64")
    profile = profile_model(GPT2_FILE, batch_size=8, device="cpu", warmup=2, repeats=5, threads=1)
    assert profile.capture == "export" and profile.dropped_outputs == ("past_key_values",)
    assert "output fields set to None (not tensors): past_key_values" in summary_lines(profile)[-1]
    assert len(profile.layers) == 4 * 12 + 5
    ratio = profile.layers_vs_step_ratio
    print(f"12-block tiny GPT-2: {len(profile.layers)} layers, sum of layers / step = {ratio:.3f}")
    assert 0.8 <= ratio <= 1.25, summary_lines(profile)[0]
    whole = sum(layer.saved_bytes for layer in profile.layers)
    assert 0.9 <= whole / profile.step_saved_bytes <= 1.1, summary_lines(profile)[1]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))


def test_exported_batchnorm_updates_the_model_statistics_as_eager_does() -> None:
    class ConvBN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)
            self.head = nn.Conv2d(4, 2, 1)

        def forward(self, x):
            return {"out": self.head(torch.relu(self.bn(self.conv(x))))}

    x = torch.randn(2, 3, 8, 8)
    torch.manual_seed(0)
    model = ConvBN()
    graph = build_layer_graph(model, (x,))
    assert graph.kind == "export" and [layer.name for layer in graph.layers] == ["conv", "bn", "head"]
    assert int(model.bn.num_batches_tracked) == 0  # capturing ran the model, and restored it
    result = run_stages(graph.split([0, 1, 1]), (x,))
    torch.manual_seed(0)
    eager = ConvBN()
    expected = eager(x)
    torch.testing.assert_close(result["out"], expected["out"])
    torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean)
    assert int(model.bn.num_batches_tracked) == 1


def test_an_export_captured_on_the_cpu_for_another_device_records_that_device() -> None:
    """The runtime captures on the CPU what runs on a GPU: the devices the export records (in
    ``arange``, ``_assert_tensor_metadata``) become the stage's device; None leaves them."""
    import torch.fx as fx

    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            use_cache=False,
        )
    )
    ids = torch.randint(0, 64, (2, 8))

    def devices(graph: fx.GraphModule) -> set[str]:
        found = set()
        for module in graph.modules():
            if isinstance(module, fx.GraphModule):
                for node in module.graph.nodes:
                    found |= {
                        str(v) for v in (*node.args, *node.kwargs.values()) if isinstance(v, torch.device)
                    }
        return found

    as_captured = build_layer_graph(model, model_inputs_of(ids))
    assert devices(as_captured.graph_module) == {"cpu"}
    retargeted = build_layer_graph(model, model_inputs_of(ids), device="meta")
    assert devices(retargeted.graph_module) == {"meta"}
    assert retargeted.fingerprint == as_captured.fingerprint


def model_inputs_of(ids: torch.Tensor) -> ModelInputs:
    from pipeplan.model_inputs import model_inputs

    return model_inputs({"input_ids": ids}, "sample_batch")
