"""`titanctl train` under torchrun where rank 0 fails after the process group formed, alone, while rank 1
waits for it in the set-up's first collective (the dump folder's outcome): what a file only rank 0 cannot
read would do. Rank 1 must stop with one line naming rank 0's failure, not a gloo traceback.

    torchrun --monitor-interval 20 ... peer_failure_worker.py TRAIN_ARGS
"""

import os
import runpy
import sys

from tests.fork_server import hand_over

PLANTED = "planted: rank 0 cannot read its part of the data"

if __name__ == "__main__":
    hand_over()
    sys.path[0] = os.getcwd()
    if os.environ["RANK"] == "0":
        from titanctl.errors import DataError
        from titanctl.train.trainer import Trainer

        def fail(self):
            raise DataError(PLANTED)

        Trainer._own_dump_folder = fail
    sys.argv = ["titanctl", "train", *sys.argv[1:]]
    runpy.run_module("titanctl", run_name="__main__", alter_sys=True)
