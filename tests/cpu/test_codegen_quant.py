"""FP8 (per row, per 1x128 group) and NVFP4 producers: the Triton kernels in the interpreter are
bitwise equal to the torch reference quantizers, the e4m3/e2m1 roundings are nearest-even
(ties, subnormals, saturation), the scale layouts are the ones the GEMMs read, the custom ops'
fake implementations agree with their real ones, and bad input is refused with a reason."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kopt.codegen.kernels.nvfp4 import (
    E2M1_VALUES,
    dequant_nvfp4,
    e2m1_code,
    e2m1_codes,
    nvfp4_global_scale,
    quant_nvfp4,
    quant_nvfp4_reference,
    quant_nvfp4_triton,
    scale_numel,
    swizzle_128x4,
    unswizzle_128x4,
)
from kopt.codegen.kernels.quant_fp8 import (
    E4M3,
    E4M3_MAX,
    quant_fp8_group,
    quant_fp8_group_reference,
    quant_fp8_group_triton,
    quant_fp8_rowwise_reference,
    quant_fp8_rowwise_triton,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

SHAPES = [(1, 16), (7, 129), (3, 5, 300), (2, 4000), (3, 3072)]  # 3072: two tiles
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _data(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    # values spanning six decades per row, so that small ones land in e4m3's subnormals
    return (torch.randn(shape) * torch.logspace(-3, 3, shape[-1])).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_rowwise_kernel_is_the_reference(shape: tuple, dtype: torch.dtype) -> None:
    x = _data(shape, dtype)
    q, s = quant_fp8_rowwise_triton(x)
    qr, sr = quant_fp8_rowwise_reference(x)
    assert q.dtype == E4M3 and q.shape == x.shape and s.shape == (*shape[:-1], 1)
    assert torch.equal(_bits(q), _bits(qr)) and torch.equal(s, sr)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_group_kernel_is_the_reference(shape: tuple, dtype: torch.dtype) -> None:
    x = _data(shape, dtype)
    q, s = quant_fp8_group_triton(x)
    qr, sr = quant_fp8_group_reference(x)
    rows, groups = x.numel() // shape[-1], -(-shape[-1] // 128)
    # the layout torch._scaled_mm's BlockWise1x128 takes for its left operand: outer-dim-major
    assert s.shape == (rows, groups) and s.stride() == (1, rows)
    assert sr.shape == s.shape and sr.stride() == s.stride()
    assert torch.equal(_bits(q), _bits(qr)) and torch.equal(s, sr)


def test_rows_split_into_two_power_of_two_tiles_where_that_pads_fewer_lanes() -> None:
    from kopt.codegen.kernels.quant_fp8 import row_split

    assert row_split(3072) == (2048, 1024) and row_split(6144) == (4096, 2048)
    assert row_split(12288) == (8192, 4096) and row_split(2100) == (2048, 64)
    assert row_split(4096) == (4096, 0) and row_split(100) == (128, 0)  # 64 + 64 pads as many
    assert row_split(300, 128) == (256, 128) and row_split(200, 128) == (256, 0)
    assert row_split(3072, 4096) == (4096, 0)  # the minimum tile holds the row


def test_even_tiles_are_launches_that_cover_their_rows_exactly() -> None:
    """The kernels drop their masks (``EVEN``) only where every program's rows and every tile's
    columns are in range; SHAPES above run both kinds ((3, 3072) as 2048 + 1024, (2, 4000))."""
    from kopt.codegen.kernels.quant_fp8 import even_tiles

    assert even_tiles(4224, 1, 3072, 2048, 1024) and even_tiles(128, 4, 4096, 4096, 0)
    assert not even_tiles(4224, 1, 3000, 2048, 1024)  # the second tile is partly masked
    assert not even_tiles(6, 4, 384, 256, 128)  # the second program's last two rows
    assert not even_tiles(2, 1, 4000, 4096, 0)


def test_fp8_group_scales_are_per_128_columns() -> None:
    x = torch.ones(3, 300)
    x[1, 130] = 448.0 * 5  # only group 1 of row 1 sees it
    x[2, 299] = -7.0  # the partial last group
    q, s = quant_fp8_group_triton(x)
    want = torch.full((3, 3), 1 / 448)
    want[1, 1], want[2, 2] = 5.0, 7 / 448
    assert torch.allclose(s, want, rtol=1e-6)
    back = q.float().reshape(3, 300) * s.repeat_interleave(128, dim=1)[:, :300]
    assert torch.allclose(back, x, rtol=2.0**-4)


def test_e4m3_rounding_is_nearest_even_with_subnormals() -> None:
    # a row whose amax is 448 has scale 1, so q is x cast to e4m3 by the kernel's own rounding
    grid = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    grid = grid[torch.isfinite(grid) & (grid.abs() <= E4M3_MAX)].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties: nearest even decides
    near = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    rand = torch.randn(4000) * torch.logspace(-4, 2.6, 4000)
    values = torch.cat([grid, mids, near, rand.clamp(-448, 448), torch.tensor([-0.0, 2.0**-12])])
    values = values[values.abs() <= E4M3_MAX]
    x = torch.cat([torch.tensor([448.0]), values]).reshape(1, -1)
    q, s = quant_fp8_rowwise_triton(x)
    assert s.item() == 1.0
    assert torch.equal(_bits(q), _bits(x.to(E4M3)))


def test_fp8_ops_fake_and_real_agree() -> None:
    torch.library.opcheck(quant_fp8_group, (_data((3, 5, 200), torch.bfloat16),))


@pytest.mark.parametrize("shape", [(1, 16), (7, 144), (3, 5, 320), (130, 64), (2, 3072)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_kernel_is_the_reference(shape: tuple, dtype: torch.dtype) -> None:
    x = _data(shape, dtype)
    g = nvfp4_global_scale(x)
    q, s = quant_nvfp4_triton(x, g)
    qr, sr = quant_nvfp4_reference(x, g)
    rows = x.numel() // shape[-1]
    assert q.dtype == torch.uint8 and q.shape == (*shape[:-1], shape[-1] // 2)
    assert s.dtype == E4M3 and s.shape == (scale_numel(rows, shape[-1]),)
    assert torch.equal(q, qr) and torch.equal(_bits(s), _bits(sr))


def test_nvfp4_values_round_to_nearest_even() -> None:
    # global scale 1 and a block amax of 6: the block scale is exactly 1 and q is e2m1(x)
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
                       -0.25, -5.5, 0.1, -2.9, 0.0, -0.0, 5.9, -1.5]])
    want = torch.tensor([[6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0,
                          -0.0, -6.0, 0.0, -3.0, 0.0, -0.0, 6.0, -1.5]])
    g = torch.tensor([1.0])
    q, s = quant_nvfp4_triton(x, g)
    back = dequant_nvfp4(q, s, g)
    assert torch.equal(back, want) and torch.equal(torch.signbit(back), torch.signbit(want))
    # a global scale too small for the block: the e4m3 scale clamps to 448, values to +-6
    q, s = quant_nvfp4_triton(torch.full((1, 16), 1e4), g)
    assert torch.equal(dequant_nvfp4(q, s, g), torch.full((1, 16), 6.0 * 448))


@triton.jit
def _e2m1_kernel(v_ptr, c_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(c_ptr + i, e2m1_code(tl.load(v_ptr + i)))


def e2m1_probe_values(device: str = "cpu") -> torch.Tensor:
    """Every E2M1 value and threshold with its fp32 neighbours on both sides, both signs, and
    zeros, denormals, values past 6, infinities and NaN: 4096 values."""
    marks = torch.tensor(list(E2M1_VALUES) + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0])
    near = torch.cat([torch.nextafter(marks, torch.tensor(-1.0)), marks,
                      torch.nextafter(marks, torch.tensor(100.0))])
    special = torch.tensor([0.0, 1e-45, 1e-40, 2.0**-126, 1e-20, 3e38, float("inf"),
                            float("nan")])
    v = torch.cat([near, special, torch.rand(1800) * 8, torch.randn(100) * 1e-3])
    v = torch.cat([v, -v])
    return torch.cat([v, torch.zeros(4096 - v.numel())]).to(device)


def test_e2m1_code_by_arithmetic_is_the_thresholds() -> None:
    """The kernels' E2M1 coding (rounding on fp32's own grid, no comparisons) against the
    reference's seven thresholds, bit for bit: ties to even, saturation, signs, NaN."""
    v = e2m1_probe_values()
    got = torch.empty(v.numel(), dtype=torch.int32)
    _e2m1_kernel[(1,)](v, got, N=v.numel())
    assert torch.equal(got, e2m1_codes(v).int())


def test_nvfp4_dequantizes_within_the_format_error() -> None:
    x = torch.randn(200, 64)
    g = nvfp4_global_scale(x)
    q, s = quant_nvfp4_triton(x, g)
    back = dequant_nvfp4(q, s, g)
    blocks = (back - x).reshape(200, 4, 16).abs().amax(-1)
    amax = x.reshape(200, 4, 16).abs().amax(-1)
    # half an E2M1 step at the top of the range (1 of 6), plus e4m3's scale rounding (2^-4)
    assert (blocks <= amax * (0.5 / 6 * 4 + 2.0**-4)).all()
    assert torch.unique(torch.stack([q & 15, q >> 4])).numel() == 16  # every code is used


def test_swizzled_scale_layout() -> None:
    m, n = 200, 7  # two row tiles (the second half full), two column tiles (one padded)
    s = torch.arange(m * n, dtype=torch.int32).reshape(m, n)
    flat = swizzle_128x4(s)
    assert flat.numel() == 256 * 8
    col_tiles = 2
    for r, c in [(0, 0), (1, 0), (31, 3), (32, 0), (127, 3), (128, 4), (199, 6), (70, 5)]:
        off = ((r // 128) * col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 \
            + c % 4
        assert flat[off] == s[r, c]
    assert torch.equal(unswizzle_128x4(flat, m, n), s)
    assert int((flat != 0).sum()) == m * n - 1  # padding is zero (and s[0, 0] is 0)


def test_nvfp4_kernel_scales_unswizzle_to_block_amax() -> None:
    x = torch.randn(130, 48)
    g = torch.tensor([0.01])
    _, s = quant_nvfp4_triton(x, g)
    blocks = unswizzle_128x4(s.view(torch.uint8), 130, 3).view(E4M3).float()
    want = (x.reshape(130, 3, 16).abs().amax(-1) / (0.01 * 6)).clamp(max=448).to(E4M3).float()
    assert torch.equal(blocks, want)
    padded = s.view(torch.uint8).reshape(-1)
    assert int((padded != 0).sum()) == int((blocks != 0).sum())


def test_nvfp4_op_fake_and_real_agree() -> None:
    x = _data((3, 5, 64), torch.bfloat16)
    torch.library.opcheck(quant_nvfp4, (x, nvfp4_global_scale(x)))


def test_e2m1_table_matches_the_format() -> None:
    assert E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 8)
    # one block of the 16 codes at block scale 1 (bits 0x38) and global scale 1
    scales = swizzle_128x4(torch.tensor([[0x38]], dtype=torch.uint8)).view(E4M3)
    got = dequant_nvfp4(packed, scales, torch.tensor([1.0]))
    want = torch.tensor([*E2M1_VALUES, *[-v for v in E2M1_VALUES]])
    assert torch.equal(got.reshape(-1), want)


def test_bad_input_is_refused() -> None:
    g = torch.tensor([1.0])
    with pytest.raises(ValueError, match="multiple of 16"):
        quant_nvfp4_triton(torch.randn(4, 40), g)
    with pytest.raises(ValueError, match="one fp32 value"):
        quant_nvfp4_reference(torch.randn(4, 32), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="one fp32 value"):
        quant_nvfp4_triton(torch.randn(4, 32), torch.tensor([1.0], dtype=torch.float64))


def test_unsupported_dtypes_fall_back_to_the_reference() -> None:
    x = torch.randn(3, 40, dtype=torch.float64)
    q, s = quant_fp8_rowwise_triton(x)
    qr, sr = quant_fp8_rowwise_reference(x)
    assert torch.equal(_bits(q), _bits(qr)) and torch.equal(s, sr)


def test_rowwise_reference_writes_row_major_like_its_fake() -> None:
    """A transposed input (a view the graph's meta may call contiguous after a reshape) still
    gives row-major e4m3 values: the GEMM after the quantizer reads them as [M, K]."""
    x = torch.randn(16, 48, dtype=torch.bfloat16).t()
    q, scale = quant_fp8_rowwise_reference(x)
    assert q.is_contiguous() and q.shape == (48, 16)
    q2, scale2 = quant_fp8_rowwise_reference(x.contiguous())
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, scale2)
