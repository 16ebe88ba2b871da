"""Shared memory between the processes of one host, and the memory ordering over it.

- ``segment``   /dev/shm segments: created 0600, mapped by every rank of the host, unlinked
                at once, stale ones reclaimed
- ``atomics``   release/acquire fences (libatomic) and deadline-bounded waits with backoff
- ``identity``  which ranks share a host (and so can map each other's segments)

Used by the host backend, the CUDA backend's host-memory groups and the transport; imports
nothing else of moe_comm but the wire format and errors.
"""
