"""Before a run: how much memory a layout needs (``memory``: the exact estimate on fake tensors) and which
layouts to run (``plan``: a search over layouts with a cost model). ``titanctl estimate-memory`` and
``titanctl plan`` are its commands."""
