"""titanctl's command line under torchrun, as ``python -m titanctl ARGS`` runs it, in a fork of the test
session's server when it has one (tests/fork_server.py): for the tests that train, convert or generate
through the CLI on several ranks. The tests of the entry point itself launch ``python -m titanctl``
(test_layouts.py's torchrun run of the CLI, the docs' tour, the Slurm script).

    torchrun ... cli_worker.py ARGS
"""

import os
import runpy
import sys

from tests.fork_server import hand_over

if __name__ == "__main__":
    hand_over()  # run as a fork of the test session's server, when it has one
    sys.path[0] = os.getcwd()  # as `python -m` puts the working folder first
    runpy.run_module("titanctl", run_name="__main__", alter_sys=True)
