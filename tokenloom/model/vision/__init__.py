"""Vision towers of the vision-language models: images in, one embedding per
placeholder token out (``clip``: CLIP and SigLIP, for LLaVA; ``qwen2_5_vl``:
Qwen2.5-VL's windowed tower with its patch merger). Their parameter names are
the checkpoints', so loading them is a prefix away; they run whole images with
bidirectional attention through torch SDPA, never through the paged cache."""
