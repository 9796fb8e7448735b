"""The zoo: small models trained offline on the built-in data, for the demo, the tests and the benchmarks.

`catalogue` (torch-free: kinds, configs, folders), `train` (the entry points: `cached_model`, the
trainer of every kind, the models trained on top of another zoo model), `loop` (the training loop
every kind shares), `families` (the transformers configs) and one recipe module per group of
families trained from scratch: `causal`, `masked`, `images`.
"""
