"""The MoE layer on top of Buffer: the nn.Module drop-in and what it is made of.

- ``layer``     MoELayer: router -> EPLB mapping -> dispatch -> local experts -> combine
- ``router``    top-k gate (softmax or sigmoid, grouped routing)
- ``experts``   this rank's SwiGLU experts (bf16 or fp8 weights)
- ``autograd``  dispatch/combine as autograd functions (combine's backward is a dispatch)
- ``hf``        recognise Hugging Face MoE blocks and replace them with MoELayer
"""
from .hf import replace_moe_blocks
from .layer import MoELayer

__all__ = ["MoELayer", "replace_moe_blocks"]
