"""The MoE layer on top of Buffer: the nn.Module drop-in and what it is made of.

- ``layer``           MoELayer: router -> EPLB mapping -> dispatch -> local experts -> combine
- ``router``          top-k gate (softmax or sigmoid, grouped routing)
- ``experts``         this rank's SwiGLU experts (bf16 or fp8 weights)
- ``autograd``        dispatch/combine as autograd functions (combine's backward is a dispatch)
- ``shared_buffers``  the Buffer per process group that layers share
- ``hf``              read what a Hugging Face MoE block computes (for ``MoELayer.from_hf``)
- ``replace``         replace a model's Hugging Face MoE blocks with MoELayers
- ``hf_layout``       how a replaced block named its weights (for full checkpoints)
- ``checkpoint``      full, unsharded checkpoints of a replaced model (gather, save, load)
"""
from .checkpoint import gather_full_state_dict, load_full_state_dict, save_pretrained
from .layer import MoELayer
from .replace import replace_moe_blocks
from .shared_buffers import DEFAULT_SHARED_BUFFERS, SharedBuffers

__all__ = ["MoELayer", "replace_moe_blocks", "SharedBuffers", "DEFAULT_SHARED_BUFFERS",
           "gather_full_state_dict", "load_full_state_dict", "save_pretrained"]
