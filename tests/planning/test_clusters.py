"""Every ClusterSpec is built in planning/clusters.py, every planning default declared once."""
import re
from pathlib import Path

from megatron_pipemesh.planning.clusters import bench_network_cluster, flat_cluster, nic_cluster
from megatron_pipemesh.planning.defaults import DEFAULT_HOST_LINK_GBPS, MFU

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_pipemesh"


def _sources():
    return {path.relative_to(PACKAGE).as_posix(): path.read_text() for path in PACKAGE.rglob("*.py")}


def test_cluster_spec_is_constructed_in_one_module():
    """No module but planning/clusters.py calls ClusterSpec(...) (a surface that builds its own maps its words onto
    the cluster a second way)."""
    builders = {name for name, text in _sources().items() if re.search(r"\bClusterSpec\(", text)}
    assert builders == {"planning/clusters.py"}


def test_mfu_default_is_declared_once():
    """The MFU default's literal appears once, in planning/defaults.py."""
    found = [name for name, text in _sources().items() if re.search(r"(?<![\d.])0\.45(?!\d)", text)]
    assert found == ["planning/defaults.py"]


def test_builders_fill_the_defaults():
    """The builders take the shared defaults where a surface gives none."""
    flat = flat_cluster(tp=1, dp=2, device_tflops=100.0, dp_gbps=10.0, p2p_gbps=20.0)
    assert (flat.mfu, flat.host_link_gbps, flat.nic_gbps, flat.dp_gbps, flat.p2p_gbps) == (
        MFU, DEFAULT_HOST_LINK_GBPS, None, 10.0, 20.0)
    nic = nic_cluster(tp=2, dp=4, devices_per_node=8, nic_gbps=50.0, link_gbps=6.25, intra_node_gbps=100.0,
                      device_tflops=125.0, device_memory_gb=24.0, host_link_gbps=100.0, nic_via_host=True,
                      sequence_parallel=True)
    assert (nic.nic_gbps, nic.dp_gbps, nic.devices_per_node, nic.mfu) == (50.0, 6.25, 8, MFU)
    shared = bench_network_cluster(4, 1.0, False, "gloo")
    assert (shared.dp_gbps, shared.nic_gbps, shared.collectives) == (0.25, None, "gloo")
