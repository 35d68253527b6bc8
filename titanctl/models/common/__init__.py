"""Blocks shared by the model families: hyper-parameters (args), norms, RoPE, grouped-query attention
and its KV cache, the SwiGLU feed-forward, the router and grouped experts, init rules, and the
decoder-only transformer that composes them (decoder).

A family (a folder beside this one) is a set of flavors over these plus the modules only it has,
which it hands the decoder (``decoder.Blocks``); nothing here names a family or knows about
parallelism (tests/unit/test_architecture.py).
"""
