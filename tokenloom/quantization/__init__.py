"""Weights kept quantized in memory and computed on directly.

``formats``: the layouts and conversions (GGUF blocks, float weights);
``kernels``: the native matmul and its torch fallback; ``linear``: the modules;
``loading``: which models run quantized and how they are filled.
"""
