"""Known accelerators: peak dense 16-bit and FP8 TFLOP/s, memory and the link between the GPUs of a server, by form
factor (``pipemesh plan --gpu``, and the local GPU's name when ``--pipemesh-device-tflops`` is not given).

Figures are the vendors' data-sheet numbers: dense (no sparsity) BF16/FP16 and FP8 tensor-core TFLOP/s, the nominal
memory (planned as GiB, as ``--device-memory-gb`` is), and the per-GPU, per-direction bandwidth to the other GPUs of
the server: NVLink where the form factor has it (an SXM board: every GPU of the server on NVSwitch), else the card's
PCIe link (Gen3 x16 128, Gen4 x16 256, Gen5 x16 512 Gbit/s). A PCIe card's NVLink bridge joins pairs only, so the
server's other GPUs are reached over PCIe.

A name matches a model when every word of the model's ``words`` is a whole word of the name (case, '-', '_' and
spaces ignored: ``L40`` is not ``L40S`` or ``L4``, ``GH200`` is not ``H200``); of the models that match, the one with
the most words wins (``H100 PCIe`` over ``H100``), so a family name alone means the family's first model in the table,
its SXM/NVLink board with the most memory, and :func:`find_device` says which others share the family. Two models that
match with as many words are ambiguous: refused with the choices.

Pure: no torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, FrozenSet, Optional, Tuple

NVLINK4, NVLINK3, NVLINK2 = 3600.0, 2400.0, 1200.0
"""Per-GPU NVLink bandwidth per direction, Gbit/s (450, 300, 150 GB/s: H100/H200, A100, V100 SXM boards)."""
PCIE5, PCIE4, PCIE3 = 512.0, 256.0, 128.0
"""A x16 PCIe link per direction, Gbit/s (Gen5, Gen4, Gen3)."""


@dataclass(frozen=True)
class Device:
    """One accelerator model in one form factor."""

    name: str
    """What the table calls it (and how ``--gpu`` may name it)."""
    words: Tuple[str, ...]
    """The whole words (upper case) that identify it in a name; the first is its family."""
    peak_tflops: float
    """Dense 16-bit peak TFLOP/s."""
    memory_gb: float
    """Device memory (nominal GB, planned as GiB)."""
    intra_node_gbps: float
    """Bandwidth to the other GPUs of a server, per GPU and direction (Gbit/s)."""
    interconnect: str
    """What that link is (said where the plan assumes it)."""
    fp8_tflops: Optional[float] = None
    """Dense FP8 peak TFLOP/s; None: no FP8 tensor cores (Transformer Engine refuses FP8 there)."""
    fp8_recipes: Tuple[str, ...] = ("delayed", "tensorwise", "blockwise")
    """The ``--fp8-recipe`` values it runs (``mxfp8`` needs Blackwell's tensor cores)."""


def _table() -> Tuple[Device, ...]:
    sxm5, pcie5, pcie4, pcie3 = "NVLink 4 (SXM)", "PCIe Gen5 x16", "PCIe Gen4 x16", "PCIe Gen3 x16"
    return (
        Device("H200 SXM", ("H200",), 989.0, 141.0, NVLINK4, sxm5, 1979.0),
        Device("H200 NVL", ("H200", "NVL"), 835.0, 141.0, PCIE5, pcie5, 1670.0),
        Device("GH200 96GB", ("GH200",), 989.0, 96.0, NVLINK4, "NVLink 4", 1979.0),
        Device("GH200 144GB", ("GH200", "144GB"), 989.0, 144.0, NVLINK4, "NVLink 4", 1979.0),
        Device("H100 SXM", ("H100",), 989.0, 80.0, NVLINK4, sxm5, 1979.0),
        Device("H100 PCIe", ("H100", "PCIE"), 756.0, 80.0, PCIE5, pcie5, 1513.0),
        Device("H100 NVL", ("H100", "NVL"), 835.0, 94.0, PCIE5, pcie5, 1671.0),
        Device("A100 SXM 80GB", ("A100",), 312.0, 80.0, NVLINK3, "NVLink 3 (SXM)"),
        Device("A100 SXM 40GB", ("A100", "40GB"), 312.0, 40.0, NVLINK3, "NVLink 3 (SXM)"),
        Device("A100 PCIe 80GB", ("A100", "PCIE"), 312.0, 80.0, PCIE4, pcie4),
        Device("A100 PCIe 40GB", ("A100", "PCIE", "40GB"), 312.0, 40.0, PCIE4, pcie4),
        Device("L40S", ("L40S",), 362.0, 48.0, PCIE4, pcie4, 733.0),
        Device("L40", ("L40",), 181.0, 48.0, PCIE4, pcie4, 362.0),
        Device("L4", ("L4",), 121.0, 24.0, PCIE4, pcie4, 242.0),
        Device("A10G", ("A10G",), 125.0, 24.0, PCIE4, pcie4),
        Device("A10", ("A10",), 125.0, 24.0, PCIE4, pcie4),
        Device("V100 SXM2 32GB", ("V100",), 125.0, 32.0, NVLINK2, "NVLink 2 (SXM2)"),
        Device("V100 SXM2 16GB", ("V100", "16GB"), 125.0, 16.0, NVLINK2, "NVLink 2 (SXM2)"),
        Device("V100 PCIe 32GB", ("V100", "PCIE"), 112.0, 32.0, PCIE3, pcie3),
        Device("V100 PCIe 16GB", ("V100", "PCIE", "16GB"), 112.0, 16.0, PCIE3, pcie3),
        Device("RTX A6000", ("A6000",), 155.0, 48.0, PCIE4, pcie4),
        Device("RTX 4090", ("4090",), 165.0, 24.0, PCIE4, pcie4, 330.0),
    )


DEVICES: Tuple[Device, ...] = _table()
"""Known models; a family's first entry is what its name alone means."""


class DeviceError(ValueError):
    """A GPU name that matches no model, or several alike; the message names the choices."""


def _words(name: str) -> FrozenSet[str]:
    """The whole words of a name, upper case ('A100-SXM4-80GB' -> A100, SXM4, 80GB; 'H100 PCIe' -> H100, PCIE)."""
    return frozenset(word for word in re.split(r"[^0-9A-Z]+", name.upper()) if word)


def find_device(name: str) -> Optional[Device]:
    """The model ``name`` means (module docstring); None where none matches; DeviceError where two match alike."""
    words = _words(name)
    matching = [device for device in DEVICES if set(device.words) <= words]
    if not matching:
        return None
    most = max(len(device.words) for device in matching)
    best = [device for device in matching if len(device.words) == most]
    if len(best) > 1:
        raise DeviceError(f"--gpu {name!r} is ambiguous: it names {' and '.join(d.name for d in best)}; give one of "
                          f"them, e.g. --gpu '{best[0].name}'")
    return best[0]


def family(device: Device) -> Tuple[Device, ...]:
    """The other models of ``device``'s family (the same first word)."""
    return tuple(other for other in DEVICES if other.words[0] == device.words[0] and other is not device)


def chosen_form(name: str, device: Device) -> Optional[str]:
    """Where ``name`` (as the user gave it, matched to ``device``) names only a family: which model the plan took
    and how to name the others ('--gpu H100 is the H100 SXM (NVLink 4 (SXM), 80 GB); --gpu "H100 PCIe" or "H100 NVL"
    for the others'); None where it names the model fully."""
    others = family(device)
    if len(device.words) > 1 or not others or _words(device.name) <= _words(name):
        return None  # the most specific match carried a word beyond the family's: the name chose the form
    choices = " or ".join(f'"{other.name}"' for other in others)
    return (f"--gpu {name} is the {device.name} ({device.interconnect}, {device.memory_gb:g} GB); --gpu {choices} "
            "for the others")


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
    fp8_tflops: Optional[float] = None
    """Dense FP8 peak TFLOP/s (given, or the device's), at the same ``mfu``; None: unknown or no FP8."""


def rate_for(tflops: Optional[float], flag: str, device: Optional[Device], mfu: float,
             measure: Optional[Callable[[], float]], measured_mfu: float = 1.0,
             device_flag: str = "", fp8_tflops: Optional[float] = None) -> Optional[DeviceRate]:
    """The one rule every surface prices compute by: a given peak (``tflops``, from ``flag``), else the known
    ``device``'s peak (named by ``device_flag`` when the user chose it), both at ``mfu``; else the rate ``measure``
    returns (TFLOP/s this machine reaches, an achieved rate: ``measured_mfu``, 1 unless the user gave one); None
    where there is nothing to measure with. ``fp8_tflops`` (given) wins over the device's FP8 peak."""
    if tflops or device is not None:
        peak, where = (tflops, flag) if tflops else (device.peak_tflops, f"{device_flag} {device.name}".strip())
        fp8 = fp8_tflops or (device.fp8_tflops if device is not None and not tflops else None)
        return DeviceRate(peak, mfu, f"{peak:g} TFLOP/s peak ({where}) at MFU {mfu:g}", fp8_tflops=fp8)
    if measure is None:
        return None
    rate = measure()
    return DeviceRate(rate, measured_mfu, f"a measured CPU matmul rate of {rate * 1e3:.1f} GFLOP/s", given=False)
