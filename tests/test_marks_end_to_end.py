"""The rendered plumbing on the real bridge marks connections with the right bridge-port
numbers and policy action, in both directions (firewall-only testbed: no controller, so the
marks stay in conntrack to be read)."""
import subprocess

import pytest

from nfshunt.records import markcodec
from tests.beds import Bed, running
from tests.helpers import wait_listening

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.third_bed]


def test_conntrack_marks_carry_ports_and_action(integration_ready):
    from nfshunt_testbed.bed import H1_IP, H2_IP
    with running(Bed(mode="firewall")) as tb:
        for server, client, dst, port in ((tb.h2, tb.h1, H2_IP, 5201), (tb.h1, tb.h2, H1_IP, 5203),
                                          (tb.h2, tb.h1, H2_IP, 5202)):
            srv = server.popen(["iperf3", "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL)
            wait_listening(tb, server, port)
            tb.run(client, "iperf3", "-c", dst, "-p", str(port), "-t", "1", timeout=20)
            srv.wait(timeout=10)

        def marks(port):
            return {(m.ingress, m.egress, m.action) for m in
                    (markcodec.decode(e["mark"]) for e in tb.conntrack() if e["dport"] == port)}
        assert marks(5201) == {(1, 2, 1)}  # h1 (port 1) -> h2 (port 2), shunt
        assert marks(5203) == {(2, 1, 0)}  # h2 -> h1, ignore
        assert marks(5202) == {(1, 2, 2)}  # block
