"""The CUDA backend's kernels (Triton): paged attention over the ragged batch
and the K/V write (``paged_attention``), and the decoder's fused element-wise
layers (``layer_ops``). They run on a GPU, and on the CPU under
``TRITON_INTERPRET=1`` where the tests check them against the torch reference
(``model.attention``, ``model.layers``)."""
