"""What both study drivers (``pipemesh study``, ``pipemesh headroom``) price a setting with: the GPT shapes,
the device, host-link and intra-node figures, the memory margin, the target ratio, and a study row with the
model and cluster it stands for (:func:`row_specs`).

Its own module so that :mod:`.headroom` reuses the study's costs without importing :mod:`.study`, which
reports against :data:`TARGET`: neither driver imports the other.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Tuple

from ..planning.clusters import nic_cluster
from ..planning.costs import ClusterSpec, ModelSpec

TARGET = 1.15
"""The issue's target ratio to best stock."""

GPT = {
    "GPT-1.3B": ModelSpec(24, 2048, 16, 2048, 1),
    "GPT-2.7B": ModelSpec(32, 2560, 32, 2048, 1),
    "GPT-6.7B": ModelSpec(32, 4096, 32, 2048, 1),
    "GPT-13B": ModelSpec(40, 5120, 40, 2048, 1),
    "GPT-7B": ModelSpec(32, 4096, 32, 2048, 1),
    "GPT-30B": ModelSpec(48, 7168, 56, 2048, 1),
}
"""GPT-3 family shapes (layers, hidden, heads, sequence, micro-batch)."""

DEVICE_TFLOPS = {24: 125.0, 32: 125.0, 40: 312.0, 80: 312.0}
"""Dense bf16 TFLOP/s by device memory: 24 GB A10G/L4-class, 32 GB V100-class, 40/80 GB A100."""

HOST_LINK_GBPS = {24: 100.0, 32: 48.0, 40: 100.0, 80: 100.0}
"""Device-host copy bandwidth per device and direction (Gbit/s) by device memory: PCIe 4.0 x16 with
pinned memory moves ~25 GB/s (:data:`~..planning.costs.DEFAULT_HOST_LINK_GBPS`), PCIe 3.0 x16 (32 GB V100-class)
~12 GB/s; commodity 8-GPU servers put two GPUs behind each x16 switch uplink, and data-parallel replicas
run the same schedule, so both copy at once: half each (100 and 48 Gbit/s)."""

INTRA_NODE_GBPS = {"commodity": 100.0, "datacentre": 2400.0}
"""Per-GPU bandwidth of a data-parallel ring or pipeline link that stays inside one node, by regime (Gbit/s):
a commodity 8-GPU server's PCIe 4.0 switches without NVLink (NCCL reaches roughly 10-15 GB/s of bus
bandwidth), an A100 server's NVLink (300 GB/s per direction)."""


NIC_VIA_HOST = ("commodity",)
"""Regimes whose network traffic is staged through host memory over each GPU's PCIe link, shared with its
activation copies (commodity clouds and PCIe servers have no GPUDirect RDMA; the data-centre rows' InfiniBand does)."""


@dataclass(frozen=True)
class StudyRow:
    """One setting of the study."""

    regime: str
    """'commodity' or 'datacentre'."""
    model: str
    """Key of :data:`GPT`."""
    tp: int
    pp: int
    dp: int
    global_batch: int
    """Sequences per iteration (m = global_batch / dp at micro-batch 1)."""
    memory_gb: float
    """Device memory (GiB)."""
    gbps: float
    """Per-device bandwidth between nodes (data parallel and pipeline), Gbit/s."""
    sequence_parallel: bool = False
    grad_reduce_in_bf16: bool = False
    """--grad-reduce-in-bf16 on both sides."""
    layer_spec: str = "local"
    gpus_per_node: int = 8
    """GPUs behind one NIC: 8 (a server: data-parallel rings of TP x DP <= 8 GPUs and pipeline links
    between its stages stay inside it, at :data:`INTRA_NODE_GBPS`) or 1 (one GPU, or one TP group, per VM:
    every ring and pipeline link crosses the network and shares the VM's NIC)."""

    @property
    def microbatches(self) -> int:
        return self.global_batch // self.dp

    def describe(self) -> str:
        sp = "+SP" if self.sequence_parallel else ""
        return (f"{self.model} TP{self.tp}{sp} PP{self.pp} DP{self.dp} GB{self.global_batch} "
                f"{self.memory_gb:g}GB {self.gbps:g}Gb/s{' bf16-grad' if self.grad_reduce_in_bf16 else ''}"
                f"{' te' if self.layer_spec == 'te' else ''} {self.gpus_per_node}/node")


def row_node(row: StudyRow) -> int:
    """Devices of one node of ``row`` (behind one NIC): a TP group never spans VMs."""
    return max(row.gpus_per_node, row.tp)


def row_specs(row: StudyRow) -> Tuple[ModelSpec, ClusterSpec]:
    """The model and cluster ``row`` stands for (the assumptions of :mod:`.study`'s docstring)."""
    model = dataclasses.replace(GPT[row.model], layer_spec=row.layer_spec,
                                grad_bytes=2 if row.grad_reduce_in_bf16 else 4)
    node = row_node(row)
    cluster = nic_cluster(tp=row.tp, dp=row.dp, devices_per_node=node, nic_gbps=node * row.gbps, link_gbps=row.gbps,
                          intra_node_gbps=INTRA_NODE_GBPS[row.regime],
                          device_tflops=DEVICE_TFLOPS.get(int(row.memory_gb), 312.0), device_memory_gb=row.memory_gb,
                          host_link_gbps=HOST_LINK_GBPS.get(int(row.memory_gb), 100.0),
                          nic_via_host=row.regime in NIC_VIA_HOST, sequence_parallel=row.sequence_parallel)
    return model, cluster
