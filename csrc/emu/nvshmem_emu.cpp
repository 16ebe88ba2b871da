// nvshmem_emu.cpp: the symmetric-heap registry and the per-PE put queues behind
// nvshmem_emu.h (the model is described there).
//
// Built into every emulator library (a library per kernel variant, each with its own copy of
// this state), so the host registers a group's heaps with every library it loads
// (moe_comm/cuda/emulator.py). A put and the quiet that applies it run in the same kernel,
// hence the same library. Only the IBGDA build's kernels call into it.
#include <stdio.h>
#include <string.h>

#include <mutex>
#include <vector>

#include "cuda_emu.h"
#include "nvshmem_emu.h"

namespace {

struct Put {
    void* dst;
    const void* src;
    size_t bytes;
};

struct Group {
    std::vector<uint64_t> bases;         // PE p's buffer starts at bases[p]
    uint64_t bytes;                      // every buffer's size (the symmetric part)
    uint64_t local_bytes;                // registered memory from bases[p]: buffer + mirrors
    std::vector<std::vector<Put>> queued;  // per issuing PE, in issue order
};

std::mutex mu;  // never held across a fiber switch: nothing below yields
std::vector<Group> groups;
thread_local bool tl_quiet_pending = false;

// The group and PE whose buffer holds `a`, or false.
bool find(uint64_t a, Group** g_out, int* pe_out) {
    for (Group& g : groups) {
        for (size_t p = 0; p < g.bases.size(); ++p) {
            if (a >= g.bases[p] && a < g.bases[p] + g.bytes) {
                *g_out = &g;
                *pe_out = (int)p;
                return true;
            }
        }
    }
    return false;
}

void failf(const char* what, uint64_t a, int pe) {
    char msg[200];
    snprintf(msg, sizeof msg, "emulated NVSHMEM: %s (address %#llx, PE %d)", what,
             (unsigned long long)a, pe);
    emu::fail(msg);
}

}  // namespace

namespace emu {

void* nvshmem_translate(const void* sym, int pe) {
    std::lock_guard<std::mutex> lock(mu);
    Group* g;
    int me;
    if (!find((uint64_t)sym, &g, &me) || pe < 0 || pe >= (int)g->bases.size()) {
        failf("symmetric address in no registered heap, or PE out of range", (uint64_t)sym, pe);
        return nullptr;
    }
    return (void*)(g->bases[pe] + ((uint64_t)sym - g->bases[me]));
}

void nvshmem_queue_put(void* sym, const void* src, size_t bytes, int pe) {
    std::lock_guard<std::mutex> lock(mu);
    Group* g;
    int me;
    const uint64_t a = (uint64_t)sym, s = (uint64_t)src;
    if (!find(a, &g, &me) || pe < 0 || pe >= (int)g->bases.size() ||
        a + bytes > g->bases[me] + g->bytes) {
        failf("put outside the symmetric heap", a, pe);
        return;
    }
    if (s < g->bases[me] || s + bytes > g->bases[me] + g->local_bytes) {
        failf("put from a source that is not NIC-registered memory", s, pe);
        return;
    }
    g->queued[me].push_back(Put{(void*)(g->bases[pe] + (a - g->bases[me])), src, bytes});
}

void nvshmem_quiet_pending() { tl_quiet_pending = true; }

void nvshmem_signal(uint64_t* sym, uint64_t value, bool add, int pe) {
    uint64_t* word = nullptr;
    {
        std::lock_guard<std::mutex> lock(mu);
        Group* g;
        int me;
        if (!find((uint64_t)sym, &g, &me) || pe < 0 || pe >= (int)g->bases.size()) {
            failf("signal outside the symmetric heap", (uint64_t)sym, pe);
            return;
        }
        if (tl_quiet_pending) {  // the quiet before this signal: apply this PE's puts
            for (const Put& p : g->queued[me]) memcpy(p.dst, p.src, p.bytes);
            g->queued[me].clear();
            tl_quiet_pending = false;
        }
        word = (uint64_t*)(g->bases[pe] + ((uint64_t)sym - g->bases[me]));
    }
    if (add)
        __atomic_fetch_add(word, value, __ATOMIC_RELEASE);
    else
        __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

}  // namespace emu

// The host registers a group's buffers (PE order) as one symmetric heap / forgets it (and
// any puts still queued for it).
extern "C" void moe_emu_nvshmem_register(const uint64_t* bases, int n, uint64_t bytes,
                                         uint64_t local_bytes) {
    std::lock_guard<std::mutex> lock(mu);
    groups.push_back(Group{std::vector<uint64_t>(bases, bases + n), bytes, local_bytes,
                           std::vector<std::vector<Put>>((size_t)n)});
}

extern "C" void moe_emu_nvshmem_unregister(uint64_t base0) {
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < groups.size(); ++i) {
        if (!groups[i].bases.empty() && groups[i].bases[0] == base0) {
            groups.erase(groups.begin() + (long)i);
            return;
        }
    }
}
