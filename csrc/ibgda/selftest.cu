// selftest.cu: small kernels that drive `Transport` (csrc/kernels/transport.cuh) built with
// MOE_WITH_NVSHMEM, for the two-rank put/signal round trip of moe_comm/testing/ibgda_selftest.py and
// for CI's compile + device-link check (tests/test_ibgda_compile.py). They go through the very
// methods the mode kernels use, so a round trip here exercises the kernels' remote branch.
//
// Their parameter lists are MOE_ARGS_<kernel> (moe_comm/jit/kernel_args.py, through
// moe_generated.cuh), like the kernels of csrc/kernels: moe_comm/jit/launch.py launches both.
#ifndef MOE_WITH_NVSHMEM
#error "selftest.cu is the NVSHMEM build: compile with -DMOE_WITH_NVSHMEM (moe_comm/jit/nvcc.py)"
#endif
#include "../kernels/transport.cuh"

// One warp: put `bytes` from `src` (registered memory: our symmetric buffer) to `dst_off` of
// `peer`'s buffer, then lane 0 signals `word` at `sig_off` of `peer`'s buffer.
MOE_KERNEL void __launch_bounds__(MOE_THREADS_IBGDA_TEST_SEND, 1)
moe_ibgda_test_send(MOE_ARGS_moe_ibgda_test_send) {
    const Transport t{bases, ErrorSink{err_host, err_dev, (i32)op}};
    if (threadIdx.x >= kWarpSize) return;
    t.put_warp((int)peer, (u64)dst_off, src, (u64)bytes);
    __syncwarp();
    if (lane_id() == 0) t.signal((int)peer, (u64)sig_off, (u64)word);
}

// One thread: wait (deadline-bounded) until the local word `word` carries `epoch`, pushed by
// `peer`; out[0] = its value, or -1 on timeout (then the error word names `peer`).
MOE_KERNEL void __launch_bounds__(MOE_THREADS_IBGDA_TEST_WAIT, 1)
moe_ibgda_test_wait(MOE_ARGS_moe_ibgda_test_wait) {
    const Transport t{bases, ErrorSink{err_host, err_dev, (i32)op}};
    if (threadIdx.x != 0) return;
    out[0] = t.wait_local(word, (u32)epoch, (u64)timeout_ns, (int)peer);
}

// One thread: the pull fallback, wait_peer_tag on the word at `off` of `peer`'s buffer (an
// RDMA read per poll for a network peer). out[0] = 1 if it showed `epoch` in time, else 0.
MOE_KERNEL void __launch_bounds__(MOE_THREADS_IBGDA_TEST_WAIT_REMOTE, 1)
moe_ibgda_test_wait_remote(MOE_ARGS_moe_ibgda_test_wait_remote) {
    const Transport t{bases, ErrorSink{err_host, err_dev, (i32)op}};
    if (threadIdx.x != 0) return;
    out[0] = wait_peer_tag(t, (int)peer, (u64)off, (u32)epoch, (u64)timeout_ns) ? 1 : 0;
}

// `iters` ping-pongs between this rank and `peer`, one warp: the rank with `first` != 0
// sends first. Each leg puts `bytes` from `src` to `dst_off` and signals tag(epoch0 + i, i)
// at `sig_off`; the other side waits for it on its own copy of the word. out[0] = legs received
// in time (`iters` when all were), out[1] = %globaltimer ns the loop took.
MOE_KERNEL void __launch_bounds__(MOE_THREADS_IBGDA_TEST_PINGPONG, 1)
moe_ibgda_test_pingpong(MOE_ARGS_moe_ibgda_test_pingpong) {
    const Transport t{bases, ErrorSink{err_host, err_dev, (i32)op}};
    if (threadIdx.x >= kWarpSize) return;
    const u64* mine = (const u64*)((const u8*)bases[rank] + sig_off);
    const u64 t0 = globaltimer_ns();
    i64 arrived = 0;
    for (i64 i = 0; i < iters; ++i) {
        for (int leg = 0; leg < 2; ++leg) {
            const u32 epoch = (u32)(epoch0 + 2 * i + leg);
            const bool sending = (leg == 0) == (first != 0);
            if (sending) {
                t.put_warp((int)peer, (u64)dst_off, src, (u64)bytes);
                __syncwarp();
                if (lane_id() == 0) t.signal((int)peer, (u64)sig_off, tag(epoch, (u32)i));
            } else {
                i64 v = 0;
                if (lane_id() == 0) v = t.wait_local(mine, epoch, (u64)timeout_ns, (int)peer);
                v = __shfl_sync(kFullMask, v, 0);
                if (v < 0) {
                    if (lane_id() == 0) {
                        out[0] = arrived;
                        out[1] = (i64)(globaltimer_ns() - t0);
                    }
                    return;
                }
                ++arrived;
            }
        }
    }
    if (lane_id() == 0) {
        out[0] = arrived;
        out[1] = (i64)(globaltimer_ns() - t0);
    }
}
