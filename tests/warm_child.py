"""A child for tests/test_warmstart.py: says what it runs with, then exits, fails or sleeps.

``python -m tests.warm_child exit N`` | ``raise`` | ``sleep``."""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    print(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "cwd": os.getcwd(),
                "pid": os.getpid(),
                "sid": os.getsid(0),
                "probe": os.environ.get("WARM_PROBE"),
                "torch_preloaded": "torch" in sys.modules,
            }
        ),
        flush=True,
    )
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "raise":
        raise RuntimeError("a failure the log must show")
    if sys.argv[1] == "sleep":
        time.sleep(600)
    sys.exit(int(sys.argv[2]))
