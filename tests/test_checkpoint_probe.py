"""The tool's own tests of suites/test_checkpoint.py's machinery (no backend under test): moved out of the
conformance suite, which keeps only tests that judge a backend."""

import shutil

import pytest
import torch

from mla_conformance import checks
from mla_conformance.checks.layer.checkpoint import PROBE_SOURCES, probe_inputs, probe_source
from mla_conformance.generation.generate import DEFAULT_MODEL
from mla_conformance.model.probe import layer1_weights


@pytest.fixture(params=PROBE_SOURCES)
def probe(request):
    return probe_source(request)


@pytest.mark.mla_section("checkpoint-naive-vs-absorbed")
def test_naive_vs_absorbed_on_checkpoint(probe, mla_device, mla_figures):
    """Seed 000 section 5.2 / 5.3: the two reference paths on the same input, BF16 and the FP32 audit."""
    from mla_conformance.specs import get_backend

    source, directory = probe
    ids, x, w = probe_inputs(directory, source)
    scenario = checks.Scenario("seed000", (len(ids) - 1,), decode_steps=1)
    for dtype in ("bfloat16", "float32"):
        outs = [checks.run_scenario(get_backend(n), w.to(checks.DTYPES[dtype], device=mla_device),
                                    x.to(torch.float64), scenario, device=mla_device, capacity=32)[0][0, -1]
                for n in ("reference-naive", "reference-absorbed")]
        m = checks.error_metrics(outs[1], outs[0])
        mla_figures[dtype] = m
        assert m["rel_fro"] <= checks.TOLERANCES[dtype].rel_fro, f"{dtype}: {checks.format_metrics(m)}"


def test_bad_checkpoint_gives_one_clear_error(tmp_path, capsys):
    """A truncated model.safetensors: `generate` exits non-zero naming the file, no traceback (the command's own
    entry point in this process: an exception escaping it would fail the test with its traceback)."""
    from mla_conformance.cli import main

    bad = tmp_path / "tiny-mla"
    shutil.copytree(DEFAULT_MODEL, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    rc = main(["generate", "--model", str(bad), "--json"])
    out, err = capsys.readouterr()
    assert rc != 0
    assert str(f) in err and "truncated" in err, err
    assert "Traceback" not in err + out


@pytest.mark.parametrize("breakage", ["missing-tensor", "wrong-shape", "corrupt-header", "no-config"])
def test_probe_errors_name_file_and_tensor(tmp_path, breakage):
    from safetensors.torch import load_file, save_file

    from mla_conformance.errors import CheckpointError

    bad = tmp_path / "ckpt"
    shutil.copytree(DEFAULT_MODEL, bad)
    f = bad / "model.safetensors"
    tensors = load_file(str(f))
    if breakage == "missing-tensor":
        del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
        save_file(tensors, str(f))
        match = "kv_b_proj.weight"
    elif breakage == "wrong-shape":
        tensors["model.layers.1.self_attn.kv_b_proj.weight"] = tensors["model.layers.1.self_attn.kv_b_proj.weight"][:, :8].contiguous()
        save_file(tensors, str(f))
        match = "model.safetensors: tensor 'model.layers.1.self_attn.kv_b_proj.weight' has shape"
    elif breakage == "corrupt-header":
        f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + f.read_bytes()[24:])
        match = "model.safetensors: corrupt safetensors header"
    else:
        (bad / "config.json").unlink()
        match = "config.json"
    with pytest.raises(CheckpointError, match=match):
        layer1_weights(bad)
