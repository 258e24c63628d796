"""Link emulation for the testbed: delay, link rate, and a slow path that behaves like a CPU firewall.

Delay, as in the thesis, is half the requested RTT on each end host, by one of two mechanisms
behind the one option:

  netem    where the kernel has it: a netem qdisc on the host's egress (queue limit 100,000
           packets, as in the thesis), under the link-rate tbf when there is one;
  nfqueue  where it has not (these build machines): iptables sends the packets a host
           *receives* to an NFQUEUE queue, and `nfqdelay` (mininet/nfqdelay.c) holds each one
           for the delay before accepting it. Ingress rather than egress because a packet held
           on egress stays charged to the sending socket, and TCP Small Queues would then cap
           the sender at tcp_limit_output_bytes per delay; on ingress nothing is charged.

Link rate: a tbf on each host's egress, so the sender, not Open vSwitch's userspace
datapath, is the bottleneck (that datapath drops packets when pushed past what two cores
can forward). The slow path: a tbf with a buffer on both bridge ports' egress in the
firewall node. A firewall forwards at a limited rate from a finite input buffer; TCP's
line-rate bursts overflow it, which is the loss the thesis measured on the Cisco firewall
and that the fast path avoids. The thesis set-up's 4 MB per direction (36 ms at 900 Mbit/s)
was calibrated to its firewall's loss: 0 % at 0 ms and 0.16-0.18 % at 100 ms RTT
measured here (3 runs each), 0.05 % and 0.10 % in the thesis; 64 KB lost 2-9 %.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import subprocess
from dataclasses import dataclass
from typing import Callable

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mininet/: nfqdelay.c
REPO = os.path.dirname(HERE)
NFQDELAY_SRC = os.path.join(HERE, "nfqdelay.c")
NFQDELAY_BIN = os.path.join(REPO, "build", "nfqdelay")
DELAY_MECHANISMS = ("auto", "netem", "nfqueue")
NETEM_LIMIT = 100_000
NFQUEUE_NUM = 7
RTT_TOLERANCE = 0.05          # refuse to run when the measured RTT is more than 5 % off
RTT_FLOOR_MS = 2.0            # ... or, for small requests, more than the path's own ~1-2 ms RTT


class EmulationError(RuntimeError):
    pass


@dataclass(frozen=True)
class Emulation:
    """What the testbed emulates. The defaults are the plain testbed: no delay, no shaping."""
    rtt_ms: float = 0.0
    delay: str = "auto"              # auto | netem | nfqueue
    link_mbit: float | None = None   # rate of each host's link (None: unshaped)
    mtu: int = 1500
    slow_mbit: float | None = None   # firewall forwarding rate (None: unshaped)
    slow_buffer_kb: int = 256        # firewall input buffer, per direction
    tune_hosts: bool = False         # thesis host tuning: txqueuelen, big TCP buffers

    def __post_init__(self) -> None:
        if self.delay not in DELAY_MECHANISMS:
            raise EmulationError(f"delay mechanism must be one of {DELAY_MECHANISMS}, not {self.delay!r}")
        if not 0 <= self.rtt_ms <= 10_000:
            raise EmulationError(f"rtt_ms must be between 0 and 10000, not {self.rtt_ms}")
        if not 576 <= self.mtu <= 9000:
            raise EmulationError(f"mtu must be between 576 and 9000, not {self.mtu}")
        for name in ("link_mbit", "slow_mbit"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise EmulationError(f"{name} must be positive")
        if self.slow_buffer_kb <= 0:
            raise EmulationError("slow_buffer_kb must be positive")

    @classmethod
    def thesis(cls, rtt_ms: float = 0.0, delay: str = "auto", link_mbit: float = 1000,
               slow_mbit: float = 900, slow_buffer_kb: int = 4096) -> "Emulation":
        """The thesis set-up scaled to this class of machine: jumbo frames, tuned hosts,
        1 Gbit/s links instead of 10 (a 2-core userspace switch forwards ~1-4 Gbit/s)."""
        return cls(rtt_ms=rtt_ms, delay=delay, link_mbit=link_mbit, mtu=9000, slow_mbit=slow_mbit,
                   slow_buffer_kb=slow_buffer_kb, tune_hosts=True)


Runner = Callable[..., str]   # Testbed.run(node, *args, check=..., timeout=...)


def build_program(src: str, binary: str, libs: tuple[str, ...] = ()) -> str:
    """Compile one C file of mininet/ into build/ unless the binary is newer than its source."""
    if os.path.exists(binary) and os.path.getmtime(binary) >= os.path.getmtime(src):
        return binary
    name = os.path.basename(binary)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise EmulationError(f"no C compiler to build {name} (apt-get install gcc)")
    os.makedirs(os.path.dirname(binary), exist_ok=True)
    tmp = binary + ".tmp"
    proc = subprocess.run([cc, "-O2", "-Wall", "-o", tmp, src, *libs], capture_output=True, text=True)
    if proc.returncode != 0:
        raise EmulationError(f"building {name} failed:\n{proc.stderr}")
    os.replace(tmp, binary)
    return binary


def build_nfqdelay() -> str:
    """Compile nfqdelay once (gcc + libnetfilter-queue-dev, installed by scripts/install-deps.sh)."""
    if not os.path.exists("/usr/include/libnetfilter_queue/libnetfilter_queue.h"):
        raise EmulationError("libnetfilter_queue headers missing (apt-get install libnetfilter-queue-dev)")
    return build_program(NFQDELAY_SRC, NFQDELAY_BIN, ("-lnetfilter_queue", "-lnfnetlink"))


def netem_available(node) -> bool:
    """Try a netem qdisc on the node's loopback: the only reliable test for the module."""
    def tc(*args: str) -> int:
        return node.popen(["tc", "qdisc", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait()
    if tc("add", "dev", "lo", "root", "netem", "delay", "1ms") != 0:
        return False
    tc("del", "dev", "lo", "root")
    return True


def choose_delay_mechanism(requested: str, node) -> str:
    if requested == "nfqueue":
        return "nfqueue"
    if netem_available(node):
        return "netem"
    if requested == "netem":
        raise EmulationError("netem was requested but this kernel has no netem qdisc (sch_netem)")
    return "nfqueue"


def tune_host(run: Runner, node, intf: str, emu: Emulation) -> None:
    run(node, "ip", "link", "set", intf, "mtu", str(emu.mtu))
    if emu.tune_hosts:
        run(node, "ip", "link", "set", intf, "txqueuelen", "10000")
        # Table 4.2 of the thesis: buffers for > 400 ms at line rate.
        for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
            run(node, "sysctl", "-qw", f"{key}=4096 87380 524288000")


def shape_host_egress(run: Runner, node, intf: str, emu: Emulation, half_delay_ms: float,
                      mechanism: str) -> None:
    """Root qdisc of a host's link: tbf for the link rate, netem (when chosen) beneath it."""
    netem = ["netem", "delay", f"{half_delay_ms}ms", "limit", str(NETEM_LIMIT)]
    use_netem = mechanism == "netem" and half_delay_ms > 0
    if emu.link_mbit:
        burst = max(4 * emu.mtu, 64 * 1024)
        run(node, "tc", "qdisc", "replace", "dev", intf, "root", "handle", "1:", "tbf",
            "rate", f"{emu.link_mbit}mbit", "burst", str(burst), "limit", str(64 * 1024 * 1024))
        if use_netem:
            run(node, "tc", "qdisc", "add", "dev", intf, "parent", "1:1", "handle", "10:", *netem)
    elif use_netem:
        run(node, "tc", "qdisc", "replace", "dev", intf, "root", *netem)


def nfqueue_rules(intf: str, add: bool) -> list[list[str]]:
    op = "-A" if add else "-D"
    return [[tool, "-w", "5", "-t", "mangle", op, "PREROUTING", "-i", intf, "-j", "NFQUEUE",
             "--queue-num", str(NFQUEUE_NUM)] for tool in ("iptables", "ip6tables")]


def start_nfqdelay(node, half_delay_ms: float) -> subprocess.Popen:
    binary = build_nfqdelay()
    proc = node.popen([binary, "--queue", str(NFQUEUE_NUM), "--delay-ms", str(half_delay_ms),
                       "--maxlen", str(NETEM_LIMIT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("ready"):
        proc.kill()
        _, err = proc.communicate()
        raise EmulationError(f"nfqdelay did not start in {node.name}: {err.strip() or line.strip()}")
    # The delay is the wire's: it runs at the machine's ordinary priority even where the
    # testbed's run has a lower one (`make test`'s runs beside the first testbed): there,
    # under the load of the others, the experiments' 100 ms RTT measured 118.5 and 132 ms
    # and they rightly refused to run. (Above every ordinary process, SCHED_FIFO, it took the
    # switch's CPU under a full-rate transfer: TCP's RTT over a 60 ms path rose to 90-126 ms.)
    os.setpriority(os.PRIO_PROCESS, proc.pid, 0)
    return proc


def stop_process(proc: subprocess.Popen, timeout: float = 5, sig: int = signal.SIGTERM) -> int:
    """Signal a process (SIGTERM by default), kill it if it outlives `timeout`; its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def shape_slow_path(run: Runner, fw, intfs: tuple[str, ...], emu: Emulation) -> None:
    """Both directions through the bridge: each bridge port's egress gets the firewall's rate and buffer."""
    for intf in intfs:
        run(fw, "ip", "link", "set", intf, "mtu", str(emu.mtu))
    run(fw, "ip", "link", "set", "br0", "mtu", str(emu.mtu))
    if not emu.slow_mbit:
        return
    for intf in intfs:
        run(fw, "tc", "qdisc", "replace", "dev", intf, "root", "tbf", "rate", f"{emu.slow_mbit}mbit",
            "burst", str(max(2 * emu.mtu, 16 * 1024)), "limit", str(emu.slow_buffer_kb * 1024))


_PING_TIME = re.compile(r"time=([0-9.]+) ms")


def measure_rtt(run: Runner, src, dst_ip: str, count: int = 8) -> float:
    """Median ICMP RTT in ms; the first reply (ARP resolution) is not counted."""
    # -U: user-to-user time. Without it ping uses the kernel receive timestamp, taken before
    # an ingress (NFQUEUE) delay, and would see only half the emulated RTT. -i 0.02: each
    # ping is timed on its own, so they need not wait for each other (the same medians as
    # at 0.2 s, measured at 0 and 100 ms RTT; 0.3 s for the check instead of 1.7 s).
    out = run(src, "ping", "-n", "-U", "-c", str(count + 1), "-i", "0.02", "-W", "5", dst_ip, check=False,
              timeout=30 + count * 6)
    times = [float(t) for t in _PING_TIME.findall(out)][1:]
    if len(times) < count // 2:
        raise EmulationError(f"RTT measurement failed: {len(times)} of {count} pings answered")
    return statistics.median(times)


def rtt_within(requested_ms: float, measured_ms: float) -> bool:
    return abs(measured_ms - requested_ms) <= max(RTT_TOLERANCE * requested_ms, RTT_FLOOR_MS)


def check_rtt(requested_ms: float, measured_ms: float) -> None:
    allowed = max(RTT_TOLERANCE * requested_ms, RTT_FLOOR_MS)
    if not rtt_within(requested_ms, measured_ms):
        raise EmulationError(f"measured RTT {measured_ms:.2f} ms is more than {allowed:.2f} ms away from "
                             f"the requested {requested_ms:g} ms; refusing to run")
