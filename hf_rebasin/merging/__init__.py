"""What is done with aligned models: interpolation, universe merging, transport of task vectors and LoRA, shared bases,
and models whose vocabularies differ (`vocabulary`: the output's vocabulary built, the embedding rows mapped to it).

Imports `core`, `symmetry`, `io` and `alignment`.
"""
