"""The benchmark's MPI baseline (bench/mpi_ranks.py, bench/mpi_exchange.py): a tiny sweep under
mpiexec has positive MPI columns, and MPICH's exchange computes what moe_comm computes (the
same received rows and the same combined tokens, compared by value), in normal and
low-latency mode. Skips, saying so, when mpi4py or MPICH's mpiexec is not installed
(pip install -e '.[mpi]')."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "bench")
BENCH = os.path.join(BENCH_DIR, "bench_all_to_all.py")
sys.path[:0] = [p for p in (ROOT, BENCH_DIR) if p not in sys.path]
import moe_comm  # noqa: E402
import mpi_ranks  # noqa: E402
from a2a_baseline import normal_exchange  # noqa: E402
from mpi_exchange import mpi_all_to_all_single  # noqa: E402


# loaded here, not taken from test_bench_cli: mpiexec ranks load this file by path, without
# tests/ on their module path
def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_all_to_all", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load_bench()
NO_MPI = mpi_ranks.unavailable()
pytestmark = pytest.mark.skipif(NO_MPI is not None, reason=f"no MPI baseline: {NO_MPI}")

# tiny: 2 ranks, 16 tokens of 256 channels, top-4 of 8 experts
CASE = dict(tokens=16, hidden=256, topk=4, experts=8)


def test_mpi_columns_in_a_tiny_sweep(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, BENCH, "--mode", "both", "--ranks", "2",
                        "--tokens", "16", "--hidden", "256", "--topk", "4", "--experts", "8",
                        "--iters", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == list(bench.COLUMNS + bench.MPI_COLUMNS)
    saved = json.loads(out.read_text())
    for row in saved["rows"]:
        for c in bench.MPI_COLUMNS:
            assert isinstance(row[c], float) and row[c] > 0, (c, row)
            spread = row["spread_us"][c]
            assert 0 < spread["min"] <= spread["median"] == row[c] <= spread["max"], spread
    for mode, what in (("normal", "MPICH Alltoallv"), ("ll", "MPICH's padded Alltoall")):
        summary = [ln for ln in lines if ln.startswith(f"summary {mode} ")]
        assert len(summary) == 1 and f"over {what}" in summary[0], r.stdout
    versions = saved["run"]["versions"]["mpi"]
    assert versions["library"].startswith("MPICH"), versions
    assert versions["mpi4py"] and versions["mpich"], versions
    assert "note: no MPI baseline" not in r.stderr


def _normal_rank(rank, n, dtype):
    """moe_comm's normal dispatch and combine and MPI's exchange of the same inputs."""
    case, = bench.build_cases(["normal"], [n], [CASE["tokens"]], [CASE["hidden"]],
                              [CASE["topk"]], [CASE["experts"]], [dtype])
    x, idx, w = bench._inputs(case, rank, torch.device("cpu"))
    buf = moe_comm.Buffer(None, case["nvl_bytes"], timeout_s=60)   # the bench's size
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(idx, case["experts"])
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte,
        topk_idx=idx, topk_weights=w)
    data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    y = data.float().bfloat16()            # what the bench combines
    ours_combined = buf.combine(y, handle)[0]
    buf.destroy()
    mpi_dispatch, mpi_combine = normal_exchange(x, idx, w, itr, ntr,
                                                mpi_all_to_all_single(mpi_ranks.world()))
    rows = mpi_dispatch()
    return dict(ours_rows=torch.cat([t.contiguous().view(torch.uint8) for t in (
                    *(recv_x if isinstance(recv_x, tuple) else (recv_x,)), recv_idx, recv_w)],
                                    1),
                mpi_rows=rows, ours_combined=ours_combined, mpi_combined=mpi_combine(y),
                local_experts=case["experts"] // n)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_mpi_normal_exchange_equals_moe_comm(dtype):
    n = 2
    results = mpi_ranks.Launcher()(_normal_rank, n, dtype, timeout=180)
    for rank, got in enumerate(results):
        ours, mpi = got["ours_rows"], got["mpi_rows"]
        assert ours.shape[0] == mpi.shape[0] > 0, (rank, ours.shape, mpi.shape)
        k = CASE["topk"]
        x_bytes = mpi.shape[1] - k * 8 - k * 4          # x (and fp8 scales), then idx, w
        # received tokens, in the same order: x (with its fp8 scales) byte for byte
        assert torch.equal(ours[:, :x_bytes], mpi[:, :x_bytes]), rank
        # top-k: moe_comm hands back this rank's experts as local ids, -1 elsewhere
        sent_idx = mpi[:, x_bytes:x_bytes + k * 8].contiguous().view(torch.int64)
        sent_w = mpi[:, x_bytes + k * 8:].contiguous().view(torch.float32)
        first = rank * got["local_experts"]
        mine = (sent_idx >= first) & (sent_idx < first + got["local_experts"])
        ours_idx = ours[:, x_bytes:x_bytes + k * 8].contiguous().view(torch.int64)
        ours_w = ours[:, x_bytes + k * 8:].contiguous().view(torch.float32)
        assert torch.equal(ours_idx, torch.where(mine, sent_idx - first, -1)), rank
        assert torch.equal(ours_w[mine], sent_w[mine]), rank
        # combine: each token's returned rows summed, the same on both sides
        torch.testing.assert_close(got["ours_combined"].float(), got["mpi_combined"].float(),
                                   rtol=1e-2, atol=1e-2)


def _ll_rank(rank, n):
    """moe_comm's low-latency dispatch and combine, and the MPI padded exchange, of the same
    inputs; combine's expert outputs are the received rows scaled by their expert, so both
    sides combine the same values whatever order their rows are in."""
    t, h, k, e = CASE["tokens"], CASE["hidden"], CASE["topk"], CASE["experts"]
    x, idx, w = bench.random_routed_inputs(t, h, e, k, seed=7 + rank)
    x = x.bfloat16()
    buf = moe_comm.Buffer(None, 1 << 20, moe_comm.Buffer.get_low_latency_rdma_size_hint(
        t, h, n, e), low_latency_mode=True, timeout_s=60)
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=True)
    ours_rows = torch.cat([recv_x[0].view(torch.uint8), recv_x[1].contiguous().view(
        torch.uint8)], -1)
    mpi_dispatch, mpi_combine = bench._ll_baseline(x, idx, w, e, t, True,
                                                   mpi_all_to_all_single(mpi_ranks.world()))
    mpi_rows, mpi_count = mpi_dispatch()

    def expert_outputs(rows):
        data = rows[..., :h].contiguous().view(torch.float8_e4m3fn).float()
        scales = rows[..., h:].contiguous().view(torch.float32).repeat_interleave(128, -1)
        per_expert = torch.arange(1, e // n + 1, dtype=torch.float32)[:, None, None]
        return (data * scales * per_expert).bfloat16()

    ours_combined = buf.low_latency_combine(expert_outputs(ours_rows), idx, w, handle)[0]
    buf.destroy()
    return dict(ours_rows=ours_rows, ours_count=recv_count.long(), mpi_rows=mpi_rows,
                mpi_count=mpi_count, ours_combined=ours_combined,
                mpi_combined=mpi_combine(expert_outputs(mpi_rows)))


def _sorted_rows(rows):
    return sorted(bytes(r.tolist()) for r in rows)


def test_mpi_low_latency_exchange_equals_moe_comm():
    results = mpi_ranks.Launcher()(_ll_rank, 2, timeout=180)
    for rank, got in enumerate(results):
        assert torch.equal(got["ours_count"], got["mpi_count"]), rank
        assert int(got["mpi_count"].sum()) > 0, rank
        for ex, count in enumerate(got["mpi_count"].tolist()):
            # each local expert's messages: the same fp8 rows and scales, in any order
            assert (_sorted_rows(got["ours_rows"][ex, :count]) ==
                    _sorted_rows(got["mpi_rows"][ex, :count])), (rank, ex)
        torch.testing.assert_close(got["ours_combined"].float(), got["mpi_combined"].float(),
                                   rtol=2e-2, atol=2e-2)
