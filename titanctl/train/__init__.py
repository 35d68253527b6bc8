"""Training: the Trainer (the loop) and one step's forward and backward, optimizers (AdamW, Muon, parameter
groups) and the LR schedule, loss, MoE balancing, metrics, validation, the runtime profiler, the run folder."""
