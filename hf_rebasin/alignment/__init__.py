"""Alignment: features, solvers and `strategies/` find the maps; verify and diagnostics check them; the cache keeps them.

Imports `core`, `symmetry` and `io`; solvers stay free of transformers.
"""
