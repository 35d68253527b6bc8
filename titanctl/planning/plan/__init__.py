"""`titanctl plan`'s planner, in small parts:

- ``devices``: a device's figures (datasheet presets, cluster files) as one ``Device``;
- ``workload``: a model's blocks as matmuls and parameters, split the way its TP plan splits them;
- ``candidates``: the layouts of N devices, each checked by the trainer's own validation;
- ``memory_model``: the fast per-rank memory estimate (estimate-memory gives the finalists' exact one);
- ``cost_model``: seconds per step, term by term;
- ``search``: enumerate, filter, time, rank, estimate the finalists exactly;
- ``calibrate``: measure this machine's figures with N processes and write a cluster file.
"""
