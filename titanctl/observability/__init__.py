"""After or during a run: what is slow and which rank hangs. Profiler traces (``trace_analysis``),
Flight Recorder dumps (``fr_analysis``), and ``titanctl profile``'s run and summary (``profile_run``)."""
