"""Files in and out: the gate every file passes, checkpoints read lazily and loaded, saved, output folders, the Hub.

Imports `core` and `symmetry`; `hub` is the only sub-package that talks to the network.
"""
