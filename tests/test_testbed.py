"""The one testbed, built for real in each mode: where the packets go, and the emulated RTT
with each delay mechanism (netem where the kernel has it, the NFQUEUE fallback always)."""
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.testbed]


def _transfer(tb, port, seconds=2):
    before = tb.hop_counters()
    seen = {}

    def watch():  # the shunt flows' counters while they exist (FIN removes them at the end)
        seen.update({f["cookie"]: int(f["n_packets"]) for f in tb.conn_flows(port)})
    result = tb.iperf(port, seconds, watch=watch)
    assert "error" not in result, result
    return tb.locate_loss(before, tb.hop_counters()), tb.iperf_summary(result), seen


@pytest.mark.parametrize("mode", ["direct", "firewall", "nfshunt"])
def test_each_mode_sends_the_packets_where_it_says(integration_ready, mode):
    from nfshunt_testbed.bed import SHUNT_PORT, Testbed
    with Testbed(mode=mode) as tb:
        # A second is thousands of packets; the shunt's share is sampled while its flows
        # exist (see below), which needs the longer transfer.
        hops, summary, fast = _transfer(tb, SHUNT_PORT, seconds=2 if mode == "nfshunt" else 1)
        assert summary["gbps"] > 0.05
        got = hops["delivered"]  # packets of h1's that h2 received
        assert got > 1000
        if mode == "direct":
            assert hops["slow_path_packets"] <= 5          # nothing of the transfer crosses the bridge
        elif mode == "firewall":
            assert hops["slow_path_packets"] >= 0.99 * got  # all h2 got crossed the bridge (bar ND chatter)
        else:
            # Counters sampled every 0.2 s until a FIN removes the flows: on a loaded machine
            # the last sample can come half a second before the end of a 2 s transfer (seen:
            # 0.81). The slow-path bound below says where the rest went.
            assert sum(fast.values()) >= 0.6 * got
            assert hops["slow_path_packets"] < 0.05 * got  # only the set-up went through the firewall


def test_the_userspace_switch_ports_get_a_switch_like_buffer_and_the_machine_keeps_its_own(integration_ready):
    """The packet sockets Open vSwitch's userspace datapath reads the ports through hold
    4 MB (208 KB by default: ~15 jumbo frames), and net.core.rmem_default is the machine's
    again once the testbed is up."""
    import re
    import subprocess

    from nfshunt_testbed.bed import RMEM_DEFAULT, SWITCH_RX_BUFFER, Testbed
    before = open(RMEM_DEFAULT).read()
    with Testbed(mode="direct") as tb:
        assert open(RMEM_DEFAULT).read() == before
        if tb.datapath != "netdev":
            pytest.skip("kernel datapath: the switch reads no packet sockets")
        out = subprocess.run(["ss", "-0", "-m", "-p", "-n"], capture_output=True, text=True, check=True).stdout
        buffers = {m.group(1): int(m.group(2)) for m in re.finditer(r"\*:(s1-eth\d+)\s.*?skmem:\(r\d+,rb(\d+)", out)}
        assert set(buffers) >= {f"s1-eth{p}" for p in tb.switch_ports}, out
        assert all(rb >= SWITCH_RX_BUFFER for rb in buffers.values()), buffers
    assert open(RMEM_DEFAULT).read() == before


def test_the_hosts_never_offload_whatever_the_machines_userspace_tso_setting(integration_ready):
    """A machine whose Open vSwitch runs with other_config:userspace-tso-enable=true (common
    where the userspace datapath carries real traffic) once made the testbed leave the
    hosts' TSO on, and five tests failed on packet sizes. The hosts offload only when a test
    asks (host_offload), and the machine's setting is put back on stop."""
    from nfshunt_testbed.bed import SHUNT_PORT, Testbed, userspace_tso_enabled, userspace_tso_setting
    before = userspace_tso_setting()
    with Testbed(mode="direct", userspace_tso=True) as tb:
        if tb.datapath != "netdev":
            pytest.skip("kernel datapath: no userspace TSO")
        assert userspace_tso_enabled()
        for host in tb.hosts:
            features = tb.run(host, "ethtool", "-k", f"{host.name}-eth0")
            assert "\ttx-tcp-segmentation: off" in features and "tx-checksumming: off" in features, features
        result = tb.iperf(SHUNT_PORT, 1)
        assert "error" not in result, result.get("error")
    assert userspace_tso_setting() == before  # as it was, an absent key included


class _Namespace:
    """The conftest's bare network namespace as the node netem_available tries a qdisc in."""

    def __init__(self, netns):
        self.name = netns.name

    def popen(self, args, **kwargs):
        import subprocess
        return subprocess.Popen(["ip", "netns", "exec", self.name, *args], **kwargs)


@pytest.mark.parametrize("mechanism", ["nfqueue", "netem"])
def test_emulated_rtt_matches_the_request(netns, mechanism):
    from nfshunt_testbed.bed import H1_IP, Testbed, TestbedError
    from nfshunt_testbed.linkemu import Emulation, netem_available
    emu = Emulation(rtt_ms=60, delay=mechanism)
    # (the kernel's netem, tried in a bare namespace: a testbed of its own took 2-3 s)
    if mechanism == "netem" and not netem_available(_Namespace(netns)):
        # No netem in this kernel: asking for it is refused with a clear reason, and
        # "auto" falls back to NFQUEUE (measured by the other case).
        print("\nkernel has no netem: checking that a netem request is refused")
        with pytest.raises(TestbedError, match="netem"):
            with Testbed(mode="direct", emulation=emu):
                pass
        return
    with Testbed(mode="direct", emulation=emu) as tb:
        assert tb.delay_mechanism == mechanism
        assert abs(tb.rtt_measured - 60) <= 3
        # TCP sees the same delay (its smoothed RTT, from iperf3). Paced, so that its own queue
        # in the delay line adds nothing: at full rate that queue added up to 16 ms alone and
        # 27 ms beside `make test`'s other testbeds (60.9-61.3 ms paced, alone).
        from nfshunt_testbed.bed import STEADY_RATE
        summary = tb.iperf_summary(tb.iperf(5201, 2, bitrate=STEADY_RATE))
        assert 57 <= summary["mean_rtt_ms"] <= 70
        # And the other direction of measurement agrees: the median of 16 pings 20 ms apart,
        # so that a moment's stall of the delay line under the suite's load moves none of it.
        # (Of 4, in 0.08 s: 64.05 ms once in 63 CI runs; 30 medians of 4 on a bed of its own
        # ranged 60.3-63.4 ms with an ordinary median of 60.8, 30 of 8 60.3-62.7.)
        from nfshunt_testbed.linkemu import measure_rtt
        assert abs(measure_rtt(tb.run, tb.h2, H1_IP, count=16) - 60) <= 3


def test_auto_delay_reports_the_mechanism_and_refuses_a_wrong_rtt(integration_ready, monkeypatch):
    from nfshunt_testbed import topology as testbed_topology
    from nfshunt_testbed.bed import Testbed, TestbedError
    from nfshunt_testbed.linkemu import Emulation
    with Testbed(mode="direct", emulation=Emulation(rtt_ms=40)) as tb:
        assert tb.delay_mechanism in ("netem", "nfqueue")
        assert abs(tb.rtt_measured - 40) <= 2
    # If the emulation delivers half the delay (the bug a kernel-timestamped ping hides),
    # the run is refused before anything is measured.
    monkeypatch.setattr(testbed_topology, "measure_rtt", lambda *a, **k: 20.3)
    with pytest.raises(TestbedError, match="refusing to run"):
        with Testbed(mode="direct", emulation=Emulation(rtt_ms=40)):
            pass
