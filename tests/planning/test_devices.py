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
