"""`nfshunt iptables apply` on a routing firewall in a fresh network namespace: its preflight
refuses routed interfaces of differing MTUs (a switch drops a frame too big for its egress
link silently where the router would fragment it or answer "packet too big", design F8),
names each interface with its MTU, and changes nothing; one MTU applies."""
import json
import sys

from tests.test_iptables_netns import REPO, save

ROUTED = {"forwarding": "routed", "openflow_versions": ["1.3"],
          "ports": [{"fast": 1, "slow": 2, "physdevin": 1, "interface": "fw-eth0"},
                    {"fast": 3, "slow": 4, "physdevin": 2, "interface": "fw-eth1"}],
          "mark_actions": {"0": "ignore", "1": "shunt", "2": "block"}}


def _router(netns, tmp_path):
    """fw-eth0 (10.0.1.254/24) and fw-eth1 (10.0.2.254/24), up, forwarding on."""
    for i in (0, 1):
        netns("ip", "link", "add", f"fw-eth{i}", "type", "veth", "peer", "name", f"peer{i}")
        netns("ip", "addr", "add", f"10.0.{i + 1}.254/24", "dev", f"fw-eth{i}")
        netns("ip", "link", "set", f"fw-eth{i}", "up")
    netns("sysctl", "-qw", "net.ipv4.ip_forward=1")
    cfg = tmp_path / "routed.json"
    cfg.write_text(json.dumps({**ROUTED, "control_socket": str(tmp_path / "nfshunt.sock")}))
    return str(cfg)


def _apply(netns, cfg):
    return netns("env", f"PYTHONPATH={REPO}", sys.executable, "-m", "nfshunt", "iptables", "apply", "--config", cfg,
                 "--ipv4-only", check=False)


def test_routed_interfaces_of_differing_mtus_are_refused_naming_them_and_nothing_changes(netns, tmp_path):
    cfg = _router(netns, tmp_path)
    netns("ip", "link", "set", "fw-eth1", "mtu", "1400")
    before = save(netns)
    result = _apply(netns, cfg)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "fw-eth0 has MTU 1500, fw-eth1 has MTU 1400" in result.stderr
    assert "packet too big" in result.stderr
    assert save(netns) == before and "NFSHUNT" not in before

    netns("ip", "link", "set", "fw-eth1", "mtu", "1500")  # one MTU: the plumbing goes in
    result = _apply(netns, cfg)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "-A NFSHUNT_PRE_PD_IN -i fw-eth1 -j MARK" in netns("iptables", "-t", "mangle", "-S").stdout


def test_a_static_shunt_s_via_off_its_destination_s_subnet_is_refused_naming_the_key(netns, tmp_path):
    """`via` names a neighbour on the destination side's link: one on no subnet of that
    routed interface is refused by the preflight with its key, and nothing changes."""
    cfg = _router(netns, tmp_path)
    raw = json.loads(open(cfg).read())
    stream = {"protocol": "udp", "src": "10.0.1.1", "dst": "10.0.2.1", "dst_port": 34964, "fast_ports": [1, 3],
              "both_directions": False}
    raw.update(experimental_routed=True, flow_layout="single",
               static_shunts=[{**stream, "via": "10.0.2.9"}, {**stream, "dst_port": 1, "via": "10.0.1.9"}])
    with open(cfg, "w") as fh:
        json.dump(raw, fh)
    before = save(netns)
    result = _apply(netns, cfg)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "static_shunts[1].via: 10.0.1.9 is not on a subnet of fw-eth1" in result.stderr
    assert "(10.0.2.0/24)" in result.stderr and "static_shunts[0]" not in result.stderr
    assert save(netns) == before and "NFSHUNT" not in before
