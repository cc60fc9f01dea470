"""Architecture gating: which kernel runs where, the skip sentence, and ``mla-conformance matrix``.

Every verdict below is written out by hand from the upstream sources (FlashMLA README table,
setup.py gencode targets, csrc/api/*.h arch checks; FlashInfer mla.py / jit), not derived from
``mla_conformance.arch.matrix.MATRIX``, so a wrong row in the matrix fails here.  No GPU is needed:
devices are stated as data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mla_conformance.arch import gating
from mla_conformance.arch.capability import parse_capability
from mla_conformance.arch.device import DESCRIPTION_KEYS, DeviceInfo, PackageInfo, detect, device_description, device_line
from mla_conformance.arch.matrix import get_kernel, kernel_ids

REPO_ROOT = Path(__file__).resolve().parents[1]

# Devices: "cpu" or a compute capability, with a representative product name.
DEVICES = {
    "cpu": None,
    "7.0": "Tesla V100-SXM2-32GB",
    "8.0": "NVIDIA A100-SXM4-80GB",
    "8.6": "NVIDIA GeForce RTX 3090",
    "8.9": "NVIDIA L40S",
    "9.0": "NVIDIA H100 80GB HBM3",
    "10.0": "NVIDIA B200",
    "10.3": "NVIDIA B300 SXM6 AC",
    "12.0": "NVIDIA GeForce RTX 5090",
    "12.1": "NVIDIA GB10",
}

# The decision table.  Y = supported, . = not.
#   FlashMLA: dense decode SM90 only (sm_90a); sparse decode + sparse prefill SM90 and the SM100
#   family (sm_100f: 10.0 and 10.3); dense prefill (MHA) SM100 family only; nothing on SM12x.
#   FlashInfer: FA2 MLA (BatchMLAPagedAttentionWrapper's fallback, JIT for the device) SM80 through SM12x
#   (not Turing, not Thor); FA3 MLA needs SM90; CUTLASS MLA and TRTLLM-gen MLA SM100/SM103; XQA MLA SM12x.
_TABLE = """
device  dense_decode sparse_decode dense_prefill sparse_prefill fa2_mla fa3_mla cutlass_mla trtllm_gen_mla xqa_mla fa2_prefill fa3_prefill merge_state append_mla vllm_merge vllm_cache
cpu     .            .             .             .              .       .       .           .              . .           .           .           .          .          .
7.0     .            .             .             .              .       .       .           .              . .           .           .           .          .          .
8.0     .            .             .             .              Y       .       .           .              . Y           .           Y           Y          Y          Y
8.6     .            .             .             .              Y       .       .           .              . Y           .           Y           Y          Y          Y
8.9     .            .             .             .              Y       .       .           .              . Y           .           Y           Y          Y          Y
9.0     Y            Y             .             Y              Y       Y       .           .              . Y           Y           Y           Y          Y          Y
10.0    .            Y             Y             Y              Y       .       Y           Y              . Y           .           Y           Y          Y          Y
10.3    .            Y             Y             Y              Y       .       Y           Y              . Y           .           Y           Y          Y          Y
12.0    .            .             .             .              Y       .       .           .              Y Y           .           Y           Y          Y          Y
12.1    .            .             .             .              Y       .       .           .              Y Y           .           Y           Y          Y          Y
"""

_KERNEL_OF_COLUMN = {
    "dense_decode": "flashmla/dense_decode",
    "sparse_decode": "flashmla/sparse_decode",
    "dense_prefill": "flashmla/dense_prefill",
    "sparse_prefill": "flashmla/sparse_prefill",
    "fa2_mla": "flashinfer/fa2_mla",
    "fa3_mla": "flashinfer/fa3_mla",
    "cutlass_mla": "flashinfer/cutlass_mla",
    "trtllm_gen_mla": "flashinfer/trtllm_gen_mla",
    "xqa_mla": "flashinfer/xqa_mla",
    "fa2_prefill": "flashinfer/fa2_prefill",
    "fa3_prefill": "flashinfer/fa3_prefill",
    "merge_state": "flashinfer/merge_state",
    "append_mla": "flashinfer/append_paged_mla_kv_cache",
    "vllm_merge": "vllm/merge_attn_states",
    "vllm_cache": "vllm/concat_and_cache_mla",
}


def _expected() -> dict[tuple[str, str], bool]:
    lines = [ln.split() for ln in _TABLE.strip().splitlines()]
    header, body = lines[0][1:], lines[1:]
    table = {}
    for row in body:
        dev, marks = row[0], row[1:]
        assert len(marks) == len(header), row
        for col, mark in zip(header, marks):
            assert mark in ("Y", "."), row
            table[(dev, _KERNEL_OF_COLUMN[col])] = mark == "Y"
    return table


EXPECTED = _expected()
FLASHMLA_KERNELS = [k for k in _KERNEL_OF_COLUMN.values() if k.startswith("flashmla/")]


def _device(dev: str) -> DeviceInfo:
    if dev == "cpu":
        return DeviceInfo.cpu()
    return DeviceInfo.from_capability(dev, DEVICES[dev])


def test_table_covers_every_kernel_and_device():
    assert set(kernel_ids()) == set(_KERNEL_OF_COLUMN.values()), "a matrix row without a decision-table column"
    assert {d for d, _ in EXPECTED} == set(DEVICES)
    for kid in FLASHMLA_KERNELS:
        assert kid in kernel_ids()


@pytest.mark.parametrize(("dev", "kernel_id"), sorted(EXPECTED), ids=lambda v: str(v))
def test_decision_table(dev, kernel_id):
    reason = gating.why_not(kernel_id, _device(dev), check_package=False)
    if EXPECTED[(dev, kernel_id)]:
        assert reason is None, f"{kernel_id} on {dev}: expected supported, got: {reason}"
    else:
        assert isinstance(reason, str) and reason, f"{kernel_id} on {dev}: expected a reason, got supported"


@pytest.mark.parametrize("dev", sorted(DEVICES))
def test_decision_table_with_default_package_check_and_unknown_packages(dev):
    # A device stated as data knows nothing about packages: the package check cannot fire.
    for kid in FLASHMLA_KERNELS:
        expected = EXPECTED[(dev, kid)]
        assert (gating.why_not(kid, _device(dev)) is None) == expected


# --- the sentence ---------------------------------------------------------------------


def _one_sentence(reason: str) -> None:
    assert "\n" not in reason
    assert ". " not in reason, reason
    assert not reason.endswith("."), reason


@pytest.mark.parametrize("kernel_id", FLASHMLA_KERNELS)
@pytest.mark.parametrize("dev", ["8.9", "12.0", "12.1"])
def test_sentence_names_kernel_needed_arch_and_device(kernel_id, dev):
    info = _device(dev)
    reason = gating.why_not(kernel_id, info, check_package=False)
    _one_sentence(reason)
    row = get_kernel(kernel_id)
    assert reason.startswith(row.name + " needs "), reason
    assert row.name.startswith("FlashMLA ")
    assert info.sm in reason  # e.g. SM120
    assert DEVICES[dev] in reason
    assert f"compute capability {dev}" in reason


def test_sentence_dense_decode_on_rtx_5090_reads_well():
    info = DeviceInfo.from_capability((12, 0), "NVIDIA GeForce RTX 5090")
    reason = gating.why_not("flashmla/dense_decode", info, check_package=False)
    assert reason == (
        "FlashMLA dense decode needs SM90 (Hopper, compute capability 9.0); "
        "this device is SM120 (NVIDIA GeForce RTX 5090, compute capability 12.0)"
    )


def test_sentence_lists_both_architectures_for_sparse_kernels():
    reason = gating.why_not("flashmla/sparse_decode", _device("8.6"), check_package=False)
    assert "SM90" in reason and "SM100" in reason
    assert "9.0" in reason and "10.0" in reason and "10.3" in reason
    assert "SM86" in reason and "NVIDIA GeForce RTX 3090" in reason


def test_dense_prefill_on_hopper_names_sm100():
    reason = gating.why_not("flashmla/dense_prefill", _device("9.0"), check_package=False)
    assert reason.startswith("FlashMLA dense prefill needs SM100")
    assert "SM90 (NVIDIA H100 80GB HBM3" in reason


@pytest.mark.parametrize("kernel_id", FLASHMLA_KERNELS)
def test_sentence_on_cpu_host(kernel_id):
    reason = gating.why_not(kernel_id, DeviceInfo.cpu())
    _one_sentence(reason)
    assert reason.startswith(get_kernel(kernel_id).name + " needs SM")
    assert reason.endswith("this host has no CUDA device (cpu)")


def test_sentence_when_tests_run_on_cpu_of_a_cuda_host():
    info = DeviceInfo(device_type="cpu", cuda_available=True)
    reason = gating.why_not("flashmla/dense_decode", info)
    assert "cpu" in reason and "not a CUDA device" in reason


def test_rocm_gpu_is_never_taken_for_sm90():
    # torch on ROCm reports an MI250 as a "cuda" device with capability 9.0; detect() marks it rocm.
    info = DeviceInfo(device_type="rocm", name="AMD Instinct MI250X", cuda_available=True)
    reason = gating.why_not("flashmla/dense_decode", info)
    assert "AMD Instinct MI250X" in reason and "not an NVIDIA CUDA device" in reason


# --- CUDA version and package ---------------------------------------------------------


@pytest.mark.parametrize(
    ("cap", "cuda", "kernel_id", "needed"),
    [
        ("9.0", "12.6", "flashmla/dense_decode", "12.8"),
        ("10.0", "12.8", "flashmla/sparse_decode", "12.9"),
        ("10.3", "12.8", "flashmla/dense_prefill", "12.9"),
        ("10.0", "12.8", "flashmla/sparse_prefill", "12.9"),
    ],
)
def test_cuda_too_old(cap, cuda, kernel_id, needed):
    info = DeviceInfo.from_capability(cap, DEVICES[cap], cuda_version=cuda)
    reason = gating.why_not(kernel_id, info, check_package=False)
    _one_sentence(reason)
    assert f"needs CUDA >= {needed}" in reason
    assert f"this torch was built with CUDA {cuda} and this device is SM" in reason
    assert DEVICES[cap] in reason
    assert reason.startswith(get_kernel(kernel_id).name)


@pytest.mark.parametrize(
    ("cap", "cuda", "kernel_id"),
    [
        ("9.0", "12.8", "flashmla/sparse_decode"),  # 12.8 is enough on SM90 ...
        ("10.0", "12.9", "flashmla/sparse_decode"),  # ... SM100 needs 12.9
        ("10.3", "13.0", "flashmla/dense_prefill"),
        ("9.0", "12.9", "flashmla/dense_decode"),
    ],
)
def test_cuda_new_enough(cap, cuda, kernel_id):
    info = DeviceInfo.from_capability(cap, cuda_version=cuda)
    assert gating.why_not(kernel_id, info, check_package=False) is None


def test_architecture_is_judged_before_cuda():
    info = DeviceInfo.from_capability("12.0", "NVIDIA GeForce RTX 5090", cuda_version="12.8")
    reason = gating.why_not("flashmla/sparse_decode", info, check_package=False)
    assert "SM120" in reason and "CUDA >=" not in reason


def test_package_not_installed():
    info = DeviceInfo.from_capability(
        (9, 0), "NVIDIA H100 80GB HBM3", cuda_version="12.8", packages=[PackageInfo("flash_mla", False)]
    )
    reason = gating.why_not("flashmla/dense_decode", info)
    _one_sentence(reason)
    assert reason == (
        "FlashMLA dense decode runs on this device, SM90 (NVIDIA H100 80GB HBM3, compute capability 9.0), "
        "but the flash_mla package is not installed"
    )
    assert gating.why_not("flashmla/dense_decode", info, check_package=False) is None
    installed = DeviceInfo.from_capability((9, 0), packages=[PackageInfo("flash_mla", True, "1.0.0")])
    assert gating.why_not("flashmla/dense_decode", installed) is None


def test_unknown_kernel_id():
    with pytest.raises(ValueError) as excinfo:
        gating.why_not("flashmla/dense_decoding", DeviceInfo.cpu())
    msg = str(excinfo.value)
    assert "'flashmla/dense_decoding'" in msg
    for kid in FLASHMLA_KERNELS:
        assert kid in msg
    with pytest.raises(ValueError):
        gating.kernel_skip_reason("nope", "cpu")


# --- capabilities as data -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cap"),
    [
        ("9.0", (9, 0)), (" 12.1 ", (12, 1)), ("sm_90", (9, 0)), ("sm_90a", (9, 0)), ("SM100", (10, 0)),
        ("sm_103f", (10, 3)), ("sm_120", (12, 0)), ("compute_121", (12, 1)), ((8, 6), (8, 6)), ([10, 3], (10, 3)),
    ],
)
def test_parse_capability(text, cap):
    assert parse_capability(text) == cap
    assert DeviceInfo.from_capability(text).capability == cap


@pytest.mark.parametrize("bad", ["nine", "", "9", "9.", "9.0.1", "sm_", "12.10", (9,), (9, "0"), None, 9.0, (True, 0)])
def test_parse_capability_rejects(bad):
    with pytest.raises(ValueError, match="compute capability"):
        parse_capability(bad)


def test_device_info_from_capability_is_data():
    info = DeviceInfo.from_capability((10, 3), name="NVIDIA B300")
    assert info.device_type == "cuda" and info.is_cuda and not info.detected
    assert info.sm == "SM103"
    assert info.describe() == "SM103 (NVIDIA B300, compute capability 10.3)"
    assert DeviceInfo.from_capability("12.0").describe() == "SM120 (compute capability 12.0)"
    assert info.package("flash_mla") is None  # stated as data: no package known
    json.dumps(info.to_dict())


# --- this host ------------------------------------------------------------------------


def test_detect_this_host():
    import torch

    info = detect()
    assert info.detected
    assert info.torch_version == str(torch.__version__)
    assert info.cuda_version == torch.version.cuda
    assert isinstance(info.package("flash_mla").installed, bool)
    assert info.package("flashinfer") is not None
    if not torch.cuda.is_available():
        assert info.device_type == "cpu" and info.capability is None
    json.dumps(info.to_dict())


@pytest.mark.parametrize("device", ["cpu", "CPU_TORCH_DEVICE"])
def test_kernel_skip_reason_on_cpu(device):
    import torch

    if device == "CPU_TORCH_DEVICE":
        device = torch.device("cpu")
    for kid in FLASHMLA_KERNELS:
        reason = gating.kernel_skip_reason(kid, device)
        assert reason is not None and "cpu" in reason
        assert reason.startswith(get_kernel(kid).name)


def test_detect_finds_packages_without_importing_them():
    detect.cache_clear()
    try:
        info = detect("cpu")
        for module in ("flash_mla", "flashinfer"):
            pkg = info.package(module)
            assert pkg is not None
            if not pkg.installed:
                assert module not in sys.modules
    finally:
        detect.cache_clear()


# --- the matrix as data ---------------------------------------------------------------


def test_flashmla_rows_facts():
    dd = get_kernel("flashmla/dense_decode")
    assert (dd.kv_dtype, dd.mode, dd.head_dim_k, dd.head_dim_v, dd.page_block_size) == (
        "BF16", "MQA", (576,), (512,), (64,))
    sd = get_kernel("flashmla/sparse_decode")
    assert sd.kv_dtype.startswith("FP8") and "656" in sd.kv_dtype and sd.mode == "MQA"
    dp = get_kernel("flashmla/dense_prefill")
    assert dp.mode == "MHA" and dp.head_dim_v == (128,)
    for kid in FLASHMLA_KERNELS:
        row = get_kernel(kid)
        assert row.library == "FlashMLA" and row.package == "flash_mla"
        for t in row.targets:
            assert (t.name, t.build_target, t.min_cuda) in {("SM90", "sm_90a", (12, 8)), ("SM100", "sm_100f", (12, 9))}
        paths = {s.path for s in row.sources if s.where == "deepseek-ai/FlashMLA"}
        assert "README.md" in paths and any(p.startswith("csrc/") for p in paths)
        for s in row.sources:
            assert s.says
            if s.where == "deepseek-ai/FlashMLA":
                assert len(s.revision) == 40


# --- CLI ------------------------------------------------------------------------------


def _cli_main(argv, capsys):
    from mla_conformance import cli

    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_matrix_json_for_capability_12_0(capsys):
    rc, out, _ = _cli_main(["matrix", "--capability", "12.0", "--json"], capsys)
    assert rc == 0
    report = json.loads(out)
    assert set(report) == {"device", "matrix", "verdicts", "adapters"}
    assert set(report["adapters"]) <= set(kernel_ids())
    assert report["device"]["capability"] == "12.0" and report["device"]["sm"] == "SM120"
    assert report["device"]["judged_on"] == "architecture"
    assert [r["kernel_id"] for r in report["matrix"]] == kernel_ids()
    assert set(report["verdicts"]) == set(kernel_ids())
    for kid, verdict in report["verdicts"].items():
        assert set(verdict) == {"supported", "reason"}
        assert verdict["supported"] is EXPECTED[("12.0", kid)]
        assert (verdict["reason"] is None) is verdict["supported"]
    assert "SM120" in report["verdicts"]["flashmla/dense_decode"]["reason"]
    assert out.strip() == json.dumps(report, sort_keys=True, indent=2)


@pytest.mark.parametrize("cap", ["9.0", "10.3", "8.9"])
def test_cli_matrix_json_verdicts(cap, capsys):
    rc, out, _ = _cli_main(["matrix", "--capability", cap, "--json"], capsys)
    assert rc == 0
    verdicts = json.loads(out)["verdicts"]
    assert {k: v["supported"] for k, v in verdicts.items()} == {k: EXPECTED[(cap, k)] for k in verdicts}


def test_cli_matrix_with_cuda_version(capsys):
    rc, out, _ = _cli_main(["matrix", "--capability", "10.0", "--cuda", "12.8", "--json"], capsys)
    assert rc == 0
    report = json.loads(out)
    assert report["device"]["judged_on"] == "architecture and CUDA version"
    assert "12.9" in report["verdicts"]["flashmla/sparse_decode"]["reason"]


def test_cli_matrix_output_is_deterministic(capsys):
    first = _cli_main(["matrix", "--capability", "9.0", "--json"], capsys)
    second = _cli_main(["matrix", "--capability", "9.0", "--json"], capsys)
    assert first == second
    text1 = _cli_main(["matrix", "--capability", "9.0"], capsys)
    text2 = _cli_main(["matrix", "--capability", "9.0"], capsys)
    assert text1 == text2


def test_cli_matrix_text_this_host(capsys):
    rc, out, _ = _cli_main(["matrix"], capsys)
    assert rc == 0
    for kid in kernel_ids():
        assert kid in out
    assert "detected on this host" in out


def test_cli_matrix_malformed_capability_in_process(capsys):
    from mla_conformance import cli

    with pytest.raises(SystemExit) as excinfo:
        cli.main(["matrix", "--capability", "nine"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "argument --capability" in err and "'nine'" in err


def test_cli_matrix_malformed_capability_subprocess():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "mla_conformance.cli", "matrix", "--capability", "nine"],
        capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "mla-conformance matrix: error: argument --capability" in proc.stderr
    assert "'nine'" in proc.stderr
    assert proc.stdout == ""


# --- the text fits the terminal; the full table is in --format md -----------------------


def _lines_fit(text: str, columns: int) -> None:
    long = [line for line in text.splitlines() if len(line) > columns]
    assert not long, f"{len(long)} line(s) wider than {columns} columns, e.g. {long[0]!r} ({len(long[0])})"


@pytest.mark.parametrize("columns", [60, 80, 100, 132])
@pytest.mark.parametrize("argv", [["--capability", "12.0", "--name", "NVIDIA GeForce RTX 5090"], []],
                         ids=["sm120", "this-host"])
def test_cli_matrix_text_fits_the_terminal(columns, argv, capsys, monkeypatch):
    """Every line within the terminal's width (COLUMNS, as shutil.get_terminal_size reads it), nothing lost:
    every kernel id, and every verdict's sentence once the wrapping is undone."""
    monkeypatch.setenv("COLUMNS", str(columns))
    rc, out, _ = _cli_main(["matrix", *argv], capsys)
    assert rc == 0
    _lines_fit(out, columns)
    flat = " ".join(out.split())
    report = gating.matrix_report(*(["12.0"] if argv else []), name=argv[3] if argv else None)
    for kid, verdict in report["verdicts"].items():
        assert kid in out.splitlines()
        assert (verdict["reason"] if verdict["reason"] else "supported") in flat, kid


def test_cli_matrix_text_without_a_terminal_is_100_columns(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    from mla_conformance.cli import matrix as cli_matrix

    assert cli_matrix.FALLBACK_COLUMNS == 100
    rc, out, _ = _cli_main(["matrix", "--capability", "9.0"], capsys)  # captured: not a terminal
    assert rc == 0
    _lines_fit(out, cli_matrix.terminal_columns())


def test_cli_matrix_markdown_is_the_full_table(capsys):
    from mla_conformance.cli.matrix import support_matrix_table

    rc, out, _ = _cli_main(["matrix", "--capability", "12.0", "--format", "md"], capsys)
    assert rc == 0
    assert support_matrix_table().strip() in out  # the table markers.md carries, unwrapped
    assert get_kernel("flashmla/sparse_decode").kv_dtype in out
    for kid, verdict in gating.matrix_report("12.0")["verdicts"].items():
        assert f"| `{kid}` | {'supported' if verdict['supported'] else 'no: ' + verdict['reason']} |" in out


def test_cli_matrix_json_flag_is_format_json(capsys):
    assert _cli_main(["matrix", "--capability", "9.0", "--json"], capsys) == \
        _cli_main(["matrix", "--capability", "9.0", "--format", "json"], capsys)


def test_cli_matrix_malformed_cuda_version(capsys):
    from mla_conformance import cli

    with pytest.raises(SystemExit) as excinfo:
        cli.main(["matrix", "--capability", "9.0", "--cuda", "twelve"])
    assert excinfo.value.code == 2
    assert "expected a CUDA version such as 12.8, got 'twelve'" in capsys.readouterr().err


# --- the one device description ---------------------------------------------------------


def test_device_description_of_the_cpu():
    import torch

    d = device_description("cpu")
    assert tuple(d) == DESCRIPTION_KEYS
    assert d["device"] == "cpu" and d["device_name"] and d["torch"] == str(torch.__version__)
    assert d["sm"] is None and d["capability"] is None and d["cuda"] is None
    assert d["cores"] == os.cpu_count() and d["threads"] == torch.get_num_threads()
    assert device_line(d) == f"cpu: {d['device_name']}, {d['cores']} cores, {d['threads']} thread" + \
        ("s" if d["threads"] != 1 else "")
    json.dumps(d)


def test_device_description_of_a_cuda_device(monkeypatch):
    """A GPU stated as data (what detect() would find on an H100 with a CUDA 12.8 torch): the same keys."""
    from mla_conformance.arch import device

    monkeypatch.setattr(device, "detect", lambda dev=None: DeviceInfo.from_capability(
        (9, 0), "NVIDIA H100 80GB HBM3", cuda_version="12.8"))
    d = device_description("cuda:0")
    assert tuple(d) == DESCRIPTION_KEYS
    assert (d["device"], d["device_name"], d["sm"], d["capability"], d["cuda"]) == (
        "cuda:0", "NVIDIA H100 80GB HBM3", "SM90", "9.0", "12.8")
    assert device_line(d) == "cuda:0: NVIDIA H100 80GB HBM3, SM90 (capability 9.0), CUDA 12.8"
