"""Evaluation: data, losses and barriers along λ, scores and the typed record, reports, and the `zoo/` they run on.

Imports `core`, `symmetry`, `io`, `alignment` and `merging`.
"""
