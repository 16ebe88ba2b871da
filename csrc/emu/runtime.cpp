// runtime.cpp: the kernel emulator's launch and scheduler (see cuda_emu.h for the model).
//
// moe_emu_launch(kernel, grid, block, args) runs one kernel to completion: one OS thread per
// block, the block's threads as ucontext fibers run round-robin by that OS thread - in thread
// order, or, with MOE_EMU_SCHEDULE_SEED=<n> set, in an order shuffled every pass, so code that
// silently relies on one thread running before another (a lane reading what another lane
// wrote without __syncwarp) meets other interleavings. A fiber
// gives up the OS thread at a barrier it has to wait at, at a warp collective, at a spin point
// and when it returns. Returns 0, or 1 with a message (a barrier or collective that can never
// complete, a thread that could not be started).
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include "cuda_emu.h"

namespace {

constexpr int kMaxArgs = 40;
constexpr size_t kStackBytes = 128 << 10;
// Passes over a block in which every live fiber only waited at a barrier and no barrier or
// collective completed: no progress can come from inside the block, and barriers do not wait
// for other blocks, so it is stuck.
constexpr int kStuckPasses = 3;

// Every kernel parameter is 8 bytes wide (csrc/kernels/common.cuh): a kernel is called
// through a pointer of kMaxArgs of them, the unused ones zero (the SysV ABI leaves extra
// arguments unread).
typedef void (*KernelArgs)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                           uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                           uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                           uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                           uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                           uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);

enum class Yield { Spin, Wait, Exit };

struct Warp {
    unsigned arrived = 0, gen = 0, mask = 0;
    uint64_t vals[32] = {}, out[32] = {};
};

struct Block {
    void* kernel;
    const uint64_t* args;
    dim3 idx, dim, grid;
    int nthreads = 0, live = 0, current = 0;
    std::vector<ucontext_t> ctx;
    std::vector<char> done;
    std::vector<Warp> warps;
    ucontext_t sched;
    char* stacks = nullptr;
    Yield last = Yield::Spin;
    unsigned long long completions = 0;  // barriers and collectives completed: progress
    uint64_t rng = 0;                    // schedule shuffling (0: thread order)
    // __syncthreads
    int bar_arrived = 0, bar_sum = 0, bar_result = 0;
    unsigned bar_gen = 0;
    std::string error;
};

thread_local Block* tl_block = nullptr;

void yield(Yield why) {
    Block* b = tl_block;
    b->last = why;
    swapcontext(&b->ctx[b->current], &b->sched);
}

void finish_barrier(Block* b) {
    b->bar_arrived = 0;
    b->bar_result = b->bar_sum;
    b->bar_sum = 0;
    ++b->bar_gen;
    ++b->completions;
}

void fiber_main() {
    Block* b = tl_block;
    const uint64_t* a = b->args;
    ((KernelArgs)b->kernel)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10],
                            a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20],
                            a[21], a[22], a[23], a[24], a[25], a[26], a[27], a[28], a[29], a[30],
                            a[31], a[32], a[33], a[34], a[35], a[36], a[37], a[38], a[39]);
    b = tl_block;
    b->done[b->current] = 1;
    --b->live;
    // Exited threads stop counting for __syncthreads (as on sm_70+).
    if (b->bar_arrived > 0 && b->bar_arrived >= b->live) finish_barrier(b);
    b->last = Yield::Exit;
    // returning switches to uc_link = the scheduler
}

void run_block(Block* b) {
    tl_block = b;
    const int n = b->nthreads;
    b->ctx.resize(n);
    b->done.assign(n, 0);
    b->warps.resize((n + 31) / 32);
    b->live = n;
    const size_t bytes = kStackBytes * (size_t)n;
    void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) {
        b->error = "could not map fiber stacks";
        return;
    }
    b->stacks = (char*)mem;
    for (int t = 0; t < n; ++t) {
        getcontext(&b->ctx[t]);
        b->ctx[t].uc_stack.ss_sp = b->stacks + kStackBytes * t;
        b->ctx[t].uc_stack.ss_size = kStackBytes;
        b->ctx[t].uc_link = &b->sched;
        makecontext(&b->ctx[t], fiber_main, 0);
    }
    int stuck = 0;
    std::vector<int> order(n);
    for (int t = 0; t < n; ++t) order[t] = t;
    while (b->live > 0) {
        bool only_waits = true, only_spins = true;
        const unsigned long long completions = b->completions;
        for (int i = n - 1; b->rng && i > 0; --i) {  // Fisher-Yates with xorshift64
            b->rng ^= b->rng << 13;
            b->rng ^= b->rng >> 7;
            b->rng ^= b->rng << 17;
            std::swap(order[i], order[b->rng % (uint64_t)(i + 1)]);
        }
        for (int i = 0; i < n; ++i) {
            const int t = order[i];
            if (b->done[t]) continue;
            b->current = t;
            swapcontext(&b->sched, &b->ctx[t]);
            if (b->last != Yield::Wait) only_waits = false;
            if (b->last != Yield::Spin) only_spins = false;
        }
        if (b->live == 0) break;
        stuck = only_waits && b->completions == completions ? stuck + 1 : 0;
        if (stuck >= kStuckPasses) {
            char msg[200];
            snprintf(msg, sizeof msg,
                     "block (%u,%u,%u): %d thread(s) wait at a barrier or warp collective "
                     "that can never complete (divergent __syncthreads, or a lane of the "
                     "mask has exited)",
                     b->idx.x, b->idx.y, b->idx.z, b->live);
            b->error = msg;
            break;  // the stuck fibers are abandoned with their stacks
        }
        if (only_spins) sched_yield();  // everybody polls peers: let other blocks/ranks run
    }
    munmap(mem, bytes);
}

}  // namespace

namespace emu {
dim3 thread_idx() {
    Block* b = tl_block;
    const unsigned t = (unsigned)b->current;
    return dim3{t % b->dim.x, t / b->dim.x % b->dim.y, t / (b->dim.x * b->dim.y)};
}
dim3 block_idx() { return tl_block->idx; }
dim3 block_dim() { return tl_block->dim; }
dim3 grid_dim() { return tl_block->grid; }

int sync_block_count(int predicate) {
    Block* b = tl_block;
    const unsigned gen = b->bar_gen;
    b->bar_sum += predicate != 0;
    if (++b->bar_arrived >= b->live) {
        finish_barrier(b);
    } else {
        while (b->bar_gen == gen) yield(Yield::Wait);
    }
    return b->bar_result;
}
void sync_block() { sync_block_count(0); }

void warp_exchange(unsigned mask, uint64_t value, uint64_t* out) {
    Block* b = tl_block;
    const int t = b->current, lane = t & 31;
    Warp& w = b->warps[t / 32];
    if (w.arrived == 0) w.mask = mask;
    w.vals[lane] = value;
    unsigned exists = 0;  // lanes of a partial last warp that do not exist never arrive
    for (int l = 0; l < 32; ++l)
        if ((t & ~31) + l < b->nthreads) exists |= 1u << l;
    const unsigned expected = (unsigned)__builtin_popcount(w.mask & exists);
    const unsigned gen = w.gen;
    if (++w.arrived >= expected) {
        memcpy(w.out, w.vals, sizeof w.out);
        w.arrived = 0;
        ++w.gen;
        ++b->completions;
    } else {
        while (w.gen == gen) yield(Yield::Wait);
    }
    memcpy(out, w.out, sizeof w.out);
}

void spin_point() {
    if (tl_block) yield(Yield::Spin);
}

void fail(const char* msg) {
    if (tl_block && tl_block->error.empty()) tl_block->error = msg;
}

uint64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
void stop_point(int op) {
    static std::atomic<bool> stopped{false};
    const char* at = getenv("MOE_EMU_STOP_AT_OP");
    const dim3 b = block_idx();  // block 0: a block with rows to write whenever there are any
    if (!at || atoi(at) != op || b.x || b.y || b.z || stopped.exchange(true)) return;
    kill(getpid(), SIGSTOP);  // delivered before kill returns: this block stops here
}

}  // namespace emu

extern "C" int moe_emu_launch(void* kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                              unsigned by, unsigned bz, const uint64_t* args, int nargs,
                              char* errbuf, int errlen) {
    uint64_t padded[kMaxArgs] = {};
    if (nargs > kMaxArgs) {
        snprintf(errbuf, errlen, "%d kernel arguments, the emulator passes at most %d", nargs,
                 kMaxArgs);
        return 1;
    }
    memcpy(padded, args, sizeof(uint64_t) * nargs);
    const unsigned nblocks = gx * gy * gz;
    const char* seed_text = getenv("MOE_EMU_SCHEDULE_SEED");
    const uint64_t seed = seed_text ? strtoull(seed_text, nullptr, 10) : 0;
    std::vector<Block> blocks(nblocks);
    std::vector<std::thread> threads;
    threads.reserve(nblocks);
    for (unsigned i = 0; i < nblocks; ++i) {
        Block& b = blocks[i];
        b.kernel = kernel;
        b.args = padded;
        b.idx = dim3{i % gx, i / gx % gy, i / (gx * gy)};
        b.dim = dim3{bx, by, bz};
        b.grid = dim3{gx, gy, gz};
        b.nthreads = (int)(bx * by * bz);
        if (seed) b.rng = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (i + 1) * 0xBF58476D1CE4E5B9ull;
    }
    try {
        for (unsigned i = 0; i < nblocks; ++i) threads.emplace_back(run_block, &blocks[i]);
    } catch (const std::exception& e) {
        snprintf(errbuf, errlen, "could not start block threads: %s", e.what());
        for (auto& th : threads) th.join();  // blocks waiting on missing ones end at deadlines
        return 1;
    }
    for (auto& th : threads) th.join();
    for (auto& b : blocks) {
        if (!b.error.empty()) {
            snprintf(errbuf, errlen, "%s", b.error.c_str());
            return 1;
        }
    }
    return 0;
}
