"""A shunted TCP connection closes within 1 s (issue 11.4): the sender's last segment
carries data and its FIN, the peer answers with its own; at MTU 1500 and 9000, and after
a controller restart (the pair adopted from the switch). The teardown catchers forward
the FIN/RST in the switch: nothing depends on re-injecting a packet by packet-out."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.beds import Bed, Strict, running
from tests.test_failsafe import catchers, shunt_flows

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.third_bed]
SHUNT = 5201


@pytest.fixture(scope="module", params=[(1500, True), (1500, False), (9000, True), (9000, False)],
                ids=["mtu1500-offload", "mtu1500", "mtu9000-offload", "mtu9000"])
def tb(request, integration_ready):
    """Offload: the hosts as Linux sets them up (TSO, checksum offload), with Open vSwitch's
    userspace TSO support on, so the switch sees (and a catcher catches) segments of
    many packets' size: the bed where a re-injected FIN used to be lost."""
    mtu, offload = request.param
    with running(Bed(mtu=mtu, host_offload=offload, strict=Strict.INVALID_DROPPED,
                     config={"default_shunt_timeout": 60, "delete_flows_on_shutdown": False})) as bed:
        yield bed


def _bulk(tb, cport):
    from nfshunt_testbed.bed import H2_IP, HERE, PYTHON, REPO
    proc = tb.h1.popen([PYTHON, os.path.join(HERE, "conngen.py"), "bulk", H2_IP, str(SHUNT), "--cport", str(cport)],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=tb._env(), cwd=REPO)
    assert proc.stdout.readline().strip() == "up"
    return proc


def _pair(tb, cport):
    return [f for f in shunt_flows(tb) if str(cport) in (f.get("tp_src"), f.get("tp_dst"))]


@pytest.mark.parametrize("restart", [False, True], ids=["running", "after-restart"])
def test_a_shunted_bulk_transfer_closes_within_1s(tb, restart):
    cport = 47001 + int(restart)
    srv = tb.conn_server(SHUNT)
    proc = _bulk(tb, cport)
    try:
        tb.wait_for(lambda: len(_pair(tb, cport)) == 2 and min(int(f["n_packets"]) for f in _pair(tb, cport)) > 1000,
                    10, "the transfer shunted and moving")
        if restart:  # a kill or restart: the new controller adopts the pair from the switch
            tb.restart_controller()
            tb.wait_for_controller()
            assert len(_pair(tb, cport)) == 2
        proc.stdin.write("close\n")
        proc.stdin.flush()
        line = proc.stdout.readline().split()
        assert line[0] == "closed" and line[2] == "1", line  # the peer's FIN came, no reset
        print(f"\nclosed in {float(line[1]):.3f} s")
        assert float(line[1]) < 1.0
        tb.wait_for(lambda: not _pair(tb, cport) and not [f for f in catchers(tb) if str(cport) in str(f)], 1.0,
                    "the shunt and its catchers to go", interval=0.05)
        st = tb.control({"cmd": "status", "connections": False})["counters"]
        assert st.get("teardowns", 0) >= 1 and st.get("packet_in:no cookie or in_port", 0) == 0
    finally:
        proc.kill()
        srv.kill()
