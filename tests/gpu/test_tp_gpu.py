"""The fused all-reduce + residual + norm op on 2 GPUs (NCCL + symmetric memory).

Spawns 2 ranks (one GPU each, NCCL, file:// rendezvous). Checks that the CUDA path really runs
PyTorch's symmetric-memory all-reduce (not the generic fallback), that its sum is bitwise NCCL's
(two ranks: one IEEE add either way), that the fused op is within tier of the unfused ops in
bf16 at FLUX.2's row width, and that kopt.optimize fuses every TP block of the reference DiT on
CUDA and verifies. NVLink multicast is not touched: NCCL_NVLS_ENABLE and friends stay as the
machine sets them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason="needs 2 GPUs (tensor-parallel collectives)")


def _worker(rank: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    try:
        torch.save(_checks(rank), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _checks(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    import kopt
    from kopt.codegen.kernels.allreduce_norm import (
        allreduce_residual_norm,
        symm_mem_all_reduce,
        symm_mem_available,
    )
    from kopt.codegen.rowwise import RowwiseSpec, rowwise_reference
    from kopt.models.tp import TINY_DIT, build_shard
    from kopt.verify import relative_error

    group = dist.group.WORLD.group_name
    dev = torch.device("cuda", rank)
    rec: dict[str, Any] = {"symm_mem": symm_mem_available(group)}
    gen = torch.Generator(dev).manual_seed(100 + rank)
    shared = torch.Generator(dev).manual_seed(7)
    rows, cols = 2 * 333, 6144  # FLUX.2's width, rows not a multiple of any tile
    bf16 = torch.bfloat16
    y = torch.randn(rows, cols, generator=gen, device=dev).to(bf16)
    x = torch.randn(rows, cols, generator=shared, device=dev).to(bf16)
    nccl = y.clone()
    dist.all_reduce(nccl)
    for algorithm in ("one_shot", "two_shot"):
        rec[algorithm] = torch.equal(symm_mem_all_reduce(y, group, algorithm), nccl)
    # norm "none": x + all_reduce(y) only, exact: the fused op's sum is bitwise NCCL's
    plain = RowwiseSpec(dtype="bfloat16", residual=True, outputs=("out",))
    rec["sum_exact"] = torch.equal(allreduce_residual_norm(plain, group, x=x, y=y)["out"],
                                   x + nccl)
    # residual + RMSNorm + FP8 per token: within tier of the unfused ops, against fp64
    w = (1 + 0.1 * torch.randn(cols, generator=shared, device=dev)).to(bf16)
    spec = RowwiseSpec(dtype="bfloat16", norm="rms", eps=1e-6, weight=True, residual=True,
                       outputs=("out", "residual", "fp8_row"))
    got = allreduce_residual_norm(spec, group, x=x, y=y, weight=w)
    want = rowwise_reference(spec, {"x": x, "y": nccl, "weight": w})
    h64 = x.double() + nccl.double()
    n64 = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    rec["residual_exact"] = torch.equal(got["residual"], want["residual"])
    rec["err_fused"] = relative_error(got["out"], n64)
    rec["err_unfused"] = relative_error(want["out"], n64)
    scale_err = (got["fp8_row_scale"] - want["fp8_row_scale"]).abs().max().item()
    rec["fp8_scale_rel"] = scale_err / want["fp8_row_scale"].abs().max().item()

    local, _ = build_shard(TINY_DIT, rank, 2, group, device=dev, dtype=bf16)
    opt = kopt.optimize(local.model, local.args, local.kwargs)
    rec["verified"] = opt.report.verified
    rec["fused_sites"] = opt.report.result("fuse_allreduce_norm").matched
    rec["out"] = local.run(opt).cpu()
    rec["err_vs_eager"] = relative_error(local.run(opt), local.run())
    return rec


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("tp_gpu")
    mp.spawn(_worker, (f"file://{tmp / 'pg'}", str(tmp)), nprocs=2)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_symmetric_memory_path_is_taken_and_sums_like_nccl(ranks: list[dict[str, Any]]) -> None:
    for rec in ranks:
        assert rec["symm_mem"], "symmetric memory unavailable: the fused op fell back to NCCL"
        assert rec["one_shot"] and rec["two_shot"]
        assert rec["sum_exact"]


def test_fused_norm_within_tier(ranks: list[dict[str, Any]]) -> None:
    from kopt.verify import RTOL_FLOOR

    for rec in ranks:
        assert rec["residual_exact"]
        assert rec["err_fused"] <= 2 * max(rec["err_unfused"], RTOL_FLOOR[torch.bfloat16])
        assert rec["fp8_scale_rel"] <= 2 ** -7  # one bf16 ulp of the row maximum


def test_optimize_fuses_every_tp_block_on_cuda(ranks: list[dict[str, Any]]) -> None:
    from kopt.models.tp import TINY_DIT
    from kopt.verify import RTOL_FLOOR

    for rec in ranks:
        assert rec["verified"]
        assert rec["fused_sites"] == 2 * TINY_DIT.layers
        assert rec["err_vs_eager"] <= RTOL_FLOOR[torch.bfloat16]
    assert torch.equal(ranks[0]["out"], ranks[1]["out"])
