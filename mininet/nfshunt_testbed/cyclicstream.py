"""The cyclic UDP stream of the `jitter` experiment: cyclic.c on the testbed's hosts, and
the one-way delay statistics of the paper it follows (Wüsteney et al., "Impact of Packet
Filtering on Time-Sensitive Networking Traffic").

Timestamps: the sender stamps each frame with CLOCK_REALTIME just before sendto(); the
receiver takes the kernel's receive stamp (SO_TIMESTAMPNS, CLOCK_REALTIME, set when the
frame entered h2's network stack). The hosts are network namespaces of one kernel, so the
two stamps read the same clock (resolution 1 ns, clock_getres); the delay includes the
sender's own stack, both veth hops, Open vSwitch and (on the slow path) the firewall's
bridge and iptables, but not the receiver's wake-up (a user-space receive stamp is kept
beside it for that).
"""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from .bed import TestbedError
from .linkemu import build_program, stop_process

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mininet/: cyclic.c
CYCLIC_SRC = os.path.join(HERE, "cyclic.c")
CYCLIC_BIN = os.path.join(os.path.dirname(HERE), "build", "cyclic")
FRAME_BYTES = 512      # the paper's frame: Ethernet 14 + IPv4 20 + UDP 8 + 470 bytes of payload
# What cyclic.c's receiver writes per frame: sequence number, send stamp, kernel and user receive stamps (ns).
RECORD = np.dtype([("seq", "<u8"), ("tx", "<u8"), ("rx_kernel", "<u8"), ("rx_user", "<u8")])


def build_cyclic() -> str:
    """Compile cyclic.c once (gcc; scripts/install-deps.sh calls this)."""
    return build_program(CYCLIC_SRC, CYCLIC_BIN)


@dataclass(frozen=True)
class SenderReport:
    """cyclic.c's closing line: what was sent and how late its wake-ups were (the source's own jitter)."""
    sent: int
    errors: int
    wake_late_median_ns: int
    wake_late_p999_ns: int
    wake_late_max_ns: int
    wake_late_over_cycle: int
    clock_res_ns: int
    sport: int  # the stream's source port

    @classmethod
    def parse(cls, line: str) -> "SenderReport":
        values = dict(part.split("=", 1) for part in line.split() if "=" in part)
        missing = [f.name for f in fields(cls) if f.name not in values]
        if missing:
            raise ValueError(f"cyclic sender report lacks {missing}: {line!r}")
        return cls(**{f.name: int(values[f.name]) for f in fields(cls)})


@dataclass(frozen=True)
class DelayStats:
    """One-way delay of the frames sent in a window, in µs. Jitter as the paper defines it:
    the larger distance of the minimum or the maximum from the mean."""
    frames: int
    lost: int
    unstamped: int         # frames without a kernel receive stamp (not in the delays)
    late: int              # frames later than one cycle
    min_us: float
    q1_us: float
    median_us: float
    mean_us: float
    q3_us: float
    p999_us: float
    max_us: float
    jitter_us: float
    user_median_us: float  # the same frames stamped by the receiving program after its wake-up

    def row(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def nearest_rank(sorted_values: np.ndarray, q: float) -> float:
    """The q-quantile (0..1) by the nearest-rank method: a value that was measured."""
    k = max(0, int(np.ceil(q * len(sorted_values))) - 1)
    return float(sorted_values[min(k, len(sorted_values) - 1)])


def delay_stats(records: np.ndarray, cycle_us: float, start_ns: int, end_ns: int) -> DelayStats:
    """Statistics of the frames sent in [start_ns, end_ns] (CLOCK_REALTIME). Lost frames are
    the sequence numbers missing between the window's first and last received frame."""
    win = records[(records["tx"] >= start_ns) & (records["tx"] <= end_ns)]
    if len(win) == 0:
        raise ValueError("no frame of the stream was received in the measurement window")
    seqs = np.unique(win["seq"])
    lost = int(seqs[-1] - seqs[0] + 1 - len(seqs))
    stamped = win[win["rx_kernel"] > 0]
    if len(stamped) == 0:
        raise ValueError("no received frame carries a kernel receive stamp (SO_TIMESTAMPNS)")
    delays = np.sort((stamped["rx_kernel"].astype(np.int64) - stamped["tx"].astype(np.int64)) / 1000.0)
    user = (win["rx_user"].astype(np.int64) - win["tx"].astype(np.int64)) / 1000.0
    mean = float(delays.mean())
    return DelayStats(
        frames=len(win), lost=lost, unstamped=len(win) - len(stamped), late=int((delays > cycle_us).sum()),
        min_us=float(delays[0]), q1_us=nearest_rank(delays, 0.25), median_us=float(np.median(delays)),
        mean_us=mean, q3_us=nearest_rank(delays, 0.75), p999_us=nearest_rank(delays, 0.999),
        max_us=float(delays[-1]), jitter_us=max(mean - float(delays[0]), float(delays[-1]) - mean),
        user_median_us=float(np.median(user)))


class CyclicStream:
    """One cyclic stream h1 -> h2 on a testbed: the receiver on h2, the sender on h1, both
    at real-time priority, until stop(). Both are the testbed's processes (spawn): a
    testbed that stops kills them."""

    def __init__(self, tb: Any, dst: str, port: int, cycle_us: int, max_seconds: float, path: str,
                 sport: int = 0):
        self.tb, self.path, self.cycle_us = tb, path, cycle_us
        binary = build_cyclic()
        self.receiver = tb.spawn(tb.h2, binary, "recv", "--port", str(port), "--out", path, "--rt",
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._ready(self.receiver, "receiver")
        count = int(max_seconds * 1e6 / cycle_us)
        self.sender = tb.spawn(tb.h1, binary, "send", "--dst", dst, "--port", str(port), "--cycle-us",
                               str(cycle_us), "--count", str(count), "--size", str(FRAME_BYTES),
                                 *(("--sport", str(sport)) if sport else ()), "--rt",
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._ready(self.sender, "sender")

    def _ready(self, proc: subprocess.Popen, what: str) -> None:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("ready"):
            self.stop_quietly()
            err = proc.stderr.read() if proc.stderr else ""
            raise TestbedError(f"cyclic {what} did not start: {line.strip()} {err.strip()}")

    def stop_quietly(self) -> None:
        for proc in (getattr(self, "sender", None), self.receiver):
            if proc is not None:
                stop_process(proc, timeout=2)

    def stop(self, drain: float = 0.2) -> tuple[SenderReport, np.ndarray, str]:
        """Stop the sender, let the last frames arrive, stop the receiver; (the sender's
        report, the receiver's records, what either said on stderr: SCHED_FIFO refused ...)."""
        stop_process(self.sender)
        out, err = self.sender.communicate()
        time.sleep(drain)  # the frames still in the switch or the firewall
        stop_process(self.receiver)
        _, rerr = self.receiver.communicate()
        lines = [ln for ln in out.splitlines() if "sent=" in ln]
        if not lines:
            raise TestbedError(f"cyclic sender ended without its report: {out.strip()} {err.strip()}")
        return SenderReport.parse(lines[-1]), np.fromfile(self.path, dtype=RECORD), (err + rerr).strip()
