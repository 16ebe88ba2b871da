"""Helpers for tests and benchmarks (public; nothing in the library imports them).

- ``processes``       run a function on N local rank processes in a gloo group, with a deadline
- ``netns``           several "hosts" on one machine: network namespaces joined by veth pairs
- ``local_cuda``      drive a CUDA group's ranks as threads of one process (GPU or emulator)
- ``ibgda_selftest``  two-rank NVSHMEM put/signal round trip, latency, timeout (GPU + NIC)
"""
