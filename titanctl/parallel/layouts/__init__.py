"""Parallel layouts: ParallelDims -> DeviceMesh, and apply_fsdp/ddp/tp/cp/ep/pp/ac/compile from outside the
model, through one builder that train, estimate-memory and plan share (``build``)."""
