"""`make test`: the whole suite, as two pytest runs side by side.

The tests marked `testbed` build the one testbed a machine can hold (the testbed lock
serialises them), and most of their time is spent waiting on the network and on timers:
the machine is about two thirds idle through them. Every other test (the pure ones and the
integration tests that need no testbed: conntrack, iptables and the control channel in
namespaces of their own) runs meanwhile in a second run, at a lower CPU priority so that
the testbed's timing is not disturbed. That run's output follows the first's; the exit
status is the first failure's. Extra arguments go to both runs.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

# Set in the side run: a testbed built there is a test that lacks its marker (testbed_machine).
SIDE_ENV = "NFSHUNT_SIDE_RUN"
SIDE_NICENESS = 10


def main(extra: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *extra]
    with tempfile.TemporaryFile("w+") as side_out:
        side = subprocess.Popen(["nice", "-n", str(SIDE_NICENESS), *pytest, "-v", "-m", "not testbed"],
                                stdout=side_out, stderr=subprocess.STDOUT, env=dict(os.environ, **{SIDE_ENV: "1"}))
        try:
            testbed_rc = subprocess.call([*pytest, "-v", "-m", "testbed"])
            side_rc = side.wait()
        finally:
            if side.poll() is None:  # interrupted: the side run goes too
                side.terminate()
                side.wait()
        side_out.seek(0)
        print("\n=== the tests that need no testbed (run alongside) ===", flush=True)
        sys.stdout.write(side_out.read())
    print(f"\ntestbed run: exit {testbed_rc}; the rest: exit {side_rc}")
    return testbed_rc or side_rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
