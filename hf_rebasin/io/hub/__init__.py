"""The Hugging Face Hub: resolve model references, download exactly what loading reads, push results.

The only part of hf_rebasin that talks to the network; nothing is re-exported, so its modules import alone.
"""
