"""Tests for planner/hardware.py: presets and their sources, JSON round trip, cluster files,
units, roofline. Pure Python except the last test, which exercises the cpu-preset benchmark."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from planner.hardware import (
    NUMERIC_FIELDS,
    PRESETS,
    Hardware,
    HardwareError,
    get_hardware,
    load_cluster_file,
    parse_bandwidth,
    parse_flops,
    parse_seconds,
    parse_size,
    roofline_seconds,
)

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
ALL_FIELDS = [f.name for f in dataclasses.fields(Hardware) if f.name not in ("sources", "collectives")]
GPU_PRESETS = [name for name, hw in PRESETS.items() if hw.device_type == "cuda"]


def one_sentence(message: str, path: Path | None = None) -> bool:
    """One sentence ending in a period (ignoring "e.g." and the file path, which may hold dots)."""
    text = message.replace("e.g.", "eg")
    if path is not None:
        text = text.replace(str(path), "PATH")
    return text.endswith(".") and ". " not in text[:-1]


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

def test_required_presets_exist_and_are_named_after_their_key():
    for name in ("h100-sxm-80g", "h200-141g", "a100-80g", "a100-40g", "l4-24g", "cpu"):
        assert name in PRESETS
    for key, hw in PRESETS.items():
        assert hw.name == key
        assert get_hardware(key) is hw


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_numeric_field_of_every_preset_cites_a_source(name):
    hw = PRESETS[name]
    assert set(NUMERIC_FIELDS) == set(ALL_FIELDS) - {"name", "device_type"}
    for field in NUMERIC_FIELDS:
        source = hw.sources.get(field, "")
        assert len(source) >= 30, f"{name}.{field} has no real source: {source!r}"


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_estimates_say_they_are_estimates_and_datasheet_figures_name_a_document(name):
    hw = PRESETS[name]
    for field in ("usable_fraction", "intra_node_latency", "inter_node_latency", "cpu_adam_params_per_s"):
        assert "estimate" in hw.sources[field], f"{name}.{field} is an estimate but does not say so"
    for field in ("bf16_flops", "fp32_flops", "hbm_bandwidth", "host_to_device_bandwidth"):
        assert "datasheet" in hw.sources[field] or "whitepaper" in hw.sources[field], field
    assert "nvidia-smi" in hw.sources["memory_bytes"]


def test_cpu_preset_is_measured_with_the_checked_in_script():
    hw = PRESETS["cpu"]
    script = "plan calibrate --device cpu"
    measured = ("bf16_flops", "fp32_flops", "hbm_bandwidth", "intra_node_bandwidth", "intra_node_latency",
                "host_memory_bytes", "host_to_device_bandwidth", "cpu_adam_params_per_s", "host_cores",
                "collective_overlap")
    for field in measured:
        assert "measured on a 2-core dev machine" in hw.sources[field] and script in hw.sources[field], field
    assert hw.device_type == "cpu"
    assert hw.memory_bytes == 4 * GiB
    assert hw.usable_fraction == 1.0
    assert hw.gpus_per_node == 8
    # several 4 GiB processes must fit the host the figures were measured on
    assert hw.host_memory_bytes > 4 * hw.memory_bytes


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_json(name):
    hw = PRESETS[name]
    text = json.dumps(hw.to_json())
    back = Hardware.from_json(json.loads(text))
    assert back == hw
    assert back.sources == hw.sources
    assert hash(back) == hash(hw)
    # to_json hands out a copy: editing it does not touch the preset
    d = hw.to_json()
    d["sources"]["memory_bytes"] = "edited"
    assert hw.sources["memory_bytes"] != "edited"


def test_h100_figures_match_the_datasheet():
    hw = PRESETS["h100-sxm-80g"]
    assert abs(hw.bf16_flops - 989.4e12) / 989.4e12 < 0.01
    assert abs(hw.flops("mixed") - 989.4e12) / 989.4e12 < 0.01
    assert abs(hw.fp32_flops - 67e12) / 67e12 < 0.01
    assert abs(hw.memory_bytes / GiB - 80) < 1.0           # nvidia-smi: 81559 MiB = 79.6 GiB
    assert hw.memory_bytes == 81559 * 2**20
    assert abs(hw.hbm_bandwidth - 3.35e12) / 3.35e12 < 0.01
    assert hw.intra_node_bandwidth == 450e9                 # 900 GB/s NVLink is both directions together
    assert hw.inter_node_bandwidth == 50e9                  # one 400 Gb/s NIC per GPU


# What each GPU node's documents give as totals: the node's NICs, NVLink (both directions
# together, as datasheets quote it) and PCIe (both directions together).
NODE_TOTALS = {
    "h100-sxm-80g": ("3200Gb/s", "900GB/s", "128GB/s"),   # 8x 400 Gb/s ConnectX-7, NVLink4, PCIe Gen5
    "h200-141g": ("3200Gb/s", "900GB/s", "128GB/s"),
    "a100-80g": ("1600Gb/s", "600GB/s", "64GB/s"),        # 8x 200 Gb/s HDR, NVLink3, PCIe Gen4
    "a100-40g": ("1600Gb/s", "600GB/s", "64GB/s"),
    "l4-24g": ("100Gb/s", "64GB/s", "64GB/s"),            # g6.48xlarge 100 Gbps, no NVLink: PCIe Gen4
}


@pytest.mark.parametrize("name", sorted(NODE_TOTALS))
def test_link_figures_are_per_gpu_per_direction_shares_of_the_documented_totals(name):
    hw = PRESETS[name]
    nics, nvlink, pcie = (parse_bandwidth(x) for x in NODE_TOTALS[name])
    assert hw.inter_node_bandwidth * hw.gpus_per_node == pytest.approx(nics, rel=1e-9)
    assert hw.intra_node_bandwidth == pytest.approx(nvlink / 2, rel=1e-9)
    assert hw.host_to_device_bandwidth == pytest.approx(pcie / 2, rel=1e-9)


def test_presets_are_mutually_consistent():
    h100, h200 = PRESETS["h100-sxm-80g"], PRESETS["h200-141g"]
    a80, a40, l4 = PRESETS["a100-80g"], PRESETS["a100-40g"], PRESETS["l4-24g"]
    assert h200.bf16_flops == h100.bf16_flops and h200.memory_bytes > 1.7 * h100.memory_bytes
    assert h200.hbm_bandwidth > h100.hbm_bandwidth > a80.hbm_bandwidth > a40.hbm_bandwidth > l4.hbm_bandwidth
    assert a80.memory_bytes == 2 * a40.memory_bytes
    for name in GPU_PRESETS:
        hw = PRESETS[name]
        assert hw.bf16_flops > 3 * hw.fp32_flops, name         # tensor cores vs. plain fp32
        assert hw.intra_node_bandwidth > hw.inter_node_bandwidth, name
        assert hw.intra_node_latency < hw.inter_node_latency, name
        assert hw.usable_memory_bytes() < hw.memory_bytes, name
        assert hw.host_memory_bytes > hw.gpus_per_node * hw.memory_bytes, name


def test_flops_by_precision_and_usable_memory():
    hw = PRESETS["a100-40g"]
    assert hw.flops("fp32") == 19.5e12
    assert hw.flops("bf16") == hw.flops("mixed") == 312e12
    with pytest.raises(HardwareError, match="fp8"):
        hw.flops("fp8")
    assert hw.usable_memory_bytes() == int(40960 * 2**20 * 0.9)
    assert PRESETS["cpu"].usable_memory_bytes() == 4 * GiB


def test_unknown_preset_lists_the_presets():
    with pytest.raises(HardwareError) as e:
        get_hardware("h100-sxm-80")
    message = str(e.value)
    assert "h100-sxm-80g" in message
    for name in PRESETS:
        assert name in message
    assert one_sentence(message)


def test_hardware_checks_its_own_fields():
    base = PRESETS["cpu"]
    for field, bad in (("usable_fraction", 0.0), ("usable_fraction", 1.01), ("memory_bytes", 0),
                       ("gpus_per_node", True), ("hbm_bandwidth", -1.0), ("hbm_bandwidth", float("inf")),
                       ("device_type", "tpu"), ("fp32_flops", "93GFLOPS")):
        with pytest.raises(HardwareError, match=field):
            dataclasses.replace(base, **{field: bad})
    d = base.to_json()
    d["gpus_per_nod"] = 8
    with pytest.raises(HardwareError, match="gpus_per_nod"):
        Hardware.from_json(d)
    d = base.to_json()
    del d["hbm_bandwidth"]
    with pytest.raises(HardwareError, match="hbm_bandwidth"):
        Hardware.from_json(d)


def test_planner_hardware_does_not_import_torch():
    code = "import sys, planner.hardware; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * 2**30), ("141GB", 141 * 10**9), ("70 GiB", 70 * 2**30), ("1.5TiB", 3 * 2**39),
    ("512MiB", 512 * 2**20), ("1024", 1024), (1024, 1024), ("4KB", 4000), ("16B", 16), ("2gib", 2 * 2**30),
])
def test_parse_size(text, expected):
    value = parse_size(text)
    assert value == expected and isinstance(value, int)


def test_parse_other_units():
    assert parse_bandwidth("1.5TB/s") == 1.5e12
    assert parse_bandwidth("900GB/s") == 900e9
    assert parse_bandwidth("400Gb/s") == 50e9                 # bits, as NIC speeds are written
    assert parse_bandwidth("100Gbps") == 12.5e9
    assert parse_bandwidth("25GiB/s") == 25 * 2**30
    assert parse_bandwidth(3.35e12) == 3.35e12
    assert parse_seconds("10us") == 1e-5
    assert parse_seconds("2ms") == 2e-3
    assert parse_seconds("1s") == 1.0
    assert parse_seconds("500ns") == 5e-7
    assert parse_seconds(0.25) == 0.25
    assert parse_flops("989TFLOPS") == 989e12
    assert parse_flops("19.5 TFLOP/s") == 19.5e12
    assert parse_flops("93GFLOPS") == 93e9
    assert parse_flops(1e15) == 1e15


@pytest.mark.parametrize("text, words", [
    ("70GB/s", "bandwidth"), ("seventy", "number"), ("70gb", "ambiguous"), ("70Gb", "bits"),
    ("-1GiB", "positive"), ("0", "positive"), (True, "size"), ("70 parsecs", "unknown unit"),
])
def test_parse_size_rejects_with_one_clear_sentence(text, words):
    with pytest.raises(HardwareError) as e:
        parse_size(text, what="--memory-limit")
    message = str(e.value)
    assert "--memory-limit" in message and words in message
    assert one_sentence(message)


def test_other_parsers_reject_values_of_the_wrong_kind():
    with pytest.raises(HardwareError, match="per second"):
        parse_bandwidth("900GB")
    with pytest.raises(HardwareError, match="not a time"):
        parse_seconds("10GB")
    with pytest.raises(HardwareError, match="FLOP/s"):
        parse_flops("989TB")


# ---------------------------------------------------------------------------------------------
# Cluster files
# ---------------------------------------------------------------------------------------------

def write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_cluster_file_with_base_overrides_exactly_the_given_fields(tmp_path):
    path = write(tmp_path, """
[hardware]
base = "h100-sxm-80g"
gpus_per_node = 4
inter_node_bandwidth = "25GB/s"
intra_node_latency = "5us"
memory_bytes = "80GiB"
""")
    hw = load_cluster_file(path)
    base = PRESETS["h100-sxm-80g"]
    overrides = {"gpus_per_node": 4, "inter_node_bandwidth": 25e9, "intra_node_latency": 5e-6,
                 "memory_bytes": 80 * 2**30}
    for field in ALL_FIELDS:
        if field in overrides:
            assert getattr(hw, field) == overrides[field] != getattr(base, field), field
            assert str(path) in hw.sources[field]
        elif field != "name":
            assert getattr(hw, field) == getattr(base, field), field
            assert hw.sources[field].endswith(base.sources[field])
    assert hw.name != base.name and "h100-sxm-80g" in hw.name
    assert Hardware.from_json(hw.to_json()) == hw
    assert get_hardware(str(path)) == hw                    # a .toml path works wherever a preset name does


def test_cluster_file_without_base_gives_every_field(tmp_path):
    path = write(tmp_path, """
[hardware]
name = "my-rtx-box"
device_type = "cuda"
memory_bytes = "24GiB"
usable_fraction = "85%"
bf16_flops = "165TFLOPS"
fp32_flops = "82.6TFLOPS"
hbm_bandwidth = "1008GB/s"
gpus_per_node = 4
intra_node_bandwidth = "32GB/s"
intra_node_latency = "6us"
inter_node_bandwidth = "100Gb/s"
inter_node_latency = "0.02ms"
host_memory_bytes = 274877906944
host_to_device_bandwidth = "32GB/s"
cpu_adam_params_per_s = "1.2G/s"
""")
    hw = load_cluster_file(path)
    assert hw.name == "my-rtx-box" and hw.device_type == "cuda"
    assert hw.memory_bytes == 24 * GiB
    assert hw.usable_fraction == 0.85
    assert hw.bf16_flops == 165e12 and hw.fp32_flops == 82.6e12
    assert hw.hbm_bandwidth == 1008e9
    assert hw.gpus_per_node == 4
    assert hw.inter_node_bandwidth == 12.5e9
    assert hw.inter_node_latency == 2e-5
    assert hw.host_memory_bytes == 256 * GiB
    assert hw.cpu_adam_params_per_s == 1.2e9
    assert all(str(path) in hw.sources[f] for f in ALL_FIELDS)


FULL_WITHOUT = """
[hardware]
name = "x"
device_type = "cuda"
memory_bytes = "24GiB"
usable_fraction = 0.9
bf16_flops = "165TFLOPS"
fp32_flops = "82.6TFLOPS"
gpus_per_node = 4
intra_node_bandwidth = "32GB/s"
intra_node_latency = "6us"
inter_node_bandwidth = "100Gb/s"
inter_node_latency = "20us"
host_memory_bytes = "256GiB"
host_to_device_bandwidth = "32GB/s"
cpu_adam_params_per_s = 1.2e9
"""   # hbm_bandwidth is missing


@pytest.mark.parametrize("content, field", [
    ('[hardware]\nbase = "h100-sxm-80g"\ngpus_per_node = \n', "line"),                      # invalid TOML
    ('[hardwre]\nbase = "h100-sxm-80g"\n', "[hardware]"),                                   # no table
    ('gpus_per_node = 4\n[hardware]\nbase = "h100-sxm-80g"\n', "gpus_per_node"),            # outside the table
    ('[hardware]\nbase = "h100-sxm-80g"\ngpus_per_nod = 4\n', "gpus_per_nod"),              # unknown field
    ('[hardware]\nbase = "h100-sxm-80g"\nmemory_bytes = true\n', "memory_bytes"),           # wrong type
    ('[hardware]\nbase = "h100-sxm-80g"\nmemory_bytes = [80]\n', "memory_bytes"),           # wrong type
    ('[hardware]\nbase = "h100-sxm-80g"\ngpus_per_node = 8.5\n', "gpus_per_node"),          # not whole
    ('[hardware]\nbase = "h100-sxm-80g"\nhbm_bandwidth = "900GB"\n', "hbm_bandwidth"),      # size, not /s
    ('[hardware]\nbase = "h100-sxm-80g"\nmemory_bytes = "80GB/s"\n', "memory_bytes"),       # bandwidth, not size
    ('[hardware]\nbase = "h100-sxm-80g"\nmemory_bytes = "80gb"\n', "memory_bytes"),         # ambiguous unit
    ('[hardware]\nbase = "h100-sxm-80g"\nintra_node_latency = "10GB"\n', "intra_node_latency"),  # not a time
    ('[hardware]\nbase = "h100-sxm-80g"\nbf16_flops = "989TB"\n', "bf16_flops"),            # not FLOP/s
    ('[hardware]\nbase = "h100-sxm-80g"\ngpus_per_node = 0\n', "gpus_per_node"),            # non-positive
    ('[hardware]\nbase = "h100-sxm-80g"\nmemory_bytes = -1\n', "memory_bytes"),             # non-positive
    ('[hardware]\nbase = "h100-sxm-80g"\nhbm_bandwidth = "0TB/s"\n', "hbm_bandwidth"),      # non-positive
    ('[hardware]\nbase = "h100-sxm-80g"\nusable_fraction = 1.5\n', "usable_fraction"),      # outside (0, 1]
    ('[hardware]\nbase = "h100-sxm-80g"\nusable_fraction = 0\n', "usable_fraction"),        # outside (0, 1]
    ('[hardware]\nbase = "h100-sxm-80g"\ndevice_type = "tpu"\n', "device_type"),            # unknown device
    ('[hardware]\nbase = "h100"\n', "base"),                                                # unknown preset
    ('[hardware]\nbase = "h100-sxm-80g"\nsources = "me"\n', "sources"),                     # not settable
    ('[hardware]\ngpus_per_node = 4\n', "name"),                                            # no base, no name
    (FULL_WITHOUT, "hbm_bandwidth"),                                                        # no base, missing
])
def test_bad_cluster_files_name_the_offending_field(tmp_path, content, field):
    path = write(tmp_path, content)
    with pytest.raises(HardwareError) as e:
        load_cluster_file(path)
    message = str(e.value)
    assert field in message, message
    assert str(path) in message
    assert one_sentence(message, path), message


def test_missing_cluster_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(HardwareError) as e:
        load_cluster_file(path)
    assert str(path) in str(e.value) and "does not exist" in str(e.value)
    assert one_sentence(str(e.value), path)


def test_invalid_toml_reports_its_line(tmp_path):
    path = write(tmp_path, '[hardware]\nbase = "h100-sxm-80g"\n\ngpus_per_node = = 4\n')
    with pytest.raises(HardwareError, match=r"line 4"):
        load_cluster_file(path)


def test_unknown_field_suggests_the_right_one(tmp_path):
    path = write(tmp_path, '[hardware]\nbase = "a100-80g"\nhbm_bandwith = "2TB/s"\n')
    with pytest.raises(HardwareError, match=r"did you mean 'hbm_bandwidth'"):
        load_cluster_file(path)


# ---------------------------------------------------------------------------------------------
# Roofline
# ---------------------------------------------------------------------------------------------

def test_roofline_on_a_hand_computed_example():
    hw = dataclasses.replace(PRESETS["cpu"], bf16_flops=2e12, fp32_flops=5e11, hbm_bandwidth=1e9)
    # 6e12 FLOP at 2e12 FLOP/s = 3 s, plus 2e9 bytes at 1e9 B/s = 2 s
    assert roofline_seconds(hw, 6e12, 2e9, "mixed") == pytest.approx(5.0, rel=1e-12)
    assert roofline_seconds(hw, 6e12, 2e9, "bf16") == pytest.approx(5.0, rel=1e-12)
    # the same work in fp32: 6e12 / 5e11 = 12 s, plus 2 s
    assert roofline_seconds(hw, 6e12, 2e9, "fp32") == pytest.approx(14.0, rel=1e-12)
    # H100: one second of dense bf16 work plus one second of HBM traffic
    h100 = PRESETS["h100-sxm-80g"]
    assert roofline_seconds(h100, 989.4e12, 3.35e12, "bf16") == pytest.approx(2.0, rel=1e-9)
    assert roofline_seconds(h100, 0, 0, "fp32") == 0.0
    with pytest.raises(HardwareError, match="io_bytes"):
        roofline_seconds(h100, 1.0, -1.0, "fp32")
    with pytest.raises(HardwareError, match="precision"):
        roofline_seconds(h100, 1.0, 1.0, "int8")


# ---------------------------------------------------------------------------------------------
# The benchmark behind the cpu preset (imports torch; skipped where it is missing)
# ---------------------------------------------------------------------------------------------

def test_calibration_rates_run_and_give_plausible_figures():
    torch = pytest.importorskip("torch")
    from profiles import calibrate
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops = calibrate.matmul_flops(torch.float32, 256, 256, 256, repeats=3)
        copy = calibrate.copy_bandwidth(nbytes=16 * 2**20, repeats=3)
        adam = calibrate.adamw_params_per_s(total=2**18, tensors=4, repeats=2)
        launch = calibrate.op_launch_seconds(repeats=5)
    finally:
        torch.set_num_threads(threads)
    # one core of anything that runs these tests: between 100 MFLOP/s and 10 TFLOP/s, etc.
    assert 1e8 < flops < 1e13
    assert 1e8 < copy < 1e12
    assert 1e6 < adam < 1e11
    assert 1e-7 < launch < 1e-3          # eager PyTorch issues an op in about 1-50 us
    assert calibrate.host_memory_bytes() > 0
    # the names the calibration writes are Hardware's field names
    source = (ROOT / "profiles" / "calibrate.py").read_text()
    for field in re.findall(r'put\("([a-z0-9_]+)"', source):
        assert field in ALL_FIELDS, field
