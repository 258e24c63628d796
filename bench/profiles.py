"""Where the controller's time goes during a benchmark (issue 41.4): py-spy samples the
controller process from outside (every thread, no change to the program measured) while the
benchmark's load runs, and the samples are summed per stage of a shunt.

A sample's stage is that of the innermost frame a rule names (CATEGORIES, in order), so a
log line written from the decision counts as logging, a flow-mod packed by os-ken for the
flow builder counts as the flow build. py-spy leaves out the samples of an idle thread
(waiting in epoll, on a lock), so the shares are of the time the controller was working;
but a thread woken many times a second (the event loop's queue under a burst) is often
caught in the wait it is leaving, counted apart as "woken from a wait" (10-20 % of a quick
burst's samples), not as the work of the frame that waited.

    python bench/profiles.py SAMPLES.txt   # the table of a raw py-spy record
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

SAMPLE_RATE = 250  # a second; py-spy's default is 100, a burst lasts a few seconds
# A frame of py-spy's raw (collapsed) output: "function (path/to/file.py:line)".
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")


@dataclass(frozen=True)
class Rule:
    category: str
    file: str  # a part of the frame's file path
    func: str = ""  # a prefix of the function's name ("" any)


WOKEN = "woken from a wait"
# Innermost first wins; within a file, a function rule before the file's catch-all.
CATEGORIES: tuple[Rule, ...] = (
    Rule(WOKEN, "threading.py", "Condition.wait"),
    Rule("logging", "/logging/"),
    Rule("logging", "nfshunt/observe/logs.py"),
    Rule("metrics", "prometheus_client/"),
    Rule("metrics", "nfshunt/observe/metrics.py"),
    Rule("conntrack requests", "nfshunt/kernel/codec.py", "delete_message"),
    Rule("conntrack requests", "nfshunt/kernel/codec.py", "liberal_message"),
    Rule("conntrack requests", "nfshunt/kernel/codec.py", "timeout_message"),
    Rule("conntrack requests", "nfshunt/kernel/codec.py", "restore_message"),
    Rule("conntrack requests", "nfshunt/kernel/codec.py", "mark_update_message"),
    Rule("netlink parse", "nfshunt/kernel/codec.py"),
    Rule("netlink parse", "nfshunt/kernel/listener.py"),
    Rule("conntrack requests", "nfshunt/kernel/worker.py"),
    Rule("conntrack requests", "nfshunt/kernel/table.py"),
    Rule("flow build", "nfshunt/openflow/flows.py"),
    Rule("flow build", "nfshunt/openflow/templates.py"),
    Rule("flow build", "os_ken/ofproto/", "serialize"),
    Rule("flow build", "os_ken/ofproto/", "_serialize"),
    Rule("switch replies", "os_ken/ofproto/"),
    Rule("send", "nfshunt/openflow/session.py"),
    Rule("send", "nfshunt/openflow/channel.py"),
    Rule("send", "os_ken/controller/controller.py", "send"),
    Rule("send", "os_ken/controller/controller.py", "_send"),
    Rule("switch replies", "os_ken/controller/"),
    Rule("switch replies", "nfshunt/switch/replies.py"),
    Rule("switch replies", "nfshunt/openflow/inflight.py"),
    Rule("switch replies", "nfshunt/openflow/stats.py"),
    Rule("switch replies", "nfshunt/openflow/reads.py"),
    Rule("decision", "nfshunt/core/"),
    Rule("decision", "nfshunt/records/"),
    Rule("dispatch", "nfshunt/switch/"),
    Rule("dispatch", "nfshunt/app/"),
    Rule("event loop", "eventlet/"),
    Rule("event loop", "greenlet"),
)
OTHER = "other"


def frames(stack: str) -> list[tuple[str, str]]:
    """(function, file) of each frame of one collapsed stack, outermost first."""
    out = []
    for part in stack.split(";"):
        m = _FRAME.match(part.strip())
        out.append((m["func"], m["file"]) if m else (part.strip(), ""))
    return out


def category(stack: list[tuple[str, str]]) -> str:
    for func, file in reversed(stack):
        for rule in CATEGORIES:
            if rule.file in file and func.startswith(rule.func):
                return rule.category
    return OTHER


@dataclass
class Profile:
    samples: int
    by_category: Counter[str]
    by_function: Counter[str]  # the innermost frame ("function (file)"): where the CPU was


def summarise(raw: str) -> Profile:
    """py-spy's raw output (one "stack count" a line) summed per category and per function."""
    by_category: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not stack_text or not count_text.isdigit():
            continue
        count = int(count_text)
        stack = frames(stack_text)
        total += count
        by_category[category(stack)] += count
        func, file = stack[-1]
        by_function[f"{func} ({_short(file)})"] += count
    return Profile(total, by_category, by_function)


def _short(path: str) -> str:
    for root in ("nfshunt/", "os_ken/", "eventlet/", "prometheus_client/", "logging/", "pyroute2/"):
        at = path.find(root)
        if at >= 0:
            return path[at:]
    return os.path.basename(path)


def table(profile: Profile, top: int = 15) -> list[str]:
    """Markdown: the share of each category, then the busiest functions."""
    if not profile.samples:
        return ["(no samples: the controller did not work while it was sampled)"]
    lines = [f"{profile.samples:,} samples of the controller at work ({SAMPLE_RATE}/s).", "",
             "| stage | samples | share |", "|---|---|---|"]
    for name, n in profile.by_category.most_common():
        lines.append(f"| {name} | {n:,} | {100 * n / profile.samples:.1f} % |")
    lines += ["", "| function (innermost frame) | samples | share |", "|---|---|---|"]
    for name, n in profile.by_function.most_common(top):
        lines.append(f"| `{name}` | {n:,} | {100 * n / profile.samples:.1f} % |")
    return lines


@contextlib.contextmanager
def sampled(pid: int, out_path: str | None) -> Iterator[None]:
    """py-spy records `pid` while the block runs, into out_path (raw); nothing if None."""
    if out_path is None:
        yield
        return
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        raise RuntimeError("--profile needs py-spy (pip install py-spy; make deps installs it)")
    proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", str(SAMPLE_RATE), "--format", "raw",
                             "--output", out_path, "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # attached before the load starts (it samples from its first second)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes its samples on Ctrl-C
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if not os.path.exists(out_path):
            raise RuntimeError(f"py-spy wrote no samples: {err.strip()[-500:]}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    with open(argv[0]) as fh:
        print("\n".join(table(summarise(fh.read()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
