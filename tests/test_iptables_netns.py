"""`nfshunt iptables apply/remove` against real iptables in a fresh network namespace."""
import json
import os
import sys
import time

import pytest

from tests.helpers import BASE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY = os.path.join(REPO, "iptables", "policy-example.rules")
ADMIN_FILTER = ["-A", "FORWARD", "-p", "tcp", "--dport", "22", "-j", "DROP"]
ADMIN_MANGLE = ["-A", "PREROUTING", "-p", "udp", "--dport", "53", "-j", "MARK", "--set-mark", "0x7"]


BACKEND_TOOLS = ("iptables", "iptables-restore", "iptables-save", "ip6tables", "ip6tables-restore", "ip6tables-save")


def _backend(request, netns, tmp_path):
    """The namespace's runner with PATH choosing the iptables back end (request.param), and
    `nfshunt` to run this worktree's CLI there."""
    path = os.environ["PATH"]
    if request.param == "legacy":
        bindir = tmp_path / "legacy-bin"
        bindir.mkdir()
        for tool in BACKEND_TOOLS:
            real = "/usr/sbin/" + tool.replace("tables", "tables-legacy", 1)
            if not os.path.exists(real):
                pytest.skip(f"{real} not installed")
            (bindir / tool).symlink_to(real)
        path = f"{bindir}:{path}"
    inner = netns

    def run(*args, check=True, input=None):
        return inner("env", f"PATH={path}", *args, check=check, input=input)

    def nfshunt(*args, check=True):
        return run("env", f"PYTHONPATH={REPO}", sys.executable, "-m", "nfshunt", *args, check=check)
    run.nfshunt = nfshunt
    return run


def _write_config(netns, tmp_path, raw, name="nfshunt.json"):
    """The config file the namespace's tests apply (netns.config); bridge netfilter on."""
    for v in ("call-iptables", "call-ip6tables", "filter-vlan-tagged"):
        netns("sysctl", "-qw", f"net.bridge.bridge-nf-{v}=1")
    cfg = tmp_path / name
    # A socket path of its own: the machine's default may belong to a controller running here.
    cfg.write_text(json.dumps({**raw, "control_socket": str(tmp_path / "nfshunt.sock")}))
    netns.config = str(cfg)


@pytest.fixture(params=["default", "legacy"])
def fw(request, netns, tmp_path):
    """A namespace with bridge br0 over fw-eth0/fw-eth1, and a config naming them; run
    once with Debian's selected iptables back end (nft) and once with the legacy one,
    chosen the way an admin's alternatives would: by what `iptables` on PATH is."""
    netns = _backend(request, netns, tmp_path)
    for i in (0, 1):
        netns("ip", "link", "add", f"fw-eth{i}", "type", "veth", "peer", "name", f"peer{i}")
    netns("ip", "link", "add", "br0", "type", "bridge")
    for i in (0, 1):
        netns("ip", "link", "set", f"fw-eth{i}", "master", "br0")
    _write_config(netns, tmp_path, BASE)
    return netns


def save(fw, cmd="iptables-save"):
    """The ruleset: every rule and user chain, by table. Comments, counters and empty
    built-in tables (the legacy back end lists a table once anything looked at it) are
    left out: they are not rules."""
    out, table = [], ""
    for line in fw(cmd).stdout.splitlines():
        if line.startswith("*"):
            table = line
        elif line.startswith("-A") or (line.startswith(":") and line.split()[1] == "-"):
            out.append(f"{table} {line}")
        elif line.startswith(":") and line.split()[1] != "ACCEPT":
            out.append(f"{table} {line.split()[0]} {line.split()[1]}")  # a non-default policy
    return "\n".join(out)


def test_apply_is_idempotent_keeps_admin_rules_and_remove_is_clean(fw):
    fw("iptables", *ADMIN_FILTER)
    fw("iptables", "-t", "mangle", *ADMIN_MANGLE)
    before = save(fw)
    fw.nfshunt("iptables", "apply", "--config", fw.config, "--policy", POLICY)
    after_once = save(fw)
    for chain in ("NFSHUNT_PRE", "NFSHUNT_PRE_PD_IN", "NFSHUNT_POST", "NFSHUNT_POST_PD_OUT", "NFSHUNT_POLICY"):
        assert fw("iptables", "-t", "mangle", "-S", chain).returncode == 0
    rules = fw("iptables", "-t", "mangle", "-S").stdout
    assert "-A NFSHUNT_PRE_PD_IN -m physdev --physdev-in fw-eth1 -j MARK --set-xmark 0x42000000/0x4f000000" in rules
    assert "--ctorigdstport 5201 -g NFSHUNT_SHUNT" in rules
    assert "-A PREROUTING -p udp" in rules and "--dport 22 -j DROP" in save(fw)
    v6 = fw("ip6tables", "-t", "mangle", "-S").stdout
    assert "-A POSTROUTING -j NFSHUNT_POST" in v6 and "NFSHUNT_SHUNT" in v6

    fw.nfshunt("iptables", "apply", "--config", fw.config)  # again, no policy: keeps the admin's
    assert save(fw) == after_once
    assert rules.count("-j NFSHUNT_PRE\n") == 1

    fw.nfshunt("iptables", "remove", "--config", fw.config)
    assert "NFSHUNT" not in save(fw) and "NFSHUNT" not in save(fw, "ip6tables-save")
    assert save(fw) == before  # the admin's rules in filter and mangle are untouched


def test_policy_chain_keeps_hand_written_rules_without_policy_file(fw):
    fw.nfshunt("iptables", "apply", "--config", fw.config)
    fw("iptables", "-t", "mangle", "-A", "NFSHUNT_POLICY", "-p", "tcp", "--dport", "2811", "-g", "NFSHUNT_SHUNT")
    fw.nfshunt("iptables", "apply", "--config", fw.config)
    assert "--dport 2811" in fw("iptables", "-t", "mangle", "-S", "NFSHUNT_POLICY").stdout
    fw.nfshunt("iptables", "apply", "--config", fw.config, "--policy", POLICY)  # a policy file replaces
    assert "--dport 2811" not in fw("iptables", "-t", "mangle", "-S", "NFSHUNT_POLICY").stdout


@pytest.mark.parametrize("problem", ["missing-interface", "not-a-bridge-port", "sysctl-off", "vlan-sysctl-off",
                                     "bad-policy"])
def test_failed_checks_change_nothing(fw, tmp_path, problem):
    fw("iptables", *ADMIN_FILTER)
    cfg = json.loads(json.dumps(BASE))
    args = []
    if problem == "missing-interface":
        cfg["ports"][1]["bridge_port"] = "fw-eth9"
        expect = "fw-eth9 does not exist"
    elif problem == "not-a-bridge-port":
        fw("ip", "link", "set", "fw-eth1", "nomaster")
        expect = "fw-eth1 is not a bridge port"
    elif problem == "sysctl-off":
        fw("sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0")
        expect = "--fix-sysctl"
    elif problem == "vlan-sysctl-off":  # tagged IP would cross the bridge unjudged
        fw("sysctl", "-qw", "net.bridge.bridge-nf-filter-vlan-tagged=0")
        expect = "net.bridge.bridge-nf-filter-vlan-tagged is 0, so 802.1Q-tagged IP crosses the bridge"
    else:
        bad = tmp_path / "bad.rules"
        bad.write_text("-A NFSHUNT_POLICY -m nosuchmatch -j ACCEPT\n")
        args = ["--policy", str(bad)]
        expect = "rejected the ruleset"
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    before, before6 = save(fw), save(fw, "ip6tables-save")
    result = fw.nfshunt("iptables", "apply", "--config", str(path), *args, check=False)
    assert result.returncode == 1
    assert expect in result.stderr
    assert save(fw) == before and save(fw, "ip6tables-save") == before6


def test_fix_sysctl_turns_bridge_netfilter_on(fw):
    fw("sysctl", "-qw", "net.bridge.bridge-nf-call-ip6tables=0")
    fw("sysctl", "-qw", "net.bridge.bridge-nf-filter-vlan-tagged=0")
    fw.nfshunt("iptables", "apply", "--config", fw.config, "--fix-sysctl")
    assert fw("sysctl", "-n", "net.bridge.bridge-nf-call-ip6tables").stdout.strip() == "1"
    assert fw("sysctl", "-n", "net.bridge.bridge-nf-filter-vlan-tagged").stdout.strip() == "1"


def test_family_specific_policy_rules_load_into_their_family_only(fw):
    fw.nfshunt("iptables", "apply", "--config", fw.config, "--policy",
               os.path.join(REPO, "iptables", "policy-dtn.rules"))
    v4 = fw("iptables", "-t", "mangle", "-S", "NFSHUNT_POLICY").stdout
    v6 = fw("ip6tables", "-t", "mangle", "-S", "NFSHUNT_POLICY").stdout
    assert "10.0.0.0/24" in v4 and "fd00::" not in v4 and "10.0.0.66" in v4
    assert "fd00::/64" in v6 and "10.0.0" not in v6
    assert "50000:51000" in v4 and "50000:51000" in v6


# --- VLAN trunks (issue 37): a bridge per VLAN over sub-interfaces ------------------------
# This kernel has no 802.1Q (design F14): veths named like sub-interfaces stand in for them,
# which is all iptables sees of a real one (physdev names the bridge port).

VLANS = {**BASE, "openflow_versions": ["1.3"], "ports": [
    {"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "fw-eth0", "vlans": [100, 200]},
    {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "fw-eth1", "vlans": [100, 200]}]}
ADMIN_RAW = ["-t", "raw", "-A", "PREROUTING", "-p", "tcp", "--dport", "23", "-j", "DROP"]
ADMIN_BRIDGE = ["-A", "FORWARD", "-p", "0x88b5", "-j", "DROP"]
# ingress and egress flags, ingress physdevin 1 (fw-eth0's), egress 2 (fw-eth1's)
LINKS_MARK = 0x61200000
SEND = r"""
import socket, struct, sys
ifname, sport, tags = sys.argv[1], int(sys.argv[2]), [int(t, 16) for t in sys.argv[3:] if "=" not in t]
opts = dict(t.split("=") for t in sys.argv[3:] if "=" in t)  # dport, src, dst, smac, dmac: others than the default
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b)); s = (s >> 16) + (s & 0xffff); s += s >> 16
    return ~s & 0xffff
src, dst = socket.inet_aton(opts.get("src", "10.9.0.1")), socket.inet_aton(opts.get("dst", "10.9.0.2"))
mac = lambda m: bytes.fromhex(m.replace(":", ""))
udp = struct.pack("!HHHH", sport, int(opts.get("dport", 9999)), 12, 0) + b"vlan"
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0, src, dst)
ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:]
tag = b"".join(struct.pack("!HH", t >> 16, t & 0xffff) for t in tags)  # each: tpid << 16 | tci
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((ifname, 0))
s.send(mac(opts.get("dmac", "02:00:00:00:00:02")) + mac(opts.get("smac", "02:00:00:00:00:01")) + tag + b"\x08\x00"
       + ip + udp)
"""


@pytest.fixture(params=["default", "legacy"])
def vfw(request, netns, tmp_path):
    """The design's firewall for VLANs 100 and 200 on two trunks (fw-eth0, fw-eth1): bridge
    br100 over fw-eth0.100 and fw-eth1.100, br200 alike; each sub-interface a veth whose
    peer (p0.100 ...) sends the test's frames into it. The trunks exist, in no bridge."""
    netns = _backend(request, netns, tmp_path)
    for i in (0, 1):
        netns("ip", "link", "add", f"fw-eth{i}", "type", "veth", "peer", "name", f"peer{i}")
    for vid in (100, 200):
        netns("ip", "link", "add", f"br{vid}", "type", "bridge", "mcast_snooping", "0")
        for i in (0, 1):
            netns("ip", "link", "add", f"fw-eth{i}.{vid}", "type", "veth", "peer", "name", f"p{i}.{vid}")
            netns("ip", "link", "set", f"fw-eth{i}.{vid}", "master", f"br{vid}")
            for end in (f"fw-eth{i}.{vid}", f"p{i}.{vid}"):
                netns("sysctl", "-qw", f"net/ipv6/conf/{end}/disable_ipv6=1")  # dots in the name
                netns("ip", "link", "set", end, "up")
        netns("ip", "link", "set", f"br{vid}", "up")
    _write_config(netns, tmp_path, VLANS)
    return netns


def saves(fw):
    return save(fw), save(fw, "ip6tables-save"), save(fw, "ebtables-save")


def test_vlans_apply_is_idempotent_keeps_admin_rules_and_remove_is_clean(vfw):
    vfw("iptables", *ADMIN_FILTER)
    vfw("iptables", *ADMIN_RAW)
    vfw("ip6tables", *ADMIN_RAW)
    vfw("ebtables", *ADMIN_BRIDGE)
    before = saves(vfw)
    out = vfw.nfshunt("iptables", "apply", "--config", vfw.config, "--policy", POLICY, "--no-reevaluate").stdout
    assert "zones 100, 200 on 4 sub-interfaces" in out
    assert "not VLAN devices" in out  # the veths' VLAN ids cannot be checked: said, not refused
    once = saves(vfw)
    for cmd in ("iptables", "ip6tables"):
        raw = vfw(cmd, "-t", "raw", "-S").stdout
        prerouting = [line for line in raw.splitlines() if line.startswith("-A PREROUTING")]
        assert prerouting[0] == "-A PREROUTING -j NFSHUNT_ZONE"  # first: before the admin's own
        assert "-A NFSHUNT_ZONE -m physdev --physdev-in fw-eth1.200 -j CT --zone 200" in raw
    rules = vfw("iptables", "-t", "mangle", "-S").stdout
    assert "-A NFSHUNT_PRE_PD_IN -m physdev --physdev-in fw-eth1.100 -j MARK --set-xmark 0x42000000/0x4f000000" \
        in rules
    tagged = vfw("ebtables", "-L", "NFSHUNT_TAGGED").stdout
    assert "-p 802_1Q -i fw-eth0.200 -j DROP" in tagged and "-p S-TAG -i fw-eth0.200 -j DROP" in tagged  # S-TAG: 0x88a8

    vfw.nfshunt("iptables", "apply", "--config", vfw.config)
    assert saves(vfw) == once

    vfw.nfshunt("iptables", "remove", "--config", vfw.config)
    assert saves(vfw) == before  # the admin's rules in filter, raw and the bridge's table untouched
    assert all("NFSHUNT" not in text for text in saves(vfw))


def test_a_config_that_drops_its_vlans_takes_their_zones_and_guard_out(vfw, tmp_path):
    vfw.nfshunt("iptables", "apply", "--config", vfw.config)
    untagged = {**VLANS, "ports": [{**g, "bridge_port": f"fw-eth{i}.100"} for i, g in enumerate(BASE["ports"])]}
    _write_config(vfw, tmp_path, untagged, "untagged.json")
    vfw.nfshunt("iptables", "apply", "--config", vfw.config)
    assert "NFSHUNT" not in save(vfw, "ebtables-save") and "*raw" not in iptables_tables(vfw)
    assert "NFSHUNT_ZONE" not in vfw("iptables", "-t", "raw", "-S").stdout


def iptables_tables(fw):
    return "\n".join(line for line in save(fw).splitlines() if "NFSHUNT" in line)


@pytest.mark.parametrize("problem", ["zone-split", "two-zones-in-a-bridge", "trunk-bridged", "missing-sub-interface",
                                     "not-a-bridge-port", "vlan-sysctl-off"])
def test_each_vlan_refusal_changes_nothing(vfw, problem):
    vfw("iptables", *ADMIN_FILTER)
    if problem == "zone-split":
        vfw("ip", "link", "add", "br-other", "type", "bridge")
        vfw("ip", "link", "set", "fw-eth1.100", "master", "br-other")
        expect = "zone 100: fw-eth0.100 is in br100 but fw-eth1.100 is in br-other; put every interface of a zone " \
                 "in one bridge"
    elif problem == "two-zones-in-a-bridge":
        vfw("ip", "link", "set", "fw-eth1.200", "master", "br100")
        expect = "br100 holds fw-eth0.100 (zone 100) and fw-eth1.200 (zone 200): one bridge per VLAN"
    elif problem == "trunk-bridged":  # its untagged frames would be bridged in zone 0
        vfw("ip", "link", "add", "br0", "type", "bridge")
        vfw("ip", "link", "set", "fw-eth0", "master", "br0")
        expect = 'ports[0]: fw-eth0 is a port of br0, but the group carries no untagged frames ("untagged": false)'
    elif problem == "missing-sub-interface":
        vfw("ip", "link", "del", "fw-eth1.200")
        expect = "interface fw-eth1.200 does not exist: create it (ip link add link fw-eth1 name fw-eth1.200 type " \
                 "vlan id 200)"
    elif problem == "not-a-bridge-port":
        vfw("ip", "link", "set", "fw-eth0.200", "nomaster")
        expect = "interface fw-eth0.200 is not a bridge port"
    else:
        vfw("sysctl", "-qw", "net.bridge.bridge-nf-filter-vlan-tagged=0")
        expect = "net.bridge.bridge-nf-filter-vlan-tagged is 0"
    before = saves(vfw)
    result = vfw.nfshunt("iptables", "apply", "--config", vfw.config, check=False)
    assert result.returncode == 1
    assert expect in result.stderr, result.stderr
    assert saves(vfw) == before


def _entries(fw, zone, sport):
    """(zone, mark) of the conntrack entries of the test's datagram from `sport`, in `zone`."""
    out = fw("conntrack", "-L", "-w", str(zone), "-p", "udp", "--sport", str(sport), check=False).stdout
    found = []
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        found.append((int(fields.get("zone", 0)), int(fields["mark"])))
    return found


def test_the_same_datagram_in_two_vlans_is_two_connections_marked_with_their_link(vfw):
    vfw.nfshunt("iptables", "apply", "--config", vfw.config, "--policy", POLICY, "--no-reevaluate")
    for vid in (100, 200):
        vfw(sys.executable, "-c", SEND, f"p0.{vid}", "40050")
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not (_entries(vfw, 100, 40050) and _entries(vfw, 200, 40050)):
        time.sleep(0.05)
    for zone in (100, 200):
        assert [(z, mark & 0x6FF00000) for z, mark in _entries(vfw, zone, 40050)] == [(zone, LINKS_MARK)]
    assert _entries(vfw, 0, 40050) == []  # no zone-0 twin


def test_a_frame_still_tagged_inside_a_vlan_bridge_is_dropped_and_counted(vfw):
    """What a QinQ frame is after the sub-interface popped its outer tag (F10): an 802.1Q
    and an 802.1ad single tag, each dropped by NFSHUNT_TAGGED before the bridge forwards it."""
    vfw.nfshunt("iptables", "apply", "--config", vfw.config)
    vfw(sys.executable, "-c", SEND, "p0.200", "40061", "81000005")
    vfw(sys.executable, "-c", SEND, "p0.200", "40062", "88a80005")
    vfw(sys.executable, "-c", SEND, "p0.200", "40063")  # untagged: bridged as usual
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not _entries(vfw, 200, 40063):
        time.sleep(0.05)
    assert [z for z, _ in _entries(vfw, 200, 40063)] == [200]
    assert _entries(vfw, 200, 40061) == [] and _entries(vfw, 200, 40062) == []
    counted = vfw("ebtables", "-L", "NFSHUNT_TAGGED", "--Lc").stdout
    # (the kernel may have moved either tag out of the frame: ebtables then counts it as 802.1Q)
    hits = [line.split() for line in counted.splitlines() if "-i fw-eth0.200" in line]
    assert sum(int(words[words.index("pcnt") + 2]) for words in hits) == 2, counted


def test_the_admins_own_bridge_rules_still_see_what_the_guard_lets_through(vfw):
    """NFSHUNT_TAGGED's policy is RETURN: with a user chain's default (ACCEPT) every frame
    it does not drop would be accepted there, and the admin's later FORWARD rules never run."""
    vfw.nfshunt("iptables", "apply", "--config", vfw.config)
    vfw("ebtables", *ADMIN_BRIDGE)  # appended: after NFSHUNT_TAGGED's jump
    send = ("import socket; s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); s.bind(('p0.100', 0)); "
            "s.send(bytes.fromhex('020000000002020000000001') + b'\\x88\\xb5' + bytes(46))")
    vfw(sys.executable, "-c", send)
    rules = [line for line in vfw("ebtables", "-L", "FORWARD", "--Lc").stdout.splitlines() if "0x88b5" in line]
    assert len(rules) == 1 and "pcnt = 1 " in rules[0], rules


MACS = ["02:00:00:00:aa:00", "02:00:00:00:aa:01", "02:00:00:00:aa:02"]


@pytest.fixture
def three(netns, tmp_path):
    """br0 over three ports (three port groups: one switch's inside, outside and DMZ), each
    with its host's veth peer; no IPv6, so nothing but the test's frames teaches the bridge."""
    netns("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
    netns("ip", "link", "add", "br0", "type", "bridge")
    for i in range(3):
        netns("ip", "link", "add", f"fw-eth{i}", "type", "veth", "peer", "name", f"peer{i}")
        netns("ip", "link", "set", f"peer{i}", "address", MACS[i], "up")
        netns("ip", "link", "set", f"fw-eth{i}", "master", "br0", "up")
    netns("ip", "link", "set", "br0", "up")
    ports = [{"fast": 1 + 2 * i, "slow": 2 + 2 * i, "physdevin": i + 1, "bridge_port": f"fw-eth{i}"} for i in range(3)]
    _write_config(netns, tmp_path, {**BASE, "ports": ports})
    netns.nfshunt = lambda *args: netns("env", f"PYTHONPATH={REPO}", sys.executable, "-m", "nfshunt", *args)
    netns.nfshunt("iptables", "apply", "--config", netns.config)
    return netns


def _egress(fw, sport):
    """The egress port number the entry of `sport`'s datagram records (None: none yet)."""
    from nfshunt.records import markcodec
    out = fw("conntrack", "-L", "-p", "udp", "--orig-port-src", str(sport), check=False).stdout
    marks = [int(word[5:]) for word in out.split() if word.startswith("mark=")]
    assert len(marks) == 1, out
    return markcodec.decode(marks[0]).egress


@pytest.mark.parametrize("behind", [1, 2])
def test_a_flooded_first_packet_s_egress_is_set_right_by_the_connection_s_reply(three, behind):
    # The bridge has not learnt the destination's MAC (aged out; a failover's empty table):
    # the first datagram is flooded to both other ports, and the egress recorded was one
    # copy's, whichever port it went out of. A shunt installed on it sent the connection
    # into the third group's network. The reply enters by the one port its sender is behind.
    fw = three
    sport, host = 40000 + behind, f"10.0.0.{2 + behind}"
    out = ["dport=53", "src=10.0.0.1", f"dst={host}", f"smac={MACS[0]}", f"dmac={MACS[behind]}"]
    fw(sys.executable, "-c", SEND, "peer0", str(sport), *out)
    assert _egress(fw, sport) in (2, 3)  # a flood's record: either copy's port
    fw(sys.executable, "-c", SEND, f"peer{behind}", "53", f"dport={sport}", f"src={host}", "dst=10.0.0.1",
       f"smac={MACS[behind]}", f"dmac={MACS[0]}")
    assert _egress(fw, sport) == behind + 1
    fw(sys.executable, "-c", SEND, "peer0", str(sport), *out)
    assert _egress(fw, sport) == behind + 1  # the next datagram (unicast now) keeps it
