"""CUDA backend: the kernels of csrc/kernels (built and launched by moe_comm/jit) driven on
torch's current stream; peers of one node reached through CUDA IPC mappings, other hosts
through IBGDA (moe_comm/ibgda) or the kernels' host proxy.

- ``comm``          ``CudaComm``: the buffers of a group, epochs, the error word, masks
- ``normal``        normal-mode dispatch/combine (the backend contract, moe_comm/backend.py)
- ``ll``            low-latency dispatch/combine halves (same contract)
- ``elastic``       the mask agreement kernel's launch
- ``kernel_proxy``  drains the kernels' command ring into the transport (ranks on other hosts)

Importing this package needs neither a GPU nor cuda.core.
"""
