"""Blocks shared by the model families: hyper-parameters (args), norms, RoPE, attention,
feed-forward, and the decoder-only transformer that composes them (decoder).

A family (``titanctl.models.llama``, ``titanctl.models.qwen3``) is a set of flavors over these;
nothing here knows about parallelism.
"""
