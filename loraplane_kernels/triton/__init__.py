"""Triton multi-LoRA kernels, one module per op family.

``bgmv`` (one slot index per token, decode), ``sgmv`` (contiguous segments per slot,
prefill) and ``fused`` (shrink and expand in one launch, for small batches where launch
latency dominates). Each launcher trusts its arguments: ``loraplane_kernels.dispatch``
validates them first. Every kernel loops or masks over the slot's own rank, so padded slab
rows are never read and a batch of mixed ranks moves the bytes of its real ranks, not of the
largest one.
"""
