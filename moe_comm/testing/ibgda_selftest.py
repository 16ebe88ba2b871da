"""Two-rank check of the IBGDA transport on real hardware: put + signal, a ping-pong (latency),
the pull fallback (remote read) and a deadline that expires (no hang, silent rank named).

Needs a GPU and an RDMA NIC (IB or RoCE, ConnectX-class for IBGDA); both ranks may share one
GPU and NIC: ``force_network=True`` (the default) sets ``NVSHMEM_DISABLE_P2P=1`` so the two PEs
talk through the NIC even on one node. Run by hand with
``python -m moe_comm.testing.ibgda_selftest`` or through tests/test_ibgda_gpu.py. Ranks are
spawned processes (not forked: CUDA).

Buffer layout of each rank (its own buffer of ctx.comm_buffers; a message to a network peer
is staged in the mirror at the same offset), byte offsets:
    SIG_ONEWAY, SIG_PING, SIG_PULL, SIG_NEVER   signal words, one 64-byte line each
    SRC                                         what this rank sends (its pattern)
    DST                                         where the peer's bytes land
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from ..cuda.memory import bases_tensor
from ..ibgda.bases import decode_base
from ..ibgda.runtime import init_nvshmem
from ..jit.kernel_args import pack
from ..jit.launch import launch
from ..jit.nvcc import build_cubin, selftest_program
from ..jit.variants import THREADS
from ..wire import ERR_TIMEOUT, ERROR_HEADER, MAX_ERROR_RANKS

SIG_ONEWAY, SIG_PING, SIG_PULL, SIG_NEVER = 0, 64, 128, 192
SRC, DST = 4096, 4096 + (1 << 20)
BUFFER_BYTES = 4096 + (2 << 20)


def _pattern(rank: int, nbytes: int):
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + 13 * (rank + 1)) % 251).to(
        torch.uint8)


def _tag(epoch: int, value: int) -> int:
    return (epoch << 32) | value


def _worker(rank, world, port, opts, queue):
    try:
        ndev = torch.cuda.device_count()
        device = torch.device("cuda", rank % ndev)
        torch.cuda.set_device(device)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        if not opts["force_network"]:         # P2P only: no NIC needed, none probed
            os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        ctx = init_nvshmem(None, device, ibgda=opts["force_network"],
                           force_network=opts["force_network"],
                           bootstrap_ifname=opts.get("bootstrap_ifname"))
        report = {"rank": rank, "device": torch.cuda.get_device_name(device),
                  "env": {k: v for k, v in os.environ.items() if k.startswith("NVSHMEM_")}}
        try:
            major, minor = torch.cuda.get_device_capability(device)
            if rank == 0:                       # one build, the other rank hits the cache
                build_cubin(selftest_program(), f"sm_{major}{minor}")
            dist.barrier()
            k = ctx.load(selftest_program())
            bufs = ctx.comm_buffers(BUFFER_BYTES)     # own buffer + a mirror per network peer
            buf = bufs.own
            report["kinds"] = [decode_base(w)[0] for w in bufs.words]
            bases = bases_tensor(bufs.sym, bufs.words, device)
            err_host = torch.zeros(ERROR_HEADER + MAX_ERROR_RANKS, dtype=torch.int32,
                                   pin_memory=True)
            err_dev = torch.zeros(4, dtype=torch.int32, device=device)
            out = torch.zeros(2, dtype=torch.int64, device=device)
            peer, nbytes = 1 - rank, opts["nbytes"]
            base = buf.data_ptr()
            buf[SRC:SRC + nbytes].copy_(_pattern(rank, nbytes).to(device))
            torch.cuda.synchronize()
            dist.barrier()

            def sync():
                torch.cuda.synchronize()
                dist.barrier()

            def reset():
                err_host.zero_()
                err_dev.zero_()
                out.zero_()
                torch.cuda.synchronize()

            common = {"bases": bases, "err_host": err_host, "err_dev": err_dev, "op": 0}

            def run(name, **args):      # one block of the kernel's own size
                launch(k[name], 1, THREADS[name], pack(name, **common, **args))
            # 1. one way: rank 0 puts its pattern into rank 1 and signals; rank 1 waits.
            if rank == 0:
                run("moe_ibgda_test_send", peer=peer, dst_off=DST, src=np.uint64(base + SRC),
                    bytes=nbytes, sig_off=SIG_ONEWAY, word=_tag(1, nbytes))
            else:
                run("moe_ibgda_test_wait", peer=peer, word=np.uint64(base + SIG_ONEWAY), epoch=1,
                    timeout_ns=int(10e9), out=out)
            sync()
            if rank == 1:
                got = buf[DST:DST + nbytes].cpu()
                report["oneway_value"] = int(out[0])
                report["oneway_data_ok"] = bool(torch.equal(got, _pattern(0, nbytes)))
                report["oneway_error"] = int(err_host[0])
            # 2. ping-pong latency: both launch at once, rank 0 first.
            reset()
            iters = opts["iters"]
            dist.barrier()
            run("moe_ibgda_test_pingpong", rank=rank, peer=peer, first=int(rank == 0),
                iters=iters, dst_off=DST, src=np.uint64(base + SRC), bytes=opts["ping_bytes"],
                sig_off=SIG_PING, epoch0=10, timeout_ns=int(10e9), out=out)
            sync()
            report["pingpong_received"] = int(out[0])
            report["pingpong_iters"] = iters
            report["pingpong_us_per_round_trip"] = float(out[1]) / 1e3 / max(iters, 1)
            report["pingpong_error"] = int(err_host[0])
            # 3. pull fallback: each rank stores tag(5, rank) in its own SIG_PULL, then polls the
            #    peer's copy with RDMA reads (wait_peer_tag through Transport::read_signal).
            reset()
            buf[SIG_PULL:SIG_PULL + 8].view(torch.int64).fill_(_tag(5, rank))
            sync()
            run("moe_ibgda_test_wait_remote", peer=peer, off=SIG_PULL, epoch=5,
                timeout_ns=int(10e9), out=out)
            sync()
            report["pull_ok"] = int(out[0]) == 1
            report["pull_error"] = int(err_host[0])
            # 4. deadline: rank 0 waits for a word nobody writes; must return in time and name
            #    rank 1 as silent.
            reset()
            if rank == 0:
                deadline_ns = int(opts["deadline_ms"] * 1e6)
                t0 = time.monotonic()
                run("moe_ibgda_test_wait", peer=peer, word=np.uint64(base + SIG_NEVER), epoch=99,
                    timeout_ns=deadline_ns, out=out)
                torch.cuda.synchronize()
                report["timeout_s"] = time.monotonic() - t0
                report["timeout_value"] = int(out[0])
                report["timeout_code"] = int(err_host[0])
                report["timeout_silent"] = [r for r in range(MAX_ERROR_RANKS)
                                            if int(err_host[ERROR_HEADER + r])]
            sync()
        finally:
            ctx.finalize()
        queue.put((rank, True, json.dumps(report)))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*, force_network: bool = True, nbytes: int = 1 << 20, ping_bytes: int = 64,
        iters: int = 200, deadline_ms: float = 200.0, bootstrap_ifname: str | None = "lo",
        timeout_s: float = 300.0) -> list:
    """Run the two ranks; returns their reports (dicts). Raises RuntimeError on a rank's
    failure or when a rank is still running after ``timeout_s`` (it is killed)."""
    world = 2
    opts = {"force_network": force_network, "nbytes": nbytes, "ping_bytes": ping_bytes,
            "iters": iters, "deadline_ms": deadline_ms, "bootstrap_ifname": bootstrap_ifname}
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, opts, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < world and time.monotonic() < deadline:
        if not queue.empty():
            rank, ok, val = queue.get()
            (results if ok else errors)[rank] = val
        elif all(not p.is_alive() for p in procs) and queue.empty():
            break
        else:
            time.sleep(0.05)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        r = min(errors)
        raise RuntimeError(f"rank {r} failed:\n{errors[r]}")
    missing = set(range(world)) - set(results)
    if missing:
        raise RuntimeError(f"ranks {sorted(missing)} did not report within {timeout_s} s "
                           "(crash, or NVSHMEM exited the process)")
    return [json.loads(results[r]) for r in range(world)]


def check(reports: list, expect_network: bool = True) -> list:
    """Problems found in ``run``'s reports (empty when the transport works).
    ``expect_network``: the peer must have been reached over the NIC (force_network runs)."""
    r0, r1 = reports
    problems = []
    for r in reports:
        if expect_network and "network" not in r.get("kinds", []):
            problems.append(f"rank {r['rank']}: peer reached as {r.get('kinds')}, not over the "
                            "network (NVSHMEM_DISABLE_P2P not honoured?)")
        if r.get("pingpong_received") != r.get("pingpong_iters"):
            problems.append(f"rank {r['rank']}: ping-pong received {r.get('pingpong_received')}"
                            f" of {r.get('pingpong_iters')} legs (error {r['pingpong_error']})")
        if not r.get("pull_ok"):
            problems.append(f"rank {r['rank']}: remote read never saw the peer's word "
                            f"(error {r.get('pull_error')})")
    if not (r1.get("oneway_data_ok") and r1.get("oneway_value", -1) >= 0):
        problems.append(f"one-way put+signal: value {r1.get('oneway_value')}, data ok "
                        f"{r1.get('oneway_data_ok')}, error {r1.get('oneway_error')}")
    if r0.get("timeout_value") != -1 or r0.get("timeout_code") != ERR_TIMEOUT \
            or r0.get("timeout_silent") != [1] or r0.get("timeout_s", 99) > 5:
        problems.append(f"deadline: value {r0.get('timeout_value')}, code "
                        f"{r0.get('timeout_code')}, silent {r0.get('timeout_silent')}, took "
                        f"{r0.get('timeout_s')} s")
    return problems


def main(argv=None) -> int:
    network = "--p2p" not in (sys.argv[1:] if argv is None else argv)
    reports = run(force_network=network)
    for r in reports:
        print(json.dumps(r, indent=1, sort_keys=True))
    problems = check(reports, expect_network=network)
    for p in problems:
        print("PROBLEM:", p)
    print("ibgda selftest:", "OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
