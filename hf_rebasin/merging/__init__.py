"""What is done with aligned models: interpolation, universe merging, transport of task vectors and LoRA, shared bases.

Imports `core`, `symmetry`, `io` and `alignment`.
"""
