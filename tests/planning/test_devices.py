"""planning/devices.py: the known accelerators and the one rule for the compute rate every surface prices by."""
from megatron_pipemesh.planning.devices import find_device, rate_for


def _never():
    raise AssertionError("measured although a peak was known")


def test_a_given_peak_wins_over_the_device_and_runs_at_the_mfu():
    rate = rate_for(100.0, "--device-tflops", find_device("A10G"), 0.45, _never)
    assert (rate.tflops, rate.mfu, rate.given) == (100.0, 0.45, True)
    assert rate.source == "100 TFLOP/s peak (--device-tflops) at MFU 0.45"


def test_a_known_device_gives_its_table_peak_named_by_the_flag_that_chose_it():
    a10g = find_device("A10G")
    rate = rate_for(None, "--device-tflops", a10g, 0.45, _never, device_flag="--gpu")
    assert rate.tflops == a10g.peak_tflops and rate.source == f"{a10g.peak_tflops:g} TFLOP/s peak (--gpu A10G) at MFU 0.45"


def test_without_a_peak_the_measured_rate_is_an_achieved_one_and_none_without_a_measure():
    rate = rate_for(None, "--device-tflops", None, 0.45, lambda: 0.04)
    assert (rate.tflops, rate.mfu, rate.given) == (0.04, 1.0, False)
    assert rate.source == "a measured CPU matmul rate of 40.0 GFLOP/s"
    assert rate_for(None, "--device-tflops", None, 0.45, lambda: 0.04, measured_mfu=0.8).mfu == 0.8
    assert rate_for(None, "--device-tflops", None, 0.45, None) is None


def test_names_match_whole_words_and_form_factors():
    from megatron_pipemesh.planning.devices import find_device

    assert find_device("L40").name == "L40" and find_device("L40").memory_gb == 48
    assert find_device("L40S").name == "L40S" and find_device("L4").name == "L4"
    assert find_device("GH200").name.startswith("GH200")  # not the H200
    assert find_device("H100").name == "H100 SXM" and find_device("H100").intra_node_gbps == 3600
    pcie = find_device("H100 PCIe")
    assert pcie.name == "H100 PCIe" and pcie.peak_tflops < 989 and pcie.intra_node_gbps == 512
    assert find_device("NVIDIA H100 80GB HBM3").name == "H100 SXM"  # torch's name of the SXM board
    assert find_device("NVIDIA A100-PCIE-40GB").name == "A100 PCIe 40GB"
    assert find_device("A100-40GB").memory_gb == 40 and find_device("A10").name == "A10"
    assert find_device("B200") is None
    assert find_device("A100").fp8_tflops is None and find_device("H100").fp8_tflops == 1979


def test_a_family_name_says_which_form_it_took_and_an_ambiguous_name_is_refused():
    import pytest

    from megatron_pipemesh.planning.devices import DeviceError, chosen_form, find_device

    said = chosen_form("H100", find_device("H100"))
    assert said.startswith("--gpu H100 is the H100 SXM") and '"H100 PCIe"' in said
    assert chosen_form("H100 PCIe", find_device("H100 PCIe")) is None
    assert chosen_form("H100 SXM", find_device("H100 SXM")) is None
    with pytest.raises(DeviceError, match="ambiguous: it names H100 PCIe and H100 NVL"):
        find_device("H100 PCIe NVL")
