// nvshmem_emu.cpp: the symmetric-heap registry and the put queue behind nvshmem_emu.h.
//
// Built into every emulator library (a library per kernel variant, each with its own copy of
// this state), so the host registers a group's heaps with every library it loads
// (moe_comm/cuda/emulator.py). Only the IBGDA build's kernels call into it.
#include <stdio.h>
#include <string.h>

#include <mutex>
#include <vector>

#include "cuda_emu.h"
#include "nvshmem_emu.h"

namespace {

struct Group {
    std::vector<uint64_t> bases;  // PE p's buffer starts at bases[p]
    uint64_t bytes;               // every buffer's size
};

struct Put {
    void* dst;
    const void* src;
    size_t bytes;
};

std::mutex mu;  // never held across a fiber switch: nothing below yields
std::vector<Group> groups;
std::vector<Put> queued;

}  // namespace

namespace emu {

void* nvshmem_translate(const void* sym, int pe) {
    const uint64_t a = (uint64_t)sym;
    {
        std::lock_guard<std::mutex> lock(mu);
        for (const Group& g : groups) {
            for (uint64_t base : g.bases) {
                if (a < base || a >= base + g.bytes) continue;
                if (pe < 0 || pe >= (int)g.bases.size()) break;
                return (void*)(g.bases[pe] + (a - base));
            }
        }
    }
    char msg[160];
    snprintf(msg, sizeof msg, "emulated NVSHMEM: address %#llx for PE %d is in no registered "
             "symmetric heap", (unsigned long long)a, pe);
    fail(msg);
    return nullptr;
}

void nvshmem_queue_put(void* dst, const void* src, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    queued.push_back(Put{dst, src, bytes});
}

void nvshmem_quiet_all() {
    std::lock_guard<std::mutex> lock(mu);
    for (const Put& p : queued) memcpy(p.dst, p.src, p.bytes);
    queued.clear();
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

}  // namespace emu

// The host registers a group's buffers (PE order) as one symmetric heap / forgets it.
extern "C" void moe_emu_nvshmem_register(const uint64_t* bases, int n, uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    groups.push_back(Group{std::vector<uint64_t>(bases, bases + n), bytes});
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
