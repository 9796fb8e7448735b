"""The symmetry graph: spaces, transforms and how they apply, canonical form, GLU scaling, widths, `adapters/`.

Imports `core` only, and no transformers outside `adapters/` (the graph is data; adapters declare it).
"""
