"""Known accelerators: peak dense 16-bit TFLOP/s and memory, found by their name (``pipemesh plan --gpu``, and the
local GPU's name when ``--pipemesh-device-tflops`` is not given).

Figures are the vendors' data-sheet numbers: dense (no sparsity) BF16/FP16 tensor-core TFLOP/s of the SXM or the
common board variant, and the nominal memory size (planned as GiB, as ``--device-memory-gb`` is).

Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple


@dataclass(frozen=True)
class Device:
    """One accelerator model."""

    name: str
    """What the table calls it (and how ``--gpu`` may name it)."""
    match: Tuple[str, ...]
    """Every one of these (upper case) appears in a device name of this model (``torch.cuda.get_device_name``)."""
    peak_tflops: float
    """Dense 16-bit peak TFLOP/s."""
    memory_gb: float
    """Device memory (nominal GB, planned as GiB)."""


DEVICES: Tuple[Device, ...] = (
    Device("H200", ("H200",), 989.0, 141.0),
    Device("H100", ("H100",), 989.0, 80.0),
    Device("A100-40GB", ("A100", "40GB"), 312.0, 40.0),
    Device("A100", ("A100",), 312.0, 80.0),
    Device("L40S", ("L40S",), 362.0, 48.0),
    Device("A10G", ("A10G",), 125.0, 24.0),
    Device("A10", ("A10",), 125.0, 24.0),
    Device("L4", ("L4",), 121.0, 24.0),
    Device("V100-16GB", ("V100", "16GB"), 125.0, 16.0),
    Device("V100", ("V100",), 125.0, 32.0),
    Device("A6000", ("A6000",), 155.0, 48.0),
    Device("RTX 4090", ("4090",), 165.0, 24.0),
)
"""Known models, more specific names first (A100-40GB before A100, A10G before A10, L40S before L4)."""


def find_device(name: str) -> Optional[Device]:
    """The first model of :data:`DEVICES` whose name parts all appear in ``name`` (case and separators ignored)."""
    text = name.upper().replace(" ", "").replace("_", "-")
    for device in DEVICES:
        if all(part.replace(" ", "") in text for part in device.match):
            return device
    return None


def known_names() -> str:
    """The table's names, for error messages."""
    return ", ".join(device.name for device in DEVICES)


@dataclass(frozen=True)
class DeviceRate:
    """The compute rate the analytic costs assume for one device, and where it came from (every surface's one
    name for it: training's ``--forward-groups auto``, ``pipemesh plan --megatron-args``)."""

    tflops: float
    """TFLOP/s of one device."""
    mfu: float
    """Fraction of it the layers reach (1 for a measured rate, which is already an achieved one)."""
    source: str = ""
    """Where the rate came from, said in the output ('' where a plan line need not say it)."""
    given: bool = True
    """Given by the user or known for the device (not measured here)."""
    rank_local: bool = False
    """Measured by this rank: the ranks agree on the slowest at the first call."""


def rate_for(tflops: Optional[float], flag: str, device: Optional[Device], mfu: float,
             measure: Optional[Callable[[], float]], measured_mfu: float = 1.0,
             device_flag: str = "") -> Optional[DeviceRate]:
    """The one rule every surface prices compute by: a given peak (``tflops``, from ``flag``), else the known
    ``device``'s peak (named by ``device_flag`` when the user chose it), both at ``mfu``; else the rate ``measure``
    returns (TFLOP/s this machine reaches, an achieved rate: ``measured_mfu``, 1 unless the user gave one); None
    where there is nothing to measure with."""
    if tflops or device is not None:
        peak, where = (tflops, flag) if tflops else (device.peak_tflops, f"{device_flag} {device.name}".strip())
        return DeviceRate(peak, mfu, f"{peak:g} TFLOP/s peak ({where}) at MFU {mfu:g}")
    if measure is None:
        return None
    rate = measure()
    return DeviceRate(rate, measured_mfu, f"a measured CPU matmul rate of {rate * 1e3:.1f} GFLOP/s", given=False)
