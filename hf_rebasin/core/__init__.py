"""Core: the types every stage shares: errors, names and defaults, roles, resources, lazy tensor maps.

Imports nothing of hf_rebasin; the standard library, pydantic and (for tensor maps only) torch.
"""
