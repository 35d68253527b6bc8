"""DeepSeek-V4: compressed sparse attention, manifold-constrained hyper-connections and hash-routed experts."""
