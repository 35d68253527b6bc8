"""The distributed runtime: the process group and its environment, elastic restarts, peers' failures, the
hang watchdog (Flight Recorder), torchft's fault tolerance and its Lighthouse."""
