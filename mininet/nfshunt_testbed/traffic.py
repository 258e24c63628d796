"""Traffic on the testbed: iperf3 transfers h1 -> h2 (in the foreground or the background)
and what their results say, and conngen.py's many held-open connections."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any, Callable

from mininet.node import Host

from .topology import H2_IP, HERE, PYTHON, REPO, TestbedError, Topology

# Transfers whose stalls a test measures run paced: the userspace switch forwards on the CPU
# the hosts and daemons share, and two unpaced transfers (about 300 Mbit/s each) lost 2-3 %
# of their segments in the switch alone (measured on the 2-core VM); one more loss while a
# failover or policy change loads the CPU chains TCP's RTO backoff (0.2 + 0.4 + 0.8 s) past
# 1 s. At 100 Mbit/s the switch loses under 1 %.
STEADY_RATE = "100M"


# What iperf3 (3.12) writes into the receiver's report when the sender stops early: it is not a
# failure. Having written the first, the receiver closes the streams, and its interval timer,
# run in the same turn of its loop, may still read a closed stream's TCP_INFO (save_tcpinfo) and
# add the second under the same key (iperf_server_api.c; seen in one of six runs of a routed
# test, and in test_forged_close on a loaded suite run).
STOPPED = "the client has terminated"
STOPPED_LATE_READ = "getsockopt - Bad file descriptor"


def stopped_report(out: str) -> dict[str, Any]:
    """A stopped transfer's receiver report (iperf3's JSON) in finish_transfer's shape, or
    {"error": ...} naming each error it holds beyond the stop's own."""
    errors: list[str] = []

    def keep_errors(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        errors.extend(value for key, value in pairs if key == "error")  # (json.loads keeps only the last)
        return dict(pairs)
    if not out or not out.strip():
        return {"error": "no output"}
    try:
        report = json.loads(out, object_pairs_hook=keep_errors)
    except json.JSONDecodeError:
        return {"error": "unreadable iperf3 output"}
    beyond = [e for e in errors if e not in (STOPPED, STOPPED_LATE_READ)]
    if beyond or (errors and STOPPED not in errors):
        return {"error": "; ".join(beyond or errors)}
    return {"server_output_json": report, "end": report.get("end", {})}


class Traffic(Topology):

    # --- servers --------------------------------------------------------------------------

    def listening(self, node: Host, port: int) -> bool:
        """Whether a TCP socket listens on `port` in the node (its /proc/net/tcp, tcp6)."""
        want = f":{port:04X}"
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in self.run(node, "cat", table, check=False).splitlines()[1:]:
                f = line.split()
                if len(f) > 3 and f[1].endswith(want) and f[3] == "0A":
                    return True
        return False

    def iperf_server(self, port: int, interval: float | None = None, node: Host | None = None,
                     report: bool = False) -> subprocess.Popen:
        """A one-off iperf3 server on h2 (or `node`; JSON output, on its stdout with `report`),
        returned once it listens."""
        extra = ["-i", str(interval)] if interval else []
        node = node or self.h2
        srv = self.spawn(node, "iperf3", "-s", "-1", "-J", "-p", str(port), *extra,
                         stdout=subprocess.PIPE if report else subprocess.DEVNULL)
        try:
            self.wait_for(lambda: srv.poll() is not None or self.listening(node, port), 10,
                          f"iperf3 server on port {port}", interval=0.02)
        except BaseException:
            srv.kill()
            raise
        if srv.poll() is not None:
            raise TestbedError(f"iperf3 server on port {port} exited ({srv.returncode})")
        return srv

    def conn_server(self, port: int, node: Host | None = None) -> subprocess.Popen:
        """conngen.py's echo server for many connections, on h2 (or another host)."""
        srv = self.spawn(node or self.h2, PYTHON, os.path.join(HERE, "conngen.py"), "serve", str(port),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = srv.stdout.readline() if srv.stdout else ""
        if not line.startswith("listening"):
            srv.kill()
            raise TestbedError(f"conngen server did not start: {line}")
        return srv

    # --- many connections -----------------------------------------------------------------

    def open_conns(self, port: int, n: int, cport_base: int | None = None,
                   dst: str = H2_IP, src: Host | None = None) -> tuple[subprocess.Popen, float]:
        """n connections h1 (or src) -> h2 (or dst) held open by conngen.py; (process, epoch
        when all were up). Write "close" to its stdin to close them cleanly."""
        args = [PYTHON, os.path.join(HERE, "conngen.py"), "open", dst, str(port), str(n)]
        if cport_base:
            args += ["--cport-base", str(cport_base)]
        proc = (src or self.h1).popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=self._env(), cwd=REPO)
        self._procs.append(proc)
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("open "):
            proc.kill()
            err = proc.stderr.read() if proc.stderr else ""
            raise TestbedError(f"conngen could not open {n} connections: {line}{err}")
        return proc, float(line.split()[1])

    # --- iperf3 transfers -------------------------------------------------------------------

    def iperf(self, port: int, seconds: float, *, interval: float | None = None, cport: int | None = None,
              udp: bool = False, grace: float = 15, server_output: bool = False,
              watch: Callable[[], Any] | None = None, bitrate: str | None = None) -> dict[str, Any]:
        """An iperf3 transfer h1 -> h2; the parsed JSON, or {"error": ...} (stalled or refused).
        `watch` is called every 0.2 s while it runs (to look at flows before a FIN removes them)."""
        srv = self.iperf_server(port, interval)
        args = ["iperf3", "-c", self.h2_ip, "-p", str(port), "-t", str(seconds), "-J", "--connect-timeout", "5000"]
        if interval:
            args += ["-i", str(interval)]
        if cport:
            args += ["--cport", str(cport)]
        if udp:
            args += ["-u", "-b", bitrate or "200M"]
        elif bitrate:
            args += ["-b", bitrate]
        if server_output:   # the receiver's intervals: what arrived, not what was written
            args += ["--get-server-output"]
        cli = self.spawn(self.h1, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + seconds + grace
        try:
            while watch is not None and cli.poll() is None and time.monotonic() < deadline:
                watch()
                time.sleep(0.2)
            out, _ = cli.communicate(timeout=max(0.1, deadline - time.monotonic()))
            result = json.loads(out) if out.strip() else {"error": "no output"}
        except subprocess.TimeoutExpired:
            cli.kill()
            cli.communicate()
            result = {"error": "stalled"}
        except json.JSONDecodeError:
            result = {"error": "unreadable iperf3 output"}
        finally:
            srv.kill()
            srv.communicate()
        return result

    def start_transfer(self, port: int, seconds: float, interval: float = 0.2, cport: int | None = None,
                       bitrate: str | None = None, src: Host | None = None, server: Host | None = None,
                       dst: str | None = None,
                       server_port: int | None = None) -> tuple[subprocess.Popen, subprocess.Popen]:
        """An iperf3 transfer h1 -> h2 (or src -> server, at address dst; h2's by default) in the background
        (server, client); the receiver's intervals come back with the result (finish_transfer,
        or stop_transfer before its `seconds` are up). The server listens on `server_port` where
        a translation between them (DNAT) moves `port` there."""
        srv = self.iperf_server(server_port or port, interval, node=server, report=True)
        args = ["iperf3", "-c", dst or self.h2_ip, "-p", str(port), "-t", str(seconds), "-J", "-i", str(interval),
                "--get-server-output", "--connect-timeout", "5000"]
        if cport:
            args += ["--cport", str(cport)]
        if bitrate:
            args += ["-b", bitrate]
        return srv, self.spawn(src or self.h1, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    @staticmethod
    def finish_transfer(srv: subprocess.Popen, cli: subprocess.Popen, timeout: float = 40) -> dict[str, Any]:
        """Wait for a start_transfer(); its JSON, or {"error": ...}."""
        try:
            out, _ = cli.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            cli.kill()
            cli.communicate()
            return {"error": "stalled"}
        finally:
            srv.kill()
            srv.communicate()
        try:
            return json.loads(out) if out.strip() else {"error": "no output"}
        except json.JSONDecodeError:
            return {"error": "unreadable iperf3 output"}

    @staticmethod
    def stop_transfer(srv: subprocess.Popen, cli: subprocess.Popen, timeout: float = 20) -> dict[str, Any]:
        """End a start_transfer() now, as Ctrl-C ends iperf3; the receiver's report in
        finish_transfer's shape (its intervals under server_output_json), or {"error": ...}.
        For a transfer started longer than any wait of its test, stopped once the test has
        watched what it needs (watch_until): a fixed length ran on for seconds after a
        quick run's events, and could end before a slow run's."""
        if cli.poll() is None:
            cli.send_signal(signal.SIGINT)
        try:
            out, _ = srv.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # the receiver never heard the end: its control connection is dead
            srv.kill()
            srv.communicate()
            return {"error": "stalled"}
        finally:
            if cli.poll() is None:
                cli.kill()
            cli.communicate()
        return stopped_report(out)

    @staticmethod
    def watch_until(deadline: float) -> None:
        """A stoppable transfer runs on until `deadline` (time.monotonic()): the window after a
        test's last event in which a stall, or a connection that died, shows in its intervals."""
        time.sleep(max(0.0, deadline - time.monotonic()))

    # --- reading results --------------------------------------------------------------------

    @staticmethod
    def longest_stall(result: dict[str, Any], interval: float = 0.2) -> float:
        """The longest run of receiver intervals with no data, in seconds."""
        worst = run = 0
        for iv in result["server_output_json"]["intervals"][:-1]:  # the last interval is partial
            run = run + 1 if iv["sum"]["bytes"] == 0 else 0
            worst = max(worst, run)
        return worst * interval

    @staticmethod
    def iperf_summary(result: dict[str, Any]) -> dict[str, float]:
        """Throughput, retransmits and TCP's mean RTT from an iperf3 result."""
        if "error" in result:
            return {"gbps": 0.0, "retransmits": 0, "mean_rtt_ms": float("nan"), "bytes": 0}
        end = result.get("end", {})
        streams = end.get("streams") or [{}]
        sender = streams[0].get("sender", {})
        return {"gbps": end.get("sum_received", {}).get("bits_per_second", 0.0) / 1e9,
                "retransmits": end.get("sum_sent", {}).get("retransmits", 0),
                "mean_rtt_ms": sender.get("mean_rtt", float("nan")) / 1000,
                "bytes": end.get("sum_received", {}).get("bytes", 0)}
