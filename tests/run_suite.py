"""`make test`: the whole suite, as four pytest runs side by side.

The tests marked `testbed` build the one testbed a set of namespaces can hold (the testbed
lock serialises them), and most of their time is spent waiting on the network and on timers:
the machine is about two thirds idle through them. So:
- the testbed tests that count or time packets run in one run, at the machine's ordinary
  priority (their output is shown as it comes);
- the ones also marked `second_bed` (the experiments' and benchmarks' programs, the switch
  probe, the dashboard, trust, the IDS's bounds, and modules that count flows and read logs: layouts,
  operation, several switches; a routing firewall's demo, restart and shunts) run meanwhile on
  a second testbed, and those marked `third_bed` (the IDS on the testbed, explain, forged
  closes, take-downs, closes and port reuse, the controller's end-to-end cases; a routing
  firewall's NAT take-downs, NAT restart and tables) on a third, each on a machine of its own
  (mininet/own_machine.py: namespaces and an Open vSwitch of their own). Their switch ports
  keep the machine's small socket buffer, so the tests that count every frame (the testbed's
  own, jitter, static shunts: one lost 83 of 4,000 there) stay on the first; so does the
  firewall pair (on the third, 3 of 4 runs failed one of its tests);
- every other test (the pure ones and the integration tests that need no testbed: conntrack,
  iptables and the control channel in namespaces of their own) runs meanwhile too.
The runs alongside have a lower CPU priority, so that the first testbed's timing is not
disturbed (the benchmarks load the machine flat out by design; a transfer there once took
10 s to be shunted on the first testbed at an equal priority; with the third at the first's
priority, the firewall pair's boot test on the first lost its controller or its role in 5
of 12 runs). With the third testbed the first's run went from 619 to about 330 s
(`make test` 10:48 to about 6 min on the 2-core VM).
Extra arguments go to every run. Ctrl-C or a SIGTERM stops every run the way Ctrl-C stops
pytest, so that each testbed is torn down.

The runs start about 600 Python processes (controllers, the CLI, helpers inside the nodes), and
where PYTHONDONTWRITEBYTECODE is set (as on the project's VMs) each compiled NFShunt's modules
from source again, and each pytest run rewrote and compiled every test module. The runs share
one bytecode cache instead, in a directory of their own (PYTHONPYCACHEPREFIX: nothing written
into the source tree or the virtualenv), filled with NFShunt's and the testbed's modules before
they start and removed after them.
"""
from __future__ import annotations

import compileall
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from typing import IO

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Set in the side run: a testbed built there is a test that lacks its marker (nfshunt_testbed.machine).
SIDE_ENV = "NFSHUNT_SIDE_RUN"
BESIDE_NICENESS = 10
BESIDE = ("second", "third")  # the testbeds beside the first, each run by its marker `<which>_bed`
STOP_GRACE = 60.0  # seconds an interrupted run gets to tear its testbed down


def _second_machine() -> list[str]:
    """The prefix that runs the second testbed's tests on a machine of their own; none where
    namespaces cannot be made (not root: those tests skip anyway)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return []
    return [sys.executable, os.path.join(REPO, "mininet", "own_machine.py")]


@dataclass
class Run:
    title: str
    proc: subprocess.Popen[bytes]
    out: IO[str] | None  # None: shown as it comes
    stop: signal.Signals  # what ends it as Ctrl-C would: pytest tears its testbed down on SIGINT,
                          # own_machine.py passes SIGTERM on into its namespaces


def _wait_or_kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _cpu_seconds(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def _machine_times() -> tuple[float, float]:
    """(all, idle) jiffies of the machine since boot (/proc/stat's first line)."""
    with open("/proc/stat") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]  # idle + iowait


def _bytecode_cache(directory: str) -> dict[str, str]:
    """The runs' environment with one bytecode cache of their own in `directory`, NFShunt's
    and the testbed's modules compiled into it (see the module's docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = directory
    sys.pycache_prefix = directory  # (compileall writes where the interpreter would look)
    for package in ("nfshunt", "mininet", "bench"):
        compileall.compile_dir(os.path.join(REPO, package), quiet=1, workers=0)
    return env


def main(extra: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *extra, "-v"]
    runs: list[Run] = []
    with ExitStack() as stack:
        base = _bytecode_cache(stack.enter_context(tempfile.TemporaryDirectory(prefix="nfshunt-bytecode-")))

        def start(title: str, argv: list[str], env: dict[str, str] | None = None, shown: bool = False,
                  stop: signal.Signals = signal.SIGINT) -> None:
            out = None if shown else stack.enter_context(tempfile.TemporaryFile("w+"))
            proc = subprocess.Popen(argv, stdout=out, stderr=None if shown else subprocess.STDOUT,
                                    env=dict(base, **(env or {})))
            runs.append(Run(title, proc, out, stop))
        start("the testbed tests", [*pytest, "-m", " and not ".join(["testbed", *(f"{w}_bed" for w in BESIDE)])],
              shown=True)
        machine = _second_machine()
        for which in BESIDE:
            start(f"the tests on a {which} testbed, on a machine of their own (run alongside)",
                  ["nice", "-n", str(BESIDE_NICENESS), *machine, *pytest, "-m", f"{which}_bed"],
                  stop=signal.SIGTERM if machine else signal.SIGINT)
        start("the tests that need no testbed (run alongside)",
              ["nice", "-n", str(BESIDE_NICENESS), *pytest, "-m", "not testbed"], {SIDE_ENV: "1"})

        def stop(_signum: int, _frame: object) -> None:
            """SIGTERM (a CI's timeout): every run stopped as Ctrl-C would stop it."""
            for run in runs:
                if run.proc.poll() is None:
                    run.proc.send_signal(run.stop)
        signal.signal(signal.SIGTERM, stop)
        machine_at_start = _machine_times()
        try:
            codes, cpu = [], []
            for run in runs:  # a run's CPU: what reaping it adds to the children's usage
                before = _cpu_seconds(resource.getrusage(resource.RUSAGE_CHILDREN))
                codes.append(run.proc.wait())
                cpu.append(_cpu_seconds(resource.getrusage(resource.RUSAGE_CHILDREN)) - before)
        except KeyboardInterrupt:  # Ctrl-C reached every run with the process group: each tears down
            for run in runs:
                _wait_or_kill(run.proc)
            raise
        for run in runs:
            if run.out is not None:
                run.out.seek(0)
                print(f"\n=== {run.title} ===", flush=True)
                sys.stdout.write(run.out.read())
    (total, idle), (total0, idle0) = _machine_times(), machine_at_start
    # Whether the runs side by side wait or compete for the cores (daemons that detach, such
    # as the first testbed's Open vSwitch, are in the idle share only).
    names = ["testbed run", *(f"{w} testbed" for w in BESIDE), "the rest"]
    idle_share = 100 * (idle - idle0) / max(1, total - total0)
    print("\nCPU (user+sys, s): {}; the machine {:.0f} % idle meanwhile".format(
        "; ".join(f"{n} {c:.0f}" for n, c in zip(names, cpu, strict=True)), idle_share))
    print("exit status: {}".format("; ".join(f"{n} {c}" for n, c in zip(names, codes, strict=True))))
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
