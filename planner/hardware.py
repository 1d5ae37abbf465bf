"""Hardware descriptions for the planner: named presets, cluster files, units, roofline.

A `Hardware` holds what the cost model needs to know about one device type and the node it
sits in: device memory and how much of it plans may use, dense peak FLOP/s, HBM bandwidth,
the intra- and inter-node links (bandwidth per GPU per direction and latency per collective
step), host memory, host<->device bandwidth and how fast the host runs an optimizer step for
one GPU's share of offloaded parameters. Every number carries its source in `sources`.

Presets (`PRESETS`, `get_hardware`) cover common parts; anything else is described by a TOML
cluster file (`load_cluster_file`):

    [hardware]
    base = "h100-sxm-80g"          # optional: start from a preset, override what follows
    name = "my-h100-pcie-cluster"  # required when there is no base
    gpus_per_node = 4
    inter_node_bandwidth = "25GB/s"
    intra_node_latency = "5us"

Sizes may be integers of bytes or strings ("80GiB", "141GB"); bandwidths are per second
("900GB/s", "1.5TB/s", "400Gb/s" = 400 gigabits/s); FLOP/s as "989TFLOPS"; times as
"10us" / "2ms" / "1s" or a number of seconds. Every mistake raises `HardwareError` with one
sentence that names the field and the fix.

Torch-free by design: standard library only.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Hardware",
    "HardwareError",
    "PRESETS",
    "get_hardware",
    "load_cluster_file",
    "parse_size",
    "parse_bandwidth",
    "parse_flops",
    "parse_seconds",
    "roofline_seconds",
]


class HardwareError(Exception):
    """A hardware description that cannot be used; the message is one sentence with the fix."""


# ---------------------------------------------------------------------------------------------
# Fields and their kinds
# ---------------------------------------------------------------------------------------------

# kind of each field: how a cluster file may write it and how it is checked
_FIELD_KINDS: dict[str, str] = {
    "name": "name",
    "device_type": "device_type",
    "memory_bytes": "size",
    "usable_fraction": "fraction",
    "bf16_flops": "flops",
    "fp32_flops": "flops",
    "hbm_bandwidth": "bandwidth",
    "gpus_per_node": "count",
    "intra_node_bandwidth": "bandwidth",
    "intra_node_latency": "seconds",
    "inter_node_bandwidth": "bandwidth",
    "inter_node_latency": "seconds",
    "host_memory_bytes": "size",
    "host_to_device_bandwidth": "bandwidth",
    "cpu_adam_params_per_s": "rate",
    "host_cores": "rate",
    "collective_overlap": "share",
    "matmul_efficiency": "fraction",
    "matmul_knee": "count",
    "attention_efficiency": "fraction",
    "memory_efficiency": "fraction",
    "pipeline_overhead_s": "seconds",
    "op_launch_s": "seconds",
}
_MAY_BE_ZERO = {"collective_overlap", "pipeline_overhead_s", "op_launch_s"}
# Fields earlier versions wrote and the cost model no longer reads: a file that has one was
# measured or solved for another model of the step, so it is refused with what to do instead.
RETIRED_FIELDS = ("pipeline_contention_s",)   # 2026-12-07: pipeline overhead slowed as compute is instead
# Fields a cluster file without a base may leave out, and what they then are: rates at the
# datasheet's peak, collectives hidden behind compute (the assumptions before they existed).
_OPTIONAL_DEFAULTS: dict[str, Any] = {
    "host_cores": 64.0, "collective_overlap": 1.0, "matmul_efficiency": 1.0, "matmul_knee": 1,
    "attention_efficiency": 1.0, "memory_efficiency": 1.0, "pipeline_overhead_s": 0.0, "op_launch_s": 0.0,
}
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
_INT_FIELDS = tuple(k for k, v in _FIELD_KINDS.items() if v in ("size", "count"))
_FLOAT_FIELDS = tuple(k for k, v in _FIELD_KINDS.items() if v in ("fraction", "share", "flops", "bandwidth", "seconds", "rate"))
NUMERIC_FIELDS: tuple[str, ...] = _INT_FIELDS + _FLOAT_FIELDS
DEVICE_TYPES = ("cuda", "cpu")
PRECISIONS = ("fp32", "bf16", "mixed")

_EXAMPLES = {  # each completes "write ..." / "give ..."
    "size": 'a size such as "80GiB", "141GB" or an integer of bytes',
    "bandwidth": 'a bandwidth such as "900GB/s", "1.5TB/s", "400Gb/s" (bits) or a number of bytes/s',
    "flops": 'a FLOP/s figure such as "989TFLOPS" or a number',
    "seconds": 'a time such as "10us", "2ms", "1s" or a number of seconds',
    "rate": 'a rate such as "1.5G/s" or a number per second',
    "fraction": 'a fraction in (0, 1] such as 0.9 or "90%"',
    "share": 'a share in [0, 1] such as 0, 0.5 or "100%"',
    "count": "a positive integer such as 8",
}
_KIND_WORDS = {
    "size": "a size", "bandwidth": "a bandwidth", "flops": "a FLOP/s figure", "seconds": "a time",
    "rate": "a rate", "fraction": "a fraction", "share": "a share", "count": "a count",
}


@dataclass(frozen=True)
class CollectiveFit:
    """One collective's time, fitted from measurements: latency_s + nbytes / bandwidth, where
    nbytes is the whole tensor (an all-reduce's input, an all-gather's output, a reduce-scatter's
    input, a broadcast's or send's message), for `group` ranks while `processes` ranks of the
    node run such collectives at once."""

    kind: str                # one of COLLECTIVE_KINDS
    group: int               # ranks in one collective's group (2 for send_recv)
    processes: int           # ranks on the node running at the same time (groups side by side)
    latency_s: float
    bandwidth: float         # bytes/s of nbytes
    max_residual: float = 0.0  # worst relative miss of the fit over the measured sizes
    # Ranks reach a collective unevenly after the compute before it, the more so the longer
    # that compute (CPU processes taking turns on shared cores): the fit was timed after
    # `slice_s` of one rank's compute (its time alone), and the collective adds `per_slice_s`
    # seconds for each second more of compute before it (less for less). 0: not measured.
    slice_s: float = 0.0
    per_slice_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise HardwareError(f"collective kind {self.kind!r} is unknown; use one of {', '.join(COLLECTIVE_KINDS)}.")
        for name in ("group", "processes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise HardwareError(f"collective {self.kind} has {name} = {v!r}; give a positive integer.")
        for name in ("latency_s", "bandwidth", "max_residual", "slice_s", "per_slice_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                    or (name == "bandwidth" and v == 0):
                raise HardwareError(f"collective {self.kind} has {name} = {v!r}; give a non-negative finite number "
                                    "(a positive bandwidth).")
            object.__setattr__(self, name, float(v))

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth if nbytes > 0 else 0.0


HOST_USABLE_FRACTION = 0.8   # a design choice, not a measurement: what a node's host memory leaves to offload


def rank_noun(device_type: str) -> str:
    """What one rank of a plan is called on screen: a GPU, or a process on CPU."""
    return "process" if device_type == "cpu" else "GPU"


@dataclass(frozen=True)
class Hardware:
    name: str
    device_type: str            # "cuda" or "cpu" (cpu = CPU processes with gloo, as a 2-core dev machine runs plans)
    memory_bytes: int           # device memory as the driver reports it (e.g. nvidia-smi's MiB * 2**20)
    usable_fraction: float      # share of memory_bytes plans may use (CUDA context, allocator fragmentation)
    bf16_flops: float           # dense peak FLOP/s in bf16 (no sparsity)
    fp32_flops: float           # dense peak FLOP/s in fp32 without TF32 (PyTorch's default for matmul)
    hbm_bandwidth: float        # bytes/s (bytes read + bytes written per second)
    gpus_per_node: int
    intra_node_bandwidth: float  # bytes/s per GPU per direction (NVLink; PCIe where there is no NVLink)
    intra_node_latency: float   # s per collective step
    inter_node_bandwidth: float  # bytes/s per GPU per direction (the node's NICs divided by its GPUs)
    inter_node_latency: float   # s per collective step
    host_memory_bytes: int      # per node
    host_to_device_bandwidth: float  # bytes/s per GPU per direction (PCIe)
    cpu_adam_params_per_s: float     # parameters/s a host AdamW step updates for one GPU's share
    # What is achievable, as opposed to the datasheet's peaks above (see achievable_s):
    host_cores: float = 64.0         # ranks the node's cores run at full speed at once (CPU processes: more share them)
    collective_overlap: float = 1.0  # share of FSDP2 / DP collective time that compute hides (0: none, gloo on CPU)
    matmul_efficiency: float = 1.0   # best matmul FLOP/s as a share of the peak (large, aligned shapes)
    matmul_knee: int = 1             # a matmul dimension d reaches d / (d + knee) of that (tile and wave quantisation)
    attention_efficiency: float = 1.0  # fused attention kernels' FLOP/s as a share of the peak
    memory_efficiency: float = 1.0   # achievable share of hbm_bandwidth (streaming copies)
    pipeline_overhead_s: float = 0.0  # per micro-batch and action (a stage's forward or backward) of a pipeline: the schedule's bookkeeping and a small send or receive
    op_launch_s: float = 0.0         # the host's time to issue one op in eager PyTorch: fake-mode and moved layer times take no less than their ops' count times it
    collectives: tuple[CollectiveFit, ...] = ()  # calibrated collective times (plan calibrate); else the link figures
    sources: dict[str, str] = field(default_factory=dict, hash=False)  # field -> where the number comes from

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise HardwareError(f"name = {self.name!r} is not a usable name; give a non-empty string such as \"my-cluster\".")
        if self.device_type not in DEVICE_TYPES:
            raise HardwareError(
                f"device_type = {self.device_type!r} is not supported; use one of {', '.join(map(repr, DEVICE_TYPES))}."
            )
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                    object.__setattr__(self, name, value)
                else:
                    raise HardwareError(
                        f"{name} = {value!r} is not an integer; give {_EXAMPLES[_FIELD_KINDS[name]]}."
                    )
            if value <= 0:
                raise HardwareError(f"{name} = {value!r} must be positive; give {_EXAMPLES[_FIELD_KINDS[name]]}.")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise HardwareError(f"{name} = {value!r} is not a number; give {_EXAMPLES[_FIELD_KINDS[name]]}.")
            value = float(value)
            if not math.isfinite(value) or value < 0 or (value == 0 and name not in _MAY_BE_ZERO):
                raise HardwareError(
                    f"{name} = {value!r} must be a positive finite number; give {_EXAMPLES[_FIELD_KINDS[name]]}."
                )
            object.__setattr__(self, name, value)
        for name, kind in _FIELD_KINDS.items():
            value = getattr(self, name)
            if kind == "fraction" and not 0.0 < value <= 1.0:
                raise HardwareError(f"{name} = {value!r} must be in (0, 1]; give {_EXAMPLES['fraction']}.")
            if kind == "share" and not 0.0 <= value <= 1.0:
                raise HardwareError(f"{name} = {value!r} must be in [0, 1]; give {_EXAMPLES['share']}.")
        if not isinstance(self.collectives, (tuple, list)) or not all(isinstance(c, CollectiveFit) for c in self.collectives):
            raise HardwareError("collectives must be CollectiveFit entries; write them as [[collectives]] tables.")
        object.__setattr__(self, "collectives", tuple(self.collectives))
        if not 0.0 < self.usable_fraction <= 1.0:
            raise HardwareError(
                f"usable_fraction = {self.usable_fraction!r} must be in (0, 1]; give the share of memory_bytes "
                "plans may use, e.g. 0.9."
            )
        if not isinstance(self.sources, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.sources.items()
        ):
            raise HardwareError("sources must map field names to strings; give e.g. {\"hbm_bandwidth\": \"datasheet ...\"}.")
        unknown = sorted(set(self.sources) - set(_FIELD_KINDS))
        if unknown:
            raise HardwareError(
                f"sources names unknown field {unknown[0]!r}; use the names of Hardware's fields "
                f"({', '.join(_FIELD_KINDS)})."
            )
        object.__setattr__(self, "sources", dict(self.sources))

    def flops(self, precision: str) -> float:
        """Dense peak FLOP/s for `precision`: "fp32" -> fp32_flops; "bf16" or "mixed" -> bf16_flops."""
        if precision == "fp32":
            return self.fp32_flops
        if precision in ("bf16", "mixed"):
            return self.bf16_flops
        raise HardwareError(f"precision {precision!r} is unknown; use one of {', '.join(map(repr, PRECISIONS))}.")

    def usable_memory_bytes(self) -> int:
        """The bytes of device memory a plan may fill: memory_bytes * usable_fraction, rounded down."""
        return int(self.memory_bytes * self.usable_fraction)

    def usable_host_bytes(self) -> int:
        """The bytes of a node's host memory offloaded model states may fill: HOST_USABLE_FRACTION
        of host_memory_bytes; the rest is left to the OS, the page cache, data loading and the
        ranks' own processes (CUDA context, pinned staging buffers, the Python heap)."""
        return int(self.host_memory_bytes * HOST_USABLE_FRACTION)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["sources"] = dict(self.sources)
        d["collectives"] = [dataclasses.asdict(c) for c in self.collectives]
        return d

    # -- what is achievable ------------------------------------------------------------
    def matmul_flops(self, precision: str, m: int, n: int, k: int) -> float:
        """Achievable FLOP/s of an (m x k) @ (k x n) matmul: the best share of the peak, less
        for each dimension below the kernels' tiles (d / (d + knee) per dimension)."""
        shape = 1.0
        for d in (m, n, k):
            shape *= d / (d + self.matmul_knee) if self.matmul_knee > 1 else 1.0
        return self.flops(precision) * self.matmul_efficiency * shape

    def op_seconds(self, precision: str, kind: str, flops: float, io_bytes: float,
                   mnk: tuple[int, int, int] | None = None) -> float:
        """One op's time at achievable rates: a matmul's FLOPs at what its shape reaches,
        attention's at the fused kernels' rate, other FLOPs at the best matmul rate, and the
        bytes the op moves at the achievable memory bandwidth. No op beats the table."""
        if kind == "matmul" and mnk is not None:
            rate = self.matmul_flops(precision, *mnk)
        elif kind == "attention":
            rate = self.attention_flops(precision)
        else:
            rate = self.flops(precision) * self.matmul_efficiency
        return (flops / rate if flops else 0.0) + (io_bytes / self.memory_bandwidth() if io_bytes else 0.0)

    def attention_flops(self, precision: str) -> float:
        return self.flops(precision) * self.attention_efficiency

    def memory_bandwidth(self) -> float:
        return self.hbm_bandwidth * self.memory_efficiency

    def collective(self, kind: str, group: int, processes: int) -> CollectiveFit | None:
        """The calibrated fit for `kind` over `group` ranks, measured with the number of busy
        ranks closest to `processes` (at least it where there is one); None if none was measured."""
        fits = [c for c in self.collectives if c.kind == kind and c.group == group]
        if not fits:
            return None
        return min(fits, key=lambda c: (c.processes < processes, abs(c.processes - processes)))

    @classmethod
    def from_json(cls, d: dict) -> Hardware:
        if not isinstance(d, dict):
            raise HardwareError(f"hardware JSON must be an object, not {type(d).__name__}; pass what Hardware.to_json() wrote.")
        _refuse_retired(d, "this hardware JSON", "plan solve")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise HardwareError(
                f"hardware JSON has unknown field {unknown[0]!r}{_did_you_mean(unknown[0], known)}; "
                "pass what Hardware.to_json() wrote."
            )
        missing = [f for f in _FIELD_KINDS if f not in d and f not in _OPTIONAL_DEFAULTS]
        if missing:
            raise HardwareError(f"hardware JSON lacks {', '.join(missing)}; pass what Hardware.to_json() wrote.")
        values = {k: (dict(v) if k == "sources" and isinstance(v, dict) else v) for k, v in d.items()}
        values["collectives"] = _collectives_from(d.get("collectives", []), "hardware JSON")
        return cls(**values)


def retired_field(d: dict) -> str | None:
    """The first field of `d` (or of its sources) that an earlier version wrote and the cost
    model no longer reads."""
    sources = d.get("sources") if isinstance(d.get("sources"), dict) else {}
    return next((name for name in RETIRED_FIELDS if name in d or name in sources), None)


def _refuse_retired(d: dict, where: str, again: str) -> None:
    if (name := retired_field(d)) is not None:
        raise HardwareError(f"{where} was written for an earlier cost model (it has {name}, which is no longer "
                            f"used); run `{again}` again to write a current one.")


def _collectives_from(entries, where: str) -> tuple[CollectiveFit, ...]:
    """CollectiveFit entries from JSON or TOML tables (kind, group, processes, latency_s, bandwidth)."""
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise HardwareError(f"{where}: collectives must be a list of tables; write each as a [[collectives]] table.")
    names = {f.name for f in dataclasses.fields(CollectiveFit)}
    out = []
    for e in entries:
        unknown = sorted(set(e) - names)
        if unknown:
            raise HardwareError(f"{where}: a collectives entry has the unknown key {unknown[0]!r}; use {', '.join(sorted(names))}.")
        try:
            out.append(CollectiveFit(**e))
        except TypeError:
            raise HardwareError(f"{where}: a collectives entry lacks a key; give kind, group, processes, latency_s and bandwidth.") from None
        except HardwareError as err:
            raise HardwareError(f"{where}: {err}") from None
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------

_NUMBER_RE = re.compile(r"^\s*([+-]?(?:\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(?:[eE][+-]?\d+)?)\s*(.*?)\s*$")

_BYTE_UNITS = {
    "B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50,
}
_BIT_UNITS = {  # bytes per unit (b = bit, as NIC speeds are written)
    "b": 1 / 8, "bit": 1 / 8,
    "kb": 1e3 / 8, "Kb": 1e3 / 8, "kbit": 1e3 / 8, "Kbit": 1e3 / 8,
    "Mb": 1e6 / 8, "Mbit": 1e6 / 8, "Gb": 1e9 / 8, "Gbit": 1e9 / 8, "Tb": 1e12 / 8, "Tbit": 1e12 / 8,
}
_SI_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_TIME_DIVISORS = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "μs": 1e6, "ns": 1e9}  # divide: 10/1e6 == 1e-5 exactly
_FLOPS_RE = re.compile(r"^([kmgtp]?)(?:flops|flop/s)$", re.IGNORECASE)
_RATE_RE = re.compile(r"^([kKMGTP]?)(?:\s*(?:params?|parameters?))?(?:/s)?$")


def _split(text: str, what: str, kind: str) -> tuple[float, str]:
    m = _NUMBER_RE.match(text)
    if not m:
        raise HardwareError(f"{what} = {text!r} does not start with a number; write {_EXAMPLES[kind]}.")
    try:
        number = float(m.group(1).replace("_", ""))
    except ValueError:
        raise HardwareError(f"{what} = {text!r} has a malformed number; write {_EXAMPLES[kind]}.") from None
    return number, m.group(2).replace(" ", "")


def _byte_unit(unit: str, shown: str, what: str, kind: str) -> float:
    """Bytes per `unit` for sizes (bits only where kind is bandwidth)."""
    if unit == "":
        return 1.0
    if unit in _BYTE_UNITS:
        return float(_BYTE_UNITS[unit])
    if unit in _BIT_UNITS:
        if kind == "bandwidth":
            return _BIT_UNITS[unit]
        raise HardwareError(f"{what} = {shown} is in bits; write {_EXAMPLES['size']}.")
    lowered = {u.lower(): u for u in _BYTE_UNITS if "i" in u}
    if unit.lower() in lowered:  # binary units are unambiguous in any case ("gib" -> GiB)
        return float(_BYTE_UNITS[lowered[unit.lower()]])
    if unit.lower() in {"kb", "mb", "gb", "tb", "pb"}:
        p = unit[0].upper()
        hint = (f"{p}B/s for bytes or {p}bit/s for bits" if kind == "bandwidth"
                else f"{p}B (powers of 10) or {p}iB (powers of 2)")
        raise HardwareError(f"{what} = {shown} has the ambiguous unit {unit!r}; write {hint}.")
    raise HardwareError(f"{what} = {shown} has an unknown unit {unit!r}; write {_EXAMPLES[kind]}.")


def _parse(value: Any, kind: str, what: str) -> int | float | str:
    """Parse a cluster-file value of `kind` for field `what`; raise HardwareError naming it."""
    if kind == "name":
        if not isinstance(value, str) or not value.strip():
            raise HardwareError(f"{what} = {value!r} is not a usable name; give a non-empty string such as \"my-cluster\".")
        return value
    if kind == "device_type":
        if value not in DEVICE_TYPES:
            raise HardwareError(f"{what} = {value!r} is not supported; use one of {', '.join(map(repr, DEVICE_TYPES))}.")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise HardwareError(f"{what} = {shown} is not {_KIND_WORDS[kind]}; write {_EXAMPLES[kind]}.")

    shown = repr(value)  # numbers as written in TOML, strings quoted
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        number, unit = _split(value, what, kind)

    if kind == "size":
        if unit.endswith("/s") or unit.lower().endswith("ps"):
            raise HardwareError(f"{what} = {shown} is a bandwidth, not a size; write {_EXAMPLES['size']}.")
        result: float = number * _byte_unit(unit, shown, what, kind)
    elif kind == "bandwidth":
        if unit == "":
            base = ""
        elif unit.endswith("/s"):
            base = unit[:-2]
        elif unit.endswith("ps") and len(unit) > 2:  # "Gbps", "GBps"
            base = unit[:-2]
        else:
            raise HardwareError(
                f"{what} = {shown} is not per second; write {_EXAMPLES['bandwidth']}."
            )
        result = number * _byte_unit(base, shown, what, kind)
    elif kind == "flops":
        if unit == "":
            result = number
        else:
            m = _FLOPS_RE.match(unit)
            if not m:
                raise HardwareError(f"{what} = {shown} is not a FLOP/s figure; write {_EXAMPLES['flops']}.")
            result = number * _SI_PREFIX[m.group(1).upper()]
    elif kind == "seconds":
        if unit not in _TIME_DIVISORS:
            raise HardwareError(f"{what} = {shown} is not a time; write {_EXAMPLES['seconds']}.")
        result = number / _TIME_DIVISORS[unit]
    elif kind == "rate":
        m = _RATE_RE.match(unit)
        if not m:
            raise HardwareError(f"{what} = {shown} is not a rate; write {_EXAMPLES['rate']}.")
        result = number * _SI_PREFIX[m.group(1)]
    elif kind in ("fraction", "share"):
        if unit == "%":
            result = number / 100.0
        elif unit == "":
            result = number
        else:
            raise HardwareError(f"{what} = {shown} is not a fraction; write {_EXAMPLES['fraction']}.")
        if kind == "share":
            if not 0.0 <= result <= 1.0:
                raise HardwareError(f"{what} = {shown} must be in [0, 1]; write {_EXAMPLES['share']}.")
            return float(result)
        if not 0.0 < result <= 1.0:
            raise HardwareError(
                f"{what} = {shown} must be in (0, 1]; give the share of memory_bytes plans may use, e.g. 0.9."
            )
    elif kind == "count":
        if unit != "" or not number.is_integer():
            raise HardwareError(f"{what} = {shown} is not a whole number; write {_EXAMPLES['count']}.")
        result = number
    else:  # pragma: no cover - every kind is handled above
        raise AssertionError(kind)

    if not math.isfinite(result) or result < 0 or (result == 0 and what not in _MAY_BE_ZERO):
        raise HardwareError(f"{what} = {shown} must be positive; write {_EXAMPLES[kind]}.")
    if kind in ("size", "count"):
        return int(round(result))
    return float(result)


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from an integer or a string like "70GiB", "141GB", "1.5TB", "1024"; `what` names the
    value in the error (the CLI passes "--memory-limit")."""
    return int(_parse(text, "size", what))


SIZE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_size(n: float) -> str:
    """A byte count in the unit that suits it: "512 B", "3.41 MiB", "72.0 GiB", "1,051 GiB"."""
    for unit, scale in SIZE_UNITS:
        if abs(n) >= scale and (unit != "TiB" or abs(n) >= 10 * scale):
            v = n / scale
            return f"{v:,.2f} {unit}" if abs(v) < 10 else (f"{v:,.1f} {unit}" if abs(v) < 100 else f"{v:,.0f} {unit}")
    return f"{n:,.0f} B"


def size_flag_at_least(n: float) -> str:
    """A --memory-limit value (parse_size reads it) of at least `n` bytes, in a unit that suits it."""
    import math
    unit, scale = next(((u, sc) for u, sc in SIZE_UNITS[1:] if n >= sc), SIZE_UNITS[-1])
    hundredths = math.ceil(n / scale * 100)
    while parse_size(f"{hundredths / 100:g}{unit}") < n:    # the float rounded down
        hundredths += 1
    return f"{hundredths / 100:g}{unit}"


def parse_bandwidth(text: str | int | float) -> float:
    """Bytes/s from a number or a string like "900GB/s", "1.5TB/s", "400Gb/s" (gigabits)."""
    return float(_parse(text, "bandwidth", "bandwidth"))


def parse_flops(text: str | int | float) -> float:
    """FLOP/s from a number or a string like "989TFLOPS" or "19.5 TFLOP/s"."""
    return float(_parse(text, "flops", "flops"))


def parse_seconds(text: str | int | float) -> float:
    """Seconds from a number or a string like "10us", "2ms", "1s"."""
    return float(_parse(text, "seconds", "seconds"))


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

MiB = 2**20
GiB = 2**30
TiB = 2**40

# Shared source texts -------------------------------------------------------------------------
_NCCL_TUNING = ("NCCL src/graph/tuning.cc (github.com/NVIDIA/nccl, commit b6475625), hwLat table, "
                "Ring/Simple protocol")
_USABLE_EST = ("engineering estimate: the CUDA context (~0.5 GiB), NCCL communicator buffers, cuBLAS "
               "workspaces and caching-allocator fragmentation (typically 5-10% of reserved memory) "
               "sit outside what max_memory_allocated counts, so plans keep 10% of the driver's total free")
_ADAM_BYTES = ("fp32 AdamW moves 28 bytes per parameter (reads param, grad, exp_avg, exp_avg_sq = 16 B; "
               "writes param, exp_avg, exp_avg_sq = 12 B) and is memory-bound on a many-core host")
_ADAM_EFF = ("0.5 of theoretical DRAM bandwidth because all GPUs of the node step at once, STREAM-like "
             "kernels reach ~70-80% of peak and NUMA/PCIe traffic competes; a single core of the 2-core "
             "dev machine reached 1.44e9 param/s with fused AdamW (bench/measure_cpu_preset.py), so "
             "compute is not the limit")

_MAMF = ("Stas Bekman, Machine Learning Engineering Open Book, compute/accelerator/README.md, 'Maximum "
         "Achievable Matmul FLOPS comparison table' (mamf-finder.py, BF16 torch.matmul, best shape found)")
_KNEE = ("engineering estimate: a dimension d below the kernels' 128-256 tiles wastes tensor-core work and "
         "waves; d / (d + 128) per dimension puts a 4096^3 matmul at 91% of the best and 1024^3 at 70%; "
         "`plan calibrate --device cuda` fits it on the machine")
_OVERLAP_GPU = ("assumption, not yet measured: NCCL runs on its own CUDA streams, so FSDP2's prefetched "
                "all-gathers and reduce-scatters run beside compute; the runtime's step breakdown on a GPU "
                "will measure it")
_PIPE_GPU = ("not measured on a GPU yet (0): the schedule's per-micro-batch bookkeeping is then left to the "
             "send latency of the link figures; `plan calibrate --device cuda` will measure it")
_LAUNCH_GPU = ("measured through one H200's host (bench/gpu_check.sh, 2026-12-04; bench/results/gpu_fake.md): "
               "a ~1B GPT block at micro-batch 1 took 2.49 ms forward and backward, its 133 dispatched ops 0.63 ms "
               "at this preset's rates, so 18.7 us an op issued (the module calls, autograd's bookkeeping and the "
               "backward's own thread included, and part of the timing harness's fixed cost a timed call). The host sets it, not the GPU: another host of "
               "the same GPU was about 2x slower. `plan calibrate --device cuda` measures it on yours")
_HBM_EFF = ("engineering estimate: streaming copies reach about 90% of the HBM datasheet figure on Ampere "
            "and Hopper parts (a 4 GiB device copy is a typical measurement); `plan calibrate --device cuda` "
            "measures it")
_FA2 = ("Dao, FlashAttention-2 (2023): 50-73% of A100 peak forward, less backward; 0.6 taken for "
        "forward and backward together")
# Measured on one H200 (torch 2.11, bench/gpu_check.sh, 2026-12-04; bench/results/gpu/calibrate*.txt).
_H200_MATMUL = ("held to one H200 (bench/gpu_check.sh, 2026-12-04; bench/results/gpu/calibrate*.txt, "
                "bench/results/gpu_fake.md): its best shape, 4096^3, ran at 743-793 TFLOPS, and Llama 3 8B's "
                "vocabulary head (8192 x 128256 x 4096, forward and backward) at 741 within a real step, which "
                "this figure predicts within 2%. The calibration's sweep of large shapes, 8 calls back to back, "
                "held 630-700: under that sustained load the 700 W limit lowers the clocks; a step's matmuls, "
                "between lighter ops, are not held there")
_H200_ATTENTION = ("Shah et al., FlashAttention-3 (2024): FlashAttention-2, which PyTorch's SDPA runs, reaches 35% "
                   "of H100 peak; 0.35, held though one H200 measured more (bench/gpu_check.sh, 2026-12-04, "
                   "bench/results/gpu/calibrate*.txt): causal bf16 SDPA forward and backward, FLOPs as PyTorch's "
                   "counter counts them (the mask's skipped half included), ran at 35-46% of the peak at 1024 "
                   "tokens, 70-77% at 2048, 78-92% at 4096, 102-105% at 8192. At that rate (0.8) a fake profile "
                   "of Llama 3 8B's layer at 4096 tokens is 10-16% faster than the same layer measured in eager "
                   "PyTorch on the H200, which at 0.35 it matches within 5% (bench/results/gpu_fake.md): the eager "
                   "step's other ops lose what the kernel gains, and that loss is not modelled yet. It also took "
                   "bench/solve_real.py's 405B solve from 4.3 to 8.5 s (docs/cost-model.md)")
_H100_WP = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper (resources.nvidia.com/en-us-tensor-core/"
            "gtc22-whitepaper-hopper), table 'NVIDIA H100 SXM5' column")
_H100_DS = ("NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/), H100 SXM column")
_H200_DS = ("NVIDIA H200 Tensor Core GPU product page/datasheet (nvidia.com/en-us/data-center/h200/), "
            "H200 SXM column")
_A100_DS = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/"
            "pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)")
_L4_DS = "NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4/), specifications table"
_DGX_H = ("NVIDIA DGX BasePOD reference architecture, 'NVIDIA DGX H200 and H100 Systems' "
          "(docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/latest/"
          "core-components.html)")
_DGX_A = ("NVIDIA DGX A100 User Guide (DU-09821-001), 1.1.1 Component Specifications")
_AWS_G6 = ("AWS EC2 G6 instance types (aws.amazon.com/ec2/instance-types/g6/), g6.48xlarge row: "
           "8x L4, 192 vCPU, 768 GiB, 100 Gbps network")


def _hopper_sources(gpu: str, ds: str, memory_src: str, hbm_src: str, bf16_src: str, fp32_src: str) -> dict[str, str]:
    return {
        "name": f"preset for an 8-GPU {gpu} SXM node (DGX/HGX {gpu})",
        "device_type": "CUDA GPU",
        "memory_bytes": memory_src,
        "usable_fraction": _USABLE_EST,
        "bf16_flops": bf16_src,
        "fp32_flops": fp32_src,
        "hbm_bandwidth": hbm_src,
        "gpus_per_node": f"{_DGX_H}: eight NVIDIA Hopper GPUs per DGX {gpu}",
        "intra_node_bandwidth": (f"{ds}: NVLink 900 GB/s, which is the bidirectional total of 18 NVLink4 links "
                                 "x 50 GB/s; 450 GB/s per direction, reached through NVSwitch to any peer"),
        "intra_node_latency": (f"engineering estimate from {_NCCL_TUNING}: 3.4 us per ring step over NVLink "
                               "(NCCL adds a fixed 8.4 us base per collective that this per-step model omits)"),
        "inter_node_bandwidth": (f"{_DGX_H}: eight single-port ConnectX-7 up to 400 Gb/s for eight GPUs = "
                                 "400 Gb/s = 50 GB/s per GPU per direction"),
        "inter_node_latency": (f"engineering estimate from {_NCCL_TUNING}: 14 us per ring step over the "
                               "network (InfiniBand)"),
        "host_memory_bytes": f"{_DGX_H}: 2 TB of DDR5 system memory (32 x 64 GB DIMMs = 2 TiB)",
        "host_to_device_bandwidth": (f"{ds}: PCIe Gen5 128 GB/s bidirectional (x16) = 64 GB/s per direction; "
                                     "pinned copies reach roughly 50-55 GB/s in practice"),
        "cpu_adam_params_per_s": (f"engineering estimate: DGX {gpu} host = 2x Xeon Platinum 8480C ({_DGX_H}) "
                                  "with 8 DDR5-4800 channels each = 614 GB/s, /8 GPUs = 76.8 GB/s per GPU; "
                                  f"{_ADAM_BYTES}; at {_ADAM_EFF}: 76.8e9 * 0.5 / 28 = 1.37e9 param/s"),
        "host_cores": f"{_DGX_H}: 2x Xeon Platinum 8480C, 56 cores each = 112",
        "collective_overlap": _OVERLAP_GPU,
        "matmul_efficiency": f"{_MAMF}: H100 SXM 792.1 of 989 TFLOPS = 80.1% (GH200 821.0 = 83.0%); " + _H200_MATMUL,
        "matmul_knee": _KNEE,
        "attention_efficiency": _H200_ATTENTION,
        "memory_efficiency": _HBM_EFF if gpu != "H200" else (
            "measured as above: (read + written bytes) / t of a 1 GiB device-to-device copy_, 4.05 and 4.16 "
            "TB/s of the datasheet's 4.8 = 0.84-0.87"),
        "pipeline_overhead_s": _PIPE_GPU,
        "op_launch_s": _LAUNCH_GPU,
    }


def _ampere_sources(mem: str, memory_src: str, hbm_src: str, host_src: str) -> dict[str, str]:
    return {
        "name": f"preset for an 8-GPU A100 {mem} SXM4 node (DGX/HGX A100)",
        "device_type": "CUDA GPU",
        "memory_bytes": memory_src,
        "usable_fraction": _USABLE_EST,
        "bf16_flops": f"{_A100_DS}: BFLOAT16 Tensor Core 312 TFLOPS dense (624 with sparsity)",
        "fp32_flops": f"{_A100_DS}: FP32 19.5 TFLOPS (non-tensor; TF32 is off for PyTorch matmuls by default)",
        "hbm_bandwidth": hbm_src,
        "gpus_per_node": f"{_DGX_A}: 8x NVIDIA A100 GPUs per DGX A100",
        "intra_node_bandwidth": (f"{_A100_DS}: NVLink 600 GB/s, the bidirectional total of 12 NVLink3 links "
                                 "x 50 GB/s; 300 GB/s per direction through NVSwitch"),
        "intra_node_latency": (f"engineering estimate from {_NCCL_TUNING}: 3.4 us per ring step over NVLink "
                               "(NCCL adds a fixed 8.4 us base per collective that this per-step model omits)"),
        "inter_node_bandwidth": (f"{_DGX_A}: 8x single-port Mellanox ConnectX-6 VPI 200 Gb/s HDR InfiniBand "
                                 "for eight GPUs = 200 Gb/s = 25 GB/s per GPU per direction"),
        "inter_node_latency": (f"engineering estimate from {_NCCL_TUNING}: 14 us per ring step over the "
                               "network (InfiniBand)"),
        "host_memory_bytes": host_src,
        "host_to_device_bandwidth": (f"{_A100_DS}: PCIe Gen4 64 GB/s bidirectional (x16) = 32 GB/s per "
                                     "direction; pinned copies reach roughly 25 GB/s in practice"),
        "cpu_adam_params_per_s": (f"engineering estimate: DGX A100 host = 2x AMD EPYC 7742 ({_DGX_A}) with 8 "
                                  "DDR4-3200 channels each = 409.6 GB/s, /8 GPUs = 51.2 GB/s per GPU; "
                                  f"{_ADAM_BYTES}; at {_ADAM_EFF}: 51.2e9 * 0.5 / 28 = 0.914e9 param/s"),
        "host_cores": f"{_DGX_A}: 2x AMD EPYC 7742, 64 cores each = 128",
        "collective_overlap": _OVERLAP_GPU,
        "matmul_efficiency": f"{_MAMF}: A100 SXM 267.9 of 312 TFLOPS = 85.9%",
        "matmul_knee": _KNEE,
        "attention_efficiency": _FA2,
        "memory_efficiency": _HBM_EFF,
        "pipeline_overhead_s": _PIPE_GPU,
        "op_launch_s": _LAUNCH_GPU,
    }


_CPU_SCRIPT = ("`plan calibrate --device cpu --processes 2,4`, three runs in a row, each figure their median "
               "(what `--runs 3` now does; 2026-12-06, torch 2.13 CPU, 1 intra-op thread per process, freed "
               "memory kept: profiles/allocator.py)")
_CPU_MEASURED = f"measured on a 2-core dev machine (AMD EPYC VM with AVX-512 BF16, 2 vCPU, 23.5 GiB) with {_CPU_SCRIPT}"
# Collectives between CPU processes as a step sees them (plan calibrate): each timed as what it
# adds to a slice of compute before it, every process busy, the trimmed mean of 14 paired rounds
# (broadcasts and sends, which run back to back, in a chain of them; broadcasts from each rank in
# turn); fit latency + bytes / bandwidth over 1 KiB..8 MiB, each field the median of the three
# runs, the worst relative miss the largest of theirs. The three runs' latencies were within
# 5-25% of one another (all-reduce over 4: 6.15, 6.73, 6.53 ms). 4 processes on 2 cores pay
# several ms per collective. The slices those were timed after (2.5 ms of one core alone) and
# what a collective adds for each second more of compute before it (the last two figures;
# broadcasts and sends are timed back to back): a 64 KiB all-reduce after 0.3, 2.5 and 10 ms,
# the median slope of three runs on 2026-12-07 (over 4 of 4: 0.33, 0.44, 0.41; 2 of 4: 0.23,
# 0.17, 0.30; 2 of 2, where the two processes have a core each: 0.15, 0.08, 0.06). The
# broadcasts are a later calibration's (2026-12-07, stop 51, the medians of its three runs, in
# bench/results/time_fidelity_runs/cluster.toml at 2ef305c), timed packed and unpacked as ZeRO-1 issues
# them (runtime.sharded_optimizer.broadcast_packed): over 4 of 4 0.73 ms, where bare it was 0.60.
_CPU_COLLECTIVES = (
    CollectiveFit("all_gather", 2, 2, 0.001173, 2.095e+09, 0.36, 0.00248, 0.080),
    CollectiveFit("all_gather", 2, 4, 0.002279, 1.387e+09, 0.11, 0.00251, 0.225),
    CollectiveFit("all_gather", 4, 4, 0.004705, 1.732e+09, 0.11, 0.00249, 0.405),
    CollectiveFit("all_reduce", 2, 2, 0.001703, 1.587e+09, 0.24, 0.00248, 0.080),
    CollectiveFit("all_reduce", 2, 4, 0.003241, 1.211e+09, 0.22, 0.00251, 0.225),
    CollectiveFit("all_reduce", 4, 4, 0.006534, 1.108e+09, 0.10, 0.00249, 0.405),
    CollectiveFit("broadcast", 2, 2, 0.0001417, 2.885e+09, 0.45),
    CollectiveFit("broadcast", 2, 4, 0.0005062, 1.975e+09, 0.22),
    CollectiveFit("broadcast", 4, 4, 0.0007264, 1.215e+09, 0.27),
    CollectiveFit("reduce_scatter", 2, 2, 0.001942, 1.301e+09, 0.30, 0.00248, 0.080),
    CollectiveFit("reduce_scatter", 2, 4, 0.002758, 9.361e+08, 0.17, 0.00251, 0.225),
    CollectiveFit("reduce_scatter", 4, 4, 0.006367, 8.815e+08, 0.10, 0.00249, 0.405),
    CollectiveFit("send_recv", 2, 2, 7.486e-05, 3.439e+09, 0.44),
    CollectiveFit("send_recv", 2, 4, 0.0008089, 2.616e+09, 0.68),
)

PRESETS: dict[str, Hardware] = {
    "h100-sxm-80g": Hardware(
        name="h100-sxm-80g",
        device_type="cuda",
        memory_bytes=81559 * MiB,
        usable_fraction=0.90,
        bf16_flops=989.4e12,
        fp32_flops=66.9e12,
        hbm_bandwidth=3.35e12,
        gpus_per_node=8,
        intra_node_bandwidth=450e9,
        intra_node_latency=3.4e-6,
        inter_node_bandwidth=50e9,
        inter_node_latency=14e-6,
        host_memory_bytes=2 * TiB,
        host_to_device_bandwidth=64e9,
        cpu_adam_params_per_s=1.37e9,
        host_cores=112.0, collective_overlap=1.0, matmul_efficiency=0.801, matmul_knee=128, attention_efficiency=0.35, memory_efficiency=0.9, op_launch_s=18.7e-6,
        sources=_hopper_sources(
            "H100", _H100_DS,
            memory_src=("nvidia-smi memory.total of 'NVIDIA H100 80GB HBM3' = 81559 MiB (as printed in public "
                        "nvidia-smi logs); the datasheet's '80GB' is the marketing size"),
            hbm_src=f"{_H100_DS}: GPU memory bandwidth 3.35 TB/s (whitepaper: 3352 GB/s)",
            bf16_src=(f"{_H100_WP}: Peak BF16 Tensor TFLOPS with FP32 accumulate 989.4 (1978.9 with sparsity) "
                      "= 528 Tensor Cores x 1024 FLOP/clock x 1.83 GHz; datasheet: 1,979 TFLOPS with sparsity"),
            fp32_src=(f"{_H100_WP}: Peak FP32 TFLOPS (non-Tensor) 66.9; datasheet: FP32 67 TFLOPS "
                      "(TF32 is off for PyTorch matmuls by default)"),
        ),
    ),
    "h200-141g": Hardware(
        name="h200-141g",
        device_type="cuda",
        memory_bytes=143771 * MiB,
        usable_fraction=0.90,
        bf16_flops=989.4e12,
        fp32_flops=66.9e12,
        hbm_bandwidth=4.8e12,
        gpus_per_node=8,
        intra_node_bandwidth=450e9,
        intra_node_latency=3.4e-6,
        inter_node_bandwidth=50e9,
        inter_node_latency=14e-6,
        host_memory_bytes=2 * TiB,
        host_to_device_bandwidth=64e9,
        cpu_adam_params_per_s=1.37e9,
        host_cores=112.0, collective_overlap=1.0, matmul_efficiency=0.801, matmul_knee=128, attention_efficiency=0.35, memory_efficiency=0.85, op_launch_s=18.7e-6,
        sources=_hopper_sources(
            "H200", _H200_DS,
            memory_src=("nvidia-smi memory.total of 'NVIDIA H200' = 143771 MiB (as printed in public nvidia-smi "
                        "logs); the datasheet's '141GB' is the marketing size"),
            hbm_src=f"{_H200_DS}: GPU memory bandwidth 4.8 TB/s (HBM3e)",
            bf16_src=(f"{_H200_DS}: BFLOAT16 Tensor Core 1,979 TFLOPS with sparsity, halved for dense; the same "
                      f"GH100 SXM5 compute as H100 ({_H100_WP}: 989.4 dense)"),
            fp32_src=(f"{_H200_DS}: FP32 67 TFLOPS; 66.9 in {_H100_WP} for the same GH100 SXM5 at the same clock "
                      "(TF32 is off for PyTorch matmuls by default)"),
        ),
    ),
    "a100-80g": Hardware(
        name="a100-80g",
        device_type="cuda",
        memory_bytes=81920 * MiB,
        usable_fraction=0.90,
        bf16_flops=312e12,
        fp32_flops=19.5e12,
        hbm_bandwidth=2.039e12,
        gpus_per_node=8,
        intra_node_bandwidth=300e9,
        intra_node_latency=3.4e-6,
        inter_node_bandwidth=25e9,
        inter_node_latency=14e-6,
        host_memory_bytes=2 * TiB,
        host_to_device_bandwidth=32e9,
        cpu_adam_params_per_s=0.914e9,
        host_cores=128.0, collective_overlap=1.0, matmul_efficiency=0.859, matmul_knee=128, attention_efficiency=0.6, memory_efficiency=0.9, op_launch_s=18.7e-6,
        sources=_ampere_sources(
            "80GB",
            memory_src="nvidia-smi memory.total of 'NVIDIA A100-SXM4-80GB' = 81920 MiB (as printed in public nvidia-smi logs)",
            hbm_src=f"{_A100_DS}: A100 80GB SXM GPU memory bandwidth 2,039 GB/s (HBM2e)",
            host_src=f"{_DGX_A}: DGX A100 640GB system memory 2 TB (32 x 64 GB DIMMs = 2 TiB)",
        ),
    ),
    "a100-40g": Hardware(
        name="a100-40g",
        device_type="cuda",
        memory_bytes=40960 * MiB,
        usable_fraction=0.90,
        bf16_flops=312e12,
        fp32_flops=19.5e12,
        hbm_bandwidth=1.555e12,
        gpus_per_node=8,
        intra_node_bandwidth=300e9,
        intra_node_latency=3.4e-6,
        inter_node_bandwidth=25e9,
        inter_node_latency=14e-6,
        host_memory_bytes=1 * TiB,
        host_to_device_bandwidth=32e9,
        cpu_adam_params_per_s=0.914e9,
        host_cores=128.0, collective_overlap=1.0, matmul_efficiency=0.859, matmul_knee=128, attention_efficiency=0.6, memory_efficiency=0.9, op_launch_s=18.7e-6,
        sources=_ampere_sources(
            "40GB",
            memory_src="nvidia-smi memory.total of 'NVIDIA A100-SXM4-40GB' = 40960 MiB (as printed in public nvidia-smi logs)",
            hbm_src=f"{_A100_DS}: A100 40GB GPU memory bandwidth 1,555 GB/s (HBM2)",
            host_src=f"{_DGX_A}: DGX A100 320GB system memory 1 TB (16 x 64 GB DIMMs = 1 TiB)",
        ),
    ),
    "l4-24g": Hardware(
        name="l4-24g",
        device_type="cuda",
        memory_bytes=23034 * MiB,
        usable_fraction=0.90,
        bf16_flops=121e12,
        fp32_flops=30.3e12,
        hbm_bandwidth=300e9,
        gpus_per_node=8,
        intra_node_bandwidth=32e9,
        intra_node_latency=5.7e-6,
        inter_node_bandwidth=1.5625e9,
        inter_node_latency=14e-6,
        host_memory_bytes=768 * GiB,
        host_to_device_bandwidth=32e9,
        cpu_adam_params_per_s=0.914e9,
        host_cores=96.0, collective_overlap=1.0, matmul_efficiency=0.7, matmul_knee=128, attention_efficiency=0.5, memory_efficiency=0.9, op_launch_s=18.7e-6,
        sources={
            "name": "preset for an 8x L4 PCIe node (AWS g6.48xlarge-like)",
            "device_type": "CUDA GPU",
            "memory_bytes": "nvidia-smi memory.total of 'NVIDIA L4' = 23034 MiB (as printed in public nvidia-smi logs)",
            "usable_fraction": _USABLE_EST,
            "bf16_flops": f"{_L4_DS}: BF16 Tensor Core 242 TFLOPS with sparsity, halved for dense = 121 TFLOPS",
            "fp32_flops": f"{_L4_DS}: FP32 30.3 TFLOPS (TF32 is off for PyTorch matmuls by default)",
            "hbm_bandwidth": f"{_L4_DS}: GPU memory bandwidth 300 GB/s (GDDR6, not HBM)",
            "gpus_per_node": _AWS_G6,
            "intra_node_bandwidth": (f"{_L4_DS}: no NVLink, PCIe Gen4 x16 64 GB/s bidirectional = 32 GB/s per "
                                     "direction; an upper bound, peer traffic through the host root complex "
                                     "or PCIe switches usually gets less"),
            "intra_node_latency": f"engineering estimate from {_NCCL_TUNING}: 5.7 us per ring step over PCIe",
            "inter_node_bandwidth": f"{_AWS_G6}: 100 Gb/s per node / 8 GPUs = 12.5 Gb/s = 1.5625 GB/s per GPU",
            "inter_node_latency": (f"engineering estimate from {_NCCL_TUNING}: 14 us per ring step over the "
                                   "network; likely optimistic on a TCP (non-RDMA) cloud network"),
            "host_memory_bytes": f"{_AWS_G6}: 768 GiB",
            "host_to_device_bandwidth": f"{_L4_DS}: PCIe Gen4 x16 64 GB/s bidirectional = 32 GB/s per direction",
            "cpu_adam_params_per_s": ("engineering estimate: g6 hosts are 3rd-gen AMD EPYC; assuming two sockets "
                                      "of 8 DDR4-3200 channels (409.6 GB/s) as in a DGX A100, /8 GPUs = 51.2 GB/s "
                                      f"per GPU; {_ADAM_BYTES}; at {_ADAM_EFF}: 51.2e9 * 0.5 / 28 = 0.914e9 param/s"),
            "host_cores": f"{_AWS_G6}: 192 vCPU = 96 cores",
            "collective_overlap": _OVERLAP_GPU,
            "matmul_efficiency": ("engineering estimate: no published MAMF figure for the 72 W L4, which throttles "
                                  "under sustained tensor-core load; 0.7 assumed, below the A100's and H100's"),
            "matmul_knee": _KNEE,
            "attention_efficiency": "engineering estimate: FlashAttention-2 on Ada parts, 0.5 assumed (A100: 0.6)",
            "memory_efficiency": _HBM_EFF,
            "pipeline_overhead_s": _PIPE_GPU,
            "op_launch_s": _LAUNCH_GPU,
        },
    ),
    "cpu": Hardware(
        name="cpu",
        device_type="cpu",
        memory_bytes=4 * GiB,
        usable_fraction=1.0,
        bf16_flops=4.50e+11,
        fp32_flops=1.04e+11,
        hbm_bandwidth=5.11e+10,
        gpus_per_node=8,
        intra_node_bandwidth=1.59e+09,
        intra_node_latency=0.000851,
        inter_node_bandwidth=1.59e+09,
        inter_node_latency=0.000851,
        host_memory_bytes=25276182528,
        host_to_device_bandwidth=1.81e+10,
        cpu_adam_params_per_s=1.82e+09,
        host_cores=1.81,
        collective_overlap=0.0,
        pipeline_overhead_s=0.000758,
        op_launch_s=6.3e-06,
        collectives=_CPU_COLLECTIVES,
        sources={
            "name": "preset for plans executed as CPU processes with gloo (tests, a 2-core dev machine)",
            "device_type": "CPU processes, gloo backend",
            "memory_bytes": ("design choice: 4 GiB per process, so that the several processes a plan runs fit "
                             "in the 24 GiB dev machine with room for the OS, the parent and the test runner"),
            "usable_fraction": "design choice: 1.0, as memory_bytes is already a budget, not a device size",
            "bf16_flops": (f"{_CPU_MEASURED}: 512^3 bf16 torch.mm, 1 thread, 2n^3/t (1.3 GFLOP/s on 2026-12-01, "
                           "a host of this VM without a fast bf16 path)"),
            "fp32_flops": f"{_CPU_MEASURED}: 1024^3 fp32 torch.mm, 1 thread, 2n^3/t",
            "hbm_bandwidth": (f"{_CPU_MEASURED}: the fused AdamW step below touches 28 bytes per fp32 parameter "
                              "(read p, g, m, v; write p, m, v): its rate x 28 B. Taken from the optimizer rather "
                              "than from copy_ so that a step on the 'device' and the same step 'offloaded' to this "
                              "same CPU cost the same, as they do"),
            "gpus_per_node": "design choice: up to 8 processes on one machine, all local",
            "intra_node_bandwidth": f"{_CPU_MEASURED}: all_reduce over 2 of 2 processes, the fit's bandwidth",
            "intra_node_latency": f"{_CPU_MEASURED}: all_reduce over 2 of 2 processes, the fit's latency / 2 ring steps",
            "inter_node_bandwidth": ("same as intra_node_bandwidth: every process is on this machine, so a "
                                     f"'node' boundary changes nothing ({_CPU_MEASURED})"),
            "inter_node_latency": ("same as intra_node_latency: every process is on this machine, so a 'node' "
                                   f"boundary changes nothing ({_CPU_MEASURED})"),
            "host_memory_bytes": f"{_CPU_MEASURED}: MemTotal in /proc/meminfo",
            "host_to_device_bandwidth": (f"{_CPU_MEASURED}: on CPU an offload is a host-to-host copy; bytes "
                                         "moved / t of a 256 MiB copy_, 1 thread"),
            "cpu_adam_params_per_s": (f"{_CPU_MEASURED}: torch.optim.AdamW(fused=True).step() on 16M fp32 "
                                      "parameters in 16 tensors, 1 thread"),
            "host_cores": ("measured on a 2-core dev machine (the same VM) with what `plan calibrate --device cpu` runs for "
                           "it, calibrate.effective_cores(4), three times on 2026-12-07: 4 single-thread "
                           "processes started together each ran two 256-1024-256 MLPs' forward and backward on 64 rows "
                           "at 87-92 passes a second where one alone ran 190-203, so 1.73, 1.85 and 1.81 (three "
                           "launches of three rounds each; the median) run at full speed at once. Work like a "
                           "layer's, not in-cache matmuls: those read 1.97-1.99 on the same VM while the example "
                           "models' blocks slowed 2.33-2.69x with four at once (bench/results/contention.md)"),

            "collective_overlap": (f"{_CPU_MEASURED}: gloo runs FSDP2's collectives on threads that the ranks' own "
                                   "cores must serve, and the runtime's step breakdown shows FSDP2 waiting on each "
                                   "one: nothing hides them"),
            "matmul_efficiency": "not used on CPU: layers are timed where they run (1.0, the peak above is measured)",
            "matmul_knee": "not used on CPU: layers are timed where they run",
            "attention_efficiency": "not used on CPU: layers are timed where they run",
            "memory_efficiency": "not used on CPU: the bandwidth above is measured",
            "pipeline_overhead_s": (f"{_CPU_MEASURED}: a 1F1B schedule over 4 stages of a 16x16 linear layer, "
                                    "8 micro-batches: step / (m + pp - 1) / 2 actions (a forward and a backward a slot); "
                                    "0.61-0.85 ms in the three runs (1.01 ms on 2026-12-01, 0.93 on 2026-12-04, 0.57-0.91 "
                                    "in three on 2026-12-07). Where a pipeline's busy ranks outnumber the cores it is "
                                    "slowed as compute is (planner/cost.py, time_terms)"),
            "op_launch_s": ("measured on the same machine with calibrate.op_launch_seconds() (2026-12-05, 1 thread): "
                            "6.3 us an op, the median of five; used only by fake-mode profiles with this preset "
                            "(CPU layers are timed where they run)"),
        },
    ),
}


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


DEFAULT_HARDWARE = "h100-sxm-80g"   # what `plan solve` and `plan profile --fake` assume unless told


def get_hardware(name: str) -> Hardware:
    """The preset called `name`; a name ending in ".toml" is read as a cluster file."""
    if isinstance(name, str) and name.endswith(".toml"):
        return load_cluster_file(name)
    if name in PRESETS:
        return PRESETS[name]
    raise HardwareError(
        f"hardware {name!r} is not a preset{_did_you_mean(str(name), PRESETS)}; use one of "
        f"{', '.join(PRESETS)} or the path of a .toml cluster file."
    )


# ---------------------------------------------------------------------------------------------
# Cluster files
# ---------------------------------------------------------------------------------------------

def load_cluster_file(path) -> Hardware:
    """Read a TOML cluster file with a [hardware] table (see the module docstring)."""
    p = Path(path)
    where = f"cluster file {p}"
    if not p.is_file():
        raise HardwareError(f"{where} does not exist; pass the path of a TOML file with a [hardware] table.")
    try:
        with p.open("rb") as f:
            doc = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise HardwareError(f"{where} is not valid TOML ({e}); fix the syntax there.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise HardwareError(f"{where} cannot be read ({e}); pass a readable UTF-8 TOML file.") from None

    if "hardware" not in doc:
        raise HardwareError(f"{where} has no [hardware] table; put the fields under a [hardware] header.")
    extra = sorted(k for k in doc if k not in ("hardware", "collectives"))
    if extra:
        raise HardwareError(
            f"{where} has the unknown top-level key {extra[0]!r}; put every field under the single [hardware] table "
            "(and calibrated collectives in [[collectives]] tables)."
        )
    table = doc["hardware"]
    if not isinstance(table, dict):
        raise HardwareError(f"{where}: hardware must be a table; write [hardware] on its own line and the fields below it.")

    _refuse_retired(table, where, "plan calibrate")
    allowed = set(_FIELD_KINDS) | {"base"}
    for key in table:
        if key == "sources":
            raise HardwareError(
                f"{where}: sources cannot be set in a cluster file; remove it (each field given here is "
                "attributed to this file automatically)."
            )
        if key not in allowed:
            raise HardwareError(
                f"{where}: unknown field {key!r} in [hardware]{_did_you_mean(key, allowed)}; use base or one "
                f"of {', '.join(_FIELD_KINDS)}."
            )

    try:
        given = {key: _parse(value, _FIELD_KINDS[key], key) for key, value in table.items() if key != "base"}
    except HardwareError as e:
        raise HardwareError(f"{where}: {e}") from None

    base_name = table.get("base")
    if base_name is not None:
        if not isinstance(base_name, str) or base_name not in PRESETS:
            raise HardwareError(
                f"{where}: base = {base_name!r} is not a preset{_did_you_mean(str(base_name), PRESETS)}; use one of "
                f"{', '.join(PRESETS)}."
            )
        base = PRESETS[base_name]
        values = {k: getattr(base, k) for k in _FIELD_KINDS}
        values["collectives"] = base.collectives
        sources = {k: f"preset {base_name}: {base.sources.get(k, 'no source recorded')}" for k in _FIELD_KINDS}
        if "name" not in given:
            given["name"] = f"{base_name}:{p.stem}"
    else:
        if "name" not in table:
            raise HardwareError(f"{where}: [hardware] has no name; give name = \"...\" or base = \"<preset>\".")
        missing = [k for k in _FIELD_KINDS if k not in given and k not in _OPTIONAL_DEFAULTS]
        if missing:
            raise HardwareError(
                f"{where}: [hardware] lacks {', '.join(missing)}; give every field or set base = \"<preset>\" "
                f"(one of {', '.join(PRESETS)}) to start from a preset."
            )
        values = dict(_OPTIONAL_DEFAULTS)
        sources = {k: f"{where}: not given, so the default {v!r} (the datasheet's peak; collectives hidden)"
                   for k, v in _OPTIONAL_DEFAULTS.items()}

    if "collectives" in doc:
        values["collectives"] = _collectives_from(doc["collectives"], where)
    for key, value in given.items():
        values[key] = value
        sources[key] = f"{where} ([hardware] {key} = {table[key]!r})" if key in table else f"{where} (named after base)"
    try:
        return Hardware(**values, sources=sources)
    except HardwareError as e:
        raise HardwareError(f"{where}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Roofline
# ---------------------------------------------------------------------------------------------

def roofline_seconds(hw: Hardware, flops: float, io_bytes: float, precision: str) -> float:
    """Time of work moving `io_bytes` through HBM and doing `flops` at `precision`, as the sum of
    the two (no overlap assumed): flops / hw.flops(precision) + io_bytes / hw.hbm_bandwidth."""
    for what, value in (("flops", flops), ("io_bytes", io_bytes)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise HardwareError(f"roofline_seconds: {what} = {value!r} must be a non-negative finite number; pass a count.")
    return flops / hw.flops(precision) + io_bytes / hw.hbm_bandwidth
