"""Fail secure and keep working, on the real testbed (Open vSwitch userspace datapath,
Linux bridge, iptables, conntrack, OpenFlow 1.3): controller crash and restart, switch
restart and control-link loss, lost netlink events, a full flow table, TCP teardown,
policy changes, and shutdown signals. Each test asserts on flows, counters, conntrack and
the hosts' transfers."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from nfshunt.config.reload import LIVE
from tests.beds import Bed

pytestmark = [pytest.mark.integration, pytest.mark.testbed]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHUNT, BLOCK, IGNORE = 5201, 5202, 5203


BASE = {"default_shunt_timeout": 3, "default_block_timeout": 3}
TESTBED = Bed(config=BASE)


def controller_config(fresh_start=False, **overrides):
    """The test's controller config beyond BASE, which the fresh fixture sets up before it
    (fresh_start: by a restart in any case, for a test that counts from a controller's start)."""
    def mark(test):
        test.controller_config = (overrides, fresh_start)
        return test
    return mark


def _running(tb):
    return tb.controller is not None and tb.controller.poll() is None


@pytest.fixture
def fresh(request, tb):
    """Each test starts with the module's controller running with the config it asks for
    (controller_config; BASE otherwise) and without the earlier tests' flows. A restart
    (about 2 s) only when the controller is gone, a key it cannot reload differs or the test
    asks for one; after a test, a flush instead of waiting for its flows to idle out."""
    overrides, fresh_start = getattr(request.function, "controller_config", ({}, False))
    want = {**BASE, **overrides}
    changed = {k for k in {**want, **tb.extra_config} if want.get(k) != tb.extra_config.get(k)}
    if fresh_start or not _running(tb) or changed - set(LIVE):
        tb.extra_config.clear()
        tb.reconfigure(**want)  # its start deletes every flow
        # A pair the new controller made again for the last packets of an earlier test's
        # connections, which then fell silent, would hold until its idle timeout (30 s under
        # some tests' configs, past the 20 s wait: once, on a loaded machine, after the crash
        # test): handed back instead, as after a test.
        tb.control({"cmd": "flush", "reason": "the previous test's leftovers"})
        wait_flows_gone(tb, (SHUNT, BLOCK))  # (one that a connection still sending got again)
    elif changed:
        tb.reload_config(**{k: want.get(k) for k in changed})
    yield tb
    if fresh_start and _running(tb):
        # A burst's hundreds of pairs, under a config made for the burst (a tiny netlink
        # buffer: a flush's hand-backs overflow it again): left with the switch cleared
        # instead (a flush left 300 pairs re-shunted for 20 s once in CI).
        _leave_the_pairs(tb)
    if _running(tb):  # else the next test's restart clears the switch
        tb.control({"cmd": "flush", "reason": "the previous test's leftovers"})
        wait_flows_gone(tb, (SHUNT, BLOCK))


def wait_flows_gone(tb, ports, timeout=20):
    """The test's per-connection flows gone from the switch. On a timeout the failure says
    which flows remained, what the controller holds of them (its state for each) and what
    conntrack tracks on those ports, so a lingering pair can be told from a slow take-down."""
    try:
        tb.wait_for(lambda: not any(tb.conn_flows(p) for p in ports), timeout, "flows from the test to go")
    except Exception as exc:
        left = [f for p in ports for f in tb.conn_flows(p)]
        try:
            held = [c for c in status(tb)["connections"] if c["tuple"].rsplit(":", 1)[-1] in map(str, ports)]
        except Exception as err:  # the controller may be what failed
            held = f"no status: {err}"
        tracked = [e for e in tb.conntrack() if e["dport"] in ports or e["sport"] in ports]
        raise AssertionError(f"{exc}\nflows left: {left}\ncontroller's pairs: {held}\nconntrack: {tracked}") from exc


def status(tb):
    return tb.control({"cmd": "status"})


def counter(tb, name):
    return status(tb)["counters"].get(name, 0)


def shunt_flows(tb, port=SHUNT):
    return [f for f in tb.conn_flows(port) if int(f["cookie"], 16) >> 48 & 0xFF == 2]


def start_iperf(tb, port, seconds, interval=0.2, bitrate=None):
    return tb.start_transfer(port, seconds, interval, bitrate=bitrate)


def finish_iperf(srv, cli, timeout=40):
    from nfshunt_testbed.bed import Testbed
    return Testbed.finish_transfer(srv, cli, timeout)


def longest_stall(result, interval=0.2):
    from nfshunt_testbed.bed import Testbed
    return Testbed.longest_stall(result, interval)


TCP_PAIR = 2  # table-0 entries of a TCP shunt in the pipeline layout (flow_layout auto on Open vSwitch)


def catchers(tb):
    return [f for f in tb.flows() if int(f.get("cookie", "0"), 16) >> 48 == 0x4E04]


def defaults(tb):
    return [f for f in tb.flows() if f.get("cookie") == "0x4e01000000000000"]


# --- controller stops or crashes ------------------------------------------------------------

def test_controller_crash_keeps_flows_and_nothing_unshunted_bypasses(fresh):
    from nfshunt_testbed.traffic import STEADY_RATE
    tb = fresh
    # 3 s: it is watched only until it has moved on without the controller (well under 1 s).
    srv, cli = start_iperf(tb, SHUNT, 3, bitrate=STEADY_RATE)
    try:
        tb.wait_for(lambda: len(shunt_flows(tb)) == 4, 10, "the transfer's shunts")
        tb.stop_controller(signal.SIGKILL)
        assert len(defaults(tb)) == 4
        before = {f["cookie"]: int(f["n_packets"]) for f in shunt_flows(tb)}
        tb.wait_for(lambda: sum(int(f["n_packets"]) for f in shunt_flows(tb)) > sum(before.values()) + 1000, 5,
                    "the shunted transfer to keep flowing on the fast path without a controller")
        # A connection the policy would shunt, and one it ignores, started while the
        # controller is down: both cross the firewall, neither gets a flow.
        slow0 = tb.slow_path_packets()
        r = tb.iperf(IGNORE, 1, bitrate=STEADY_RATE)
        assert "error" not in r and tb.conn_flows(IGNORE) == []
        assert tb.slow_path_packets() - slow0 > 0.9 * r["end"]["sum_sent"]["bytes"] / 9000
        conns, _ = tb.open_conns(SHUNT, 1, cport_base=47000)
        # Decided by the policy (what a running controller acts on within milliseconds),
        # and no flow for it.
        tb.wait_for(lambda: [e for e in tb.conntrack() if e["sport"] == 47000 and e["mark"] & 0x10000000], 5,
                    "the new connection's entry decided by the policy", interval=0.05)
        assert not [f for f in tb.conn_flows(SHUNT) if "47000" in (f.get("tp_src"), f.get("tp_dst"))]
        conns.kill()
    finally:
        result = finish_iperf(srv, cli)
    assert "error" not in result


# --- controller restarts --------------------------------------------------------------------

# A restart that keeps the shunts in the switch (a stop with delete_flows_on_shutdown takes
# them down on purpose; a crash leaves them too). A 30 s shunt timeout: iperf3's idle control
# connection lost its shunt to the 3 s one during a slow restart, before the adopted pairs
# were compared (once in 3 runs on a loaded machine).
@controller_config(delete_flows_on_shutdown=False, default_shunt_timeout=30)
def test_restart_reconciles_without_interrupting_a_shunted_transfer(fresh):
    from nfshunt_testbed.traffic import STEADY_RATE
    tb = fresh
    # Until stopped, 2 s after the restart: the shunts must still be there for the checks on
    # them (the transfer's close takes them down), and a stall across the restart shows.
    srv, cli = tb.start_transfer(SHUNT, 60, bitrate=STEADY_RATE)
    try:
        flows = tb.wait_for(lambda: len(shunt_flows(tb)) == 4 and shunt_flows(tb), 10, "the transfer's shunts")
        cookies_before = {f["cookie"] for f in flows}
        # Old enough that a re-install would show in their age (asserted below).
        tb.wait_for(lambda: min(float(f["duration"].rstrip("s")) for f in shunt_flows(tb)) > 1.0, 5,
                    "the shunts to be over 1 s old")
        tb.stop_controller()
        # What a crash can leave behind beside the live pairs: a half pair of an unknown
        # connection, a lost default.
        tb.ofctl("add-flow", "cookie=0x4e02000000000777,priority=33000,tcp,in_port=1,nw_src=10.0.0.1,"
                             "nw_dst=10.0.0.2,tp_src=1,tp_dst=2,actions=output:3")
        tb.ofctl("del-flows", "--strict", "priority=100,in_port=1")
        assert len(defaults(tb)) == 3
        tb.restart_controller()
        restarted = time.monotonic()
        tb.wait_for_controller()
        tb.wait_for(lambda: len(defaults(tb)) == 4, 2, "the missing default to be re-applied")
        tb.wait_for(lambda: not [f for f in tb.flows() if f.get("cookie") == "0x4e02000000000777"], 2,
                    "the orphan to be removed")
        st = status(tb)
        # The live pairs were adopted from the switch (same cookies, counters not reset);
        # only the orphan was deleted.
        assert {c["ct_id"] for c in st["connections"]} == {int(c, 16) & 0xFFFFFFFF for c in cookies_before}
        assert st["counters"].get("reconcile_deleted", 0) == 1
        after = shunt_flows(tb)
        assert {f["cookie"] for f in after} == cookies_before
        assert min(float(f["duration"].rstrip("s")) for f in after) > 1.0
        tb.watch_until(restarted + 2.0)
    finally:
        result = tb.stop_transfer(srv, cli)
    assert "error" not in result, result.get("error")
    assert longest_stall(result) < 1.0


# --- switch restarts, control link drops ---------------------------------------------------

def _log_has(tb, text, since=0):
    """Reads the controller's log file: never pokes the controller (a status request can
    wake a stuck loop and hide the bug under test)."""
    return text in tb.controller_output()[since:]


def _controller_targets():
    return subprocess.run(["ovs-vsctl", "get-controller", "s1"], capture_output=True, text=True,
                          check=True).stdout.split()


def _restore_reconnect_backoff():
    """The Controller record set-controller makes backs off up to 8 s between attempts
    (Mininet's retries every 1 s), and every later controller restart in the module waited
    up to that long for the switch (a 4 s test took 14 s). Open vSwitch applies a changed
    max_backoff to the connection only when the record changes while the switch is
    connected: called once the switch is back."""
    subprocess.run(["ovs-vsctl", "set", "controller", "s1", "max_backoff=1000"], check=False)


def _reconnected(tb):
    return len(defaults(tb)) == 4 and len(shunt_flows(tb)) == 4 and len(tb.conn_flows(BLOCK)) == 2


# Long timeouts: an idle block that timed out before the drop would come back only with its
# client's next retransmission, not with the switch. A switch that comes back with an empty
# table (a reboot), and one that comes back on a new connection before its old one was seen
# dead: test_fake_core on the rig (the same controller behaviour; 31 s of testbed here).
@controller_config(default_block_timeout=30, default_shunt_timeout=30)
def test_switch_reconnect_brings_defaults_shunts_and_blocks_back_within_2s(fresh):
    from nfshunt_testbed.traffic import STEADY_RATE
    tb = fresh
    # 4 s: the flows are back about 1 s after the start; the transfer (and its shunts, which
    # its close takes down) must outlast that.
    srv, cli = start_iperf(tb, SHUNT, 4, bitrate=STEADY_RATE)
    bsrv = tb.conn_server(BLOCK)
    blocked, _ = tb.open_conns(BLOCK, 1)
    try:
        try:
            tb.wait_for(lambda: len(shunt_flows(tb)) == 4 and len(tb.conn_flows(BLOCK)) == 2, 15,
                        "a shunt and a block")
        except Exception:
            print("flows:", tb.flows(), "\nstatus:", status(tb))
            raise
        controller = _controller_targets()
        mark = len(tb.controller_output())
        # What an admin re-pointing the switch does, or a switch reboot looks like. The
        # controller is not asked anything until the flows are back.
        subprocess.run(["ovs-vsctl", "del-controller", "s1"], check=True)
        tb.wait_for(lambda: _log_has(tb, "disconnected", mark), 2, "the controller to log the switch going",
                    interval=0.05)
        subprocess.run(["ovs-vsctl", "set-controller", "s1", *controller], check=True)
        t0 = time.monotonic()
        tb.wait_for(lambda: _reconnected(tb), 2, "defaults, the shunts and the block back after the reconnect",
                    interval=0.05)
        print(f"\nback {time.monotonic() - t0:.3f} s after set-controller")
        assert all(f["actions"] == "drop" for f in tb.conn_flows(BLOCK))
        assert not _log_has(tb, "refus", mark)
    finally:
        _restore_reconnect_backoff()
        result = finish_iperf(srv, cli)
        blocked.kill()
        bsrv.kill()
    assert "error" not in result


CONTROL_DROP = ["INPUT", "-i", "nfsmgmt1", "-p", "tcp", "--dport", "6653", "-j", "DROP"]


def test_a_silent_control_link_is_noticed_by_echoes_and_shunting_resumes(fresh):
    tb = fresh
    srv = tb.conn_server(SHUNT)
    try:
        tb.wait_for(lambda: len(defaults(tb)) == 4, 5, "defaults")
        mark = len(tb.controller_output())
        # The switch's packets no longer reach the controller, and nothing closes.
        tb.run(tb.fw, "iptables", "-w", "5", "-I", *CONTROL_DROP)
        t0 = time.monotonic()
        tb.wait_for(lambda: _log_has(tb, "disconnected", mark), 2.0, "unanswered echoes to end the connection",
                    interval=0.05)
        print(f"\nsilent link noticed after {time.monotonic() - t0:.3f} s")
        tb.run(tb.fw, "iptables", "-w", "5", "-D", *CONTROL_DROP)
        tb.wait_for(lambda: _log_has(tb, "connected from", mark), 20, "the switch to come back")
        conns, _ = tb.open_conns(SHUNT, 1, cport_base=45001)
        tb.wait_for(lambda: len(_port_flows(tb, 45001)) == TCP_PAIR, 10, "a new connection shunted after the flap")
        conns.kill()
    finally:
        tb.run(tb.fw, "iptables", "-w", "5", "-D", *CONTROL_DROP, check=False)
        srv.kill()


# --- lost netlink events ---------------------------------------------------------------------

@controller_config(fresh_start=True, netlink_rcvbuf=4096, default_shunt_timeout=30)
def test_netlink_overflow_is_detected_and_a_dump_shunts_the_whole_burst(fresh):
    tb = fresh
    n = 300
    srv = tb.conn_server(SHUNT)
    conns, burst_end = tb.open_conns(SHUNT, n, cport_base=30000)
    try:
        tb.wait_for(lambda: len(shunt_flows(tb)) >= 2 * n, 10, f"all {n} connections shunted", interval=0.05)
        done = time.time()
        print(f"\nall {n} shunted {done - burst_end:.3f} s after the burst ended")
        st = status(tb)
        assert st["counters"].get("netlink_overflows", 0) >= 1, "the burst did not overflow the socket"
        assert st["counters"].get("conntrack_resyncs", 0) >= 1
        assert st["shunts"] == n
        # Deadline from the issue (1 s), plus what one flow-table read costs here.
        assert done - burst_end < 1.5
    finally:
        conns.kill()
        srv.kill()


# Seconds without a change in the burst's entries or the switch's flows that end the wait: under
# the load of the suite's other runs, one run waited out its whole 45 s for entries that had
# idled out. The flows count too: the entries stand still while the flow-mods that shunt them
# are on their way, which the switch's flow count shows (a loaded run's wait ended with 16,100
# not shunted yet, the switch connected, and nothing in the controller's log for its last 15 s).
STILL = 8.0


def _burst(tb, n, left_ok):
    """Create n marked UDP entries at once in fw and watch conntrack (asking the controller
    nothing) until at most `left_ok` of them are left, their number has not moved for
    STILL seconds (what is left stays: a pair that idled out leaves its entry to the
    firewall), or 45 s pass; then read the status. Returns (entries left, status)."""
    from nfshunt_testbed.bed import PYTHON

    def entries():
        return int(tb.run(tb.fw, "conntrack", "-C").strip())

    def flows():  # (the switch's own count: asks the controller nothing)
        return int(tb.ofctl("dump-aggregate").rsplit("flow_count=", 1)[1].split()[0])
    base = entries()
    feeder = tb.spawn(tb.fw, PYTHON, os.path.join(REPO, "bench", "ctfeed.py"), "--rate", "0", "--count", str(n),
                      "--proto", "udp", stdout=subprocess.DEVNULL)
    assert feeder.wait(timeout=60) == 0
    deadline = time.monotonic() + 45
    last, moved = (entries(), flows()), time.monotonic()
    while last[0] > base + left_ok and time.monotonic() < min(deadline, moved + STILL):
        time.sleep(0.2)
        now = (entries(), flows())
        if now != last:
            last, moved = now, time.monotonic()
    left = entries() - base
    return left, tb.control({"cmd": "status", "connections": False})


def _leave_the_pairs(tb):
    """Stops the controller and clears the switch's table, all at once. A flush takes a
    burst's pairs down one by one, and a restart adopts the ones still on the switch (those
    not idled out yet: 0-30,000, by how long the test took), which the next test's flush of
    leftovers then took down while its own burst ran: the switch, busy with 30,000
    flow-removed messages, confirmed that burst 4-7 s late, and pairs idled out (10 s)
    before their entries went, which left them to the firewall (1 of 7 suite runs)."""
    assert tb.stop_controller() == 0
    tb.ofctl("del-flows")  # (the next test's start installs the defaults again)


# INFO: a debug line for each of ~100,000 events took 29 s instead of 6.
@controller_config(fresh_start=True, log_level="INFO", netlink_rcvbuf=8 << 20, delete_flows_on_shutdown=False)
def test_a_long_overflowing_burst_leaves_no_entry_unshunted(fresh):
    """The kernel reports ENOBUFS once and then drops events silently until the queue is
    read empty: with the dump asked for at the report, a burst of 30,000 (the default
    16 MB buffer) left 15-16 entries unshunted for good in 2 runs of 3 here. Watched on
    conntrack, without asking the controller anything until the end. The buffer is set to
    8 MiB: the default (128 MiB) holds the whole burst, and nothing would overflow."""
    tb = fresh
    left, st = _burst(tb, 30_000, 0)
    assert st["counters"].get("netlink_overflows", 0) >= 1, "the burst did not overflow the socket"
    # (Once in ten suite runs the switch was dropped here, its reason not kept: the controller's
    # words on it are now in the failure.)
    assert st["counters"].get("switch_disconnects", 0) == 0, "the switch was dropped under the burst: " + " | ".join(
        line for line in tb.controller_output(since_start=True).splitlines()
        if "disconnected" in line or "closing the connection" in line or "failed" in line)
    # Conntrack ids are 32 bits: among 30,000 a repeat is ~10 % likely, and that connection
    # rightly waits on the slow path until the pair holding its id is gone.
    collided = st["counters"].get("ignored:conntrack id of a live pair", 0)
    if left > 0:
        never, idled, kept = _left_entries(tb)
        # A pair whose confirmation the loaded controller read after the switch had already
        # idled it out (10 s, no traffic here) rightly leaves its entry to the firewall:
        # shunted, not lost. What the test is about is an entry never seen at all.
        assert len(never) <= (2 if collided else 0) and not kept, \
            f"{len(never)} entries never shunted ({never[:5]}); {len(kept)} shunted and still holding their entry " \
            f"({kept[:5]}); {len(idled)} idled out before their entry went: {st['counters']}"
    _leave_the_pairs(tb)


def _left_entries(tb) -> tuple[list[str], list[str], list[str]]:
    """The burst's entries left in conntrack, split by the controller's log: never shunted;
    shunted, and the pair removed (idle timeout) before the entry went; shunted, no removal."""
    log = tb.controller_output(since_start=True)
    never, idled, kept = [], [], []
    for e in tb.conntrack():
        if not e["src"].startswith("10.64."):
            continue
        name = f"udp {e['src']}:{e['sport']} -> {e['dst']}:{e['dport']}"
        if f"shunt {name} ports" not in log:
            never.append(name)
        else:
            (idled if f"shunt removed (idle timeout): {name} ports" in log else kept).append(name)
    return never, idled, kept


@controller_config(fresh_start=True, log_level="INFO", delete_flows_on_shutdown=False)
def test_the_default_event_buffer_holds_a_burst_that_overflowed_the_old_one(fresh):
    """30,000 entries at once overflowed the old 16 MiB buffer, and each overflow cost a
    dump of the whole table; the default (128 MiB) holds the burst until it is read."""
    tb = fresh
    left, st = _burst(tb, 30_000, 2)  # 2: conntrack-id collisions wait
    # An entry is deleted only once its pair is confirmed: every one was shunted.
    assert left <= 2, "the burst was not shunted within 45 s"
    assert st["counters"].get("netlink_overflows", 0) == 0, st["counters"]
    assert st["counters"].get("conntrack_resyncs", 0) <= 1, st["counters"]  # the one at start-up
    _leave_the_pairs(tb)


# --- full flow table and the max_shunts budget -------------------------------------------------

def _limit_table(limit):
    if limit is None:
        subprocess.run(["ovs-vsctl", "--if-exists", "clear", "Bridge", "s1", "flow_tables"], check=True)
        return
    subprocess.run(["ovs-vsctl", "--", "--id=@ft", "create", "Flow_Table", f"flow_limit={limit}",
                    "overflow_policy=refuse", "--", "set", "Bridge", "s1", "flow_tables:0=@ft"], check=True)


def _port_flows(tb, cport):
    p = str(cport)
    return [f for f in tb.flows() if p in (f.get("tp_src"), f.get("tp_dst"))]


def test_full_switch_table_keeps_the_connection_on_the_slow_path_until_room_frees(fresh):
    """End to end in the pipeline layout; both layouts' table arithmetic is checked against
    the fake switch (test_fake_core.py::test_a_full_table_keeps_...)."""
    tb = fresh
    pair = TCP_PAIR
    srv = tb.conn_server(SHUNT)
    # Defaults (4) + one TCP shunt fill table 0: 2 flows in the pipeline layout (its
    # catchers are table 1's, shared).
    _limit_table(4 + pair)
    try:
        first, _ = tb.open_conns(SHUNT, 1, cport_base=41001)
        tb.wait_for(lambda: len(_port_flows(tb, 41001)) == pair, 10, "the first shunt")
        refused = counter(tb, "refused:shunt")  # the controller may have run earlier tests
        second, _ = tb.open_conns(SHUNT, 1, cport_base=41002)
        tb.wait_for(lambda: counter(tb, "refused:shunt") > refused, 10, "the switch to refuse the second shunt")
        assert _port_flows(tb, 41002) == []
        # Safely on the slow path: its conntrack entry is kept and its packets cross the bridge.
        assert [e for e in tb.conntrack() if e["sport"] == 41002 and e["dport"] == SHUNT]
        slow0 = tb.slow_path_packets()
        tb.wait_for(lambda: tb.slow_path_packets() > slow0 + 4, 5, "the second connection crossing the bridge")
        assert status(tb)["waiting"] == 1
        # Room frees when the first connection goes (clean close -> teardown): the second is shunted.
        first.stdin.write("close\n")
        first.stdin.flush()
        tb.wait_for(lambda: len(_port_flows(tb, 41002)) == pair, 10, "the waiting connection to be shunted")
        second.kill()
    finally:
        _limit_table(None)
        srv.kill()


# --- TCP teardown --------------------------------------------------------------------------

def _sockets(tb, node, cports):
    """TCP states of the node's sockets with a client port in `cports` (ss, for assertions only)."""
    out = tb.run(node, "ss", "-Htan", check=False)
    states = []
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 5 and {f[3].rsplit(":", 1)[-1], f[4].rsplit(":", 1)[-1]} & {str(p) for p in cports}:
            states.append(f[0])
    return states


@controller_config(default_shunt_timeout=60)  # only the teardown can remove it in time
def test_fin_removes_the_shunt_promptly_and_the_close_completes_through_a_strict_firewall(fresh):
    tb = fresh
    from nfshunt_testbed.bed import STRICT_RULE as rule
    tb.strict_firewalls(loose_pickup=True)  # removed below: the module's other tests run without it
    srv = tb.conn_server(SHUNT)
    try:
        # Below the ephemeral range (32768-60999): an earlier test's socket still closing on
        # an ephemeral port made the bind fail once (EADDRINUSE).
        conns, _ = tb.open_conns(SHUNT, 3, cport_base=23001)
        tb.wait_for(lambda: len(shunt_flows(tb)) == 6, 10, "three shunts")
        # The controller may have run earlier tests (a reload, not a restart): their counts as a base.
        st = status(tb)
        teardowns, fin_removals = st["counters"].get("teardowns", 0), st["counters"].get("removed:shunt:tcp fin", 0)
        conns.stdin.write("close\n")
        conns.stdin.flush()
        t0 = time.monotonic()
        tb.wait_for(lambda: shunt_flows(tb) == [] and catchers(tb) == [], 1.0,
                    "FIN to remove the shunts and their catchers", interval=0.05)
        print(f"\nshunts gone {time.monotonic() - t0:.3f} s after the close")
        line = conns.stdout.readline().split()
        assert line == ["closed", "3", "0"], line  # every peer FIN arrived, no reset
        st = status(tb)
        assert st["counters"]["teardowns"] == teardowns + 3
        assert st["counters"].get("removed:shunt:tcp fin") == fin_removals + 3
        # Both hosts end the connections cleanly: nothing stuck half-closed.
        cports = (23001, 23002, 23003)
        tb.wait_for(lambda: not _sockets(tb, tb.h2, cports) and set(_sockets(tb, tb.h1, cports)) <= {"TIME-WAIT"},
                    5, "the sockets to close")
        # The firewall tracks the end of the connections (closing states, never a fresh
        # ESTABLISHED pickup that the policy would shunt again).
        entries = [e for e in tb.conntrack() if e["dport"] == SHUNT and 23001 <= e["sport"] <= 23003]
        assert len(entries) == 3 and all(e["state"] in (4, 5, 6, 7, 8) for e in entries), entries
    finally:
        tb.run(tb.fw, "iptables", "-w", "5", "-D", *rule, check=False)
        srv.kill()


# --- policy changes: a new policy's moves of running transfers, tests/test_policy_change.py;
# every pair handed back and the decisions cleared, test_operator_api on the rig.

# --- bad input and signals -----------------------------------------------------------------------

def test_unexpected_openflow_messages_are_counted_and_skipped(fresh):
    tb = fresh
    counted = counter(tb, "packet_in:no connection of ours")  # the controller may have run earlier tests
    # A catcher of an unknown connection sends packets in; a flow with our cookie that the
    # controller never made times out and reports its removal.
    tb.ofctl("add-flow", "cookie=0x4e04000000000999,priority=40000,icmp,in_port=1,actions=controller")
    tb.ofctl("add-flow", "cookie=0x4e02000000000998,priority=1,idle_timeout=1,send_flow_rem,"
                         "udp,in_port=1,tp_dst=9,actions=drop")
    # -W 1: the catcher takes every request, and ping waited 10 s for the replies.
    tb.run(tb.h1, "ping", "-c", "2", "-i", "0.2", "-W", "1", "10.0.0.2", check=False)
    tb.wait_for(lambda: counter(tb, "packet_in:no connection of ours") > counted, 5, "the packet-in to be counted")
    tb.wait_for(lambda: not [f for f in tb.flows() if f.get("cookie") == "0x4e02000000000998"], 5,
                "the foreign flow to time out")
    tb.ofctl("del-flows", "--strict", "priority=40000,icmp,in_port=1")
    assert status(tb)["switch"]["connected"] and tb.controller.poll() is None


@pytest.mark.parametrize("sig, delete", [(signal.SIGTERM, True), (signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["sigterm", "sigint", "sigterm-keep-flows"])
def test_signals_shut_down_cleanly_honouring_delete_flows_on_shutdown(fresh, sig, delete):
    tb = fresh
    if not delete:
        tb.reconfigure(delete_flows_on_shutdown=False, default_shunt_timeout=30)
    srv = tb.conn_server(SHUNT)
    conns, _ = tb.open_conns(SHUNT, 1)
    try:
        tb.wait_for(lambda: len(shunt_flows(tb)) == 2, 10, "the shunt")
        socket_path = tb.nfshunt_config()["control_socket"]
        rc = tb.stop_controller(sig, timeout=10)
        assert rc == 0
        assert not os.path.exists(socket_path)
        assert len(defaults(tb)) == 4  # the switch keeps passing traffic to the firewall
        if delete:
            assert shunt_flows(tb) == [] and tb.conn_flows(SHUNT) == []
        else:
            assert len(shunt_flows(tb)) == 2
        assert "Traceback" not in tb.controller_output()
    finally:  # the next test's restart clears the switch
        conns.kill()
        srv.kill()
