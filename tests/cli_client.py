"""``python -m titanctl ARGS`` for a shell script run by a test, answered by the test session's CLI
servers (tests/cli_server.py ``shell_endpoint``): standard library only, so it starts in milliseconds.

    python -S tests/cli_client.py SOCKET ARGS...
"""

import base64
import json
import os
import socket
import sys


def main() -> int:
    path, args = sys.argv[1], sys.argv[2:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        stream = sock.makefile("rwb")
        stream.write(json.dumps({"args": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode() + b"\n")
        stream.flush()
        reply = json.loads(stream.readline())
    sys.stdout.buffer.write(base64.b64decode(reply["stdout"]))
    sys.stderr.buffer.write(base64.b64decode(reply["stderr"]))
    return reply["code"]


if __name__ == "__main__":
    sys.exit(main())
