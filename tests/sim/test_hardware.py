import dataclasses

import pytest

from pivotrl.sim.hardware import GPU, GPUS


def test_every_gpu_is_registered_under_its_name():
    assert set(GPUS) == {"H100", "H800", "H200", "A100"}
    assert all(gpu.name == key for key, gpu in GPUS.items())


def test_peaks_are_dense_bf16():
    # datasheets quote 1,979 (Hopper) and 624 (A100) TFLOPS with 2:4 sparsity; dense is half
    assert GPUS["H100"].peak_flops == GPUS["H800"].peak_flops == GPUS["H200"].peak_flops == 989e12
    assert GPUS["A100"].peak_flops == 312e12


def test_the_variants_differ_where_their_datasheets_do():
    h100, h800, h200, a100 = (GPUS[k] for k in ("H100", "H800", "H200", "A100"))
    assert h800.nvlink_bw < h100.nvlink_bw  # export-limited NVLink, same HBM
    assert h800.hbm_bw == h100.hbm_bw and h800.hbm_bytes == h100.hbm_bytes
    assert h200.hbm_bytes > 1.7 * h100.hbm_bytes and h200.hbm_bw > 1.4 * h100.hbm_bw
    assert a100.h2d_bw == h100.h2d_bw / 2  # PCIe Gen4 against Gen5
    assert 80e9 < h100.hbm_bytes < 90e9  # "80 GB" as the driver reports it


def test_collectives_leave_the_node_over_the_network():
    h100 = GPUS["H100"]
    assert h100.link_bw(2) == h100.link_bw(8) == h100.nvlink_bw
    assert h100.link_bw(9) == h100.link_bw(64) == h100.network_bw < h100.nvlink_bw


@pytest.mark.parametrize("field", ["peak_flops", "hbm_bw", "gpus_per_node"])
def test_a_bad_number_names_its_field(field):
    with pytest.raises(ValueError, match=f"{field} got 0"):
        dataclasses.replace(GPUS["H100"], **{field: 0})
    with pytest.raises(ValueError, match=field):
        GPU(**{**dataclasses.asdict(GPUS["H100"]), field: float("inf")})
