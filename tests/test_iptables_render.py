"""Golden tests of the rendered iptables-restore text."""
import os

import pytest

from nfshunt import iptables
from nfshunt.config.settings import ConfigError
from tests.helpers import config

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def four_ports():
    return config(ports=[{"fast": 1 + 2 * i, "slow": 2 + 2 * i, "physdevin": i + 1, "bridge_port": f"fw-eth{i}"}
                         for i in range(4)])


@pytest.mark.parametrize("name,cfg", [("two-port", config), ("four-port", four_ports)])
def test_rendered_text_matches_golden(name, cfg):
    policy = iptables.read_policy(os.path.join(os.path.dirname(GOLDEN), "..", "iptables", "policy-example.rules"))
    text = iptables.render(cfg(), policy)
    path = os.path.join(GOLDEN, f"{name}.rules")
    if os.environ.get("NFSHUNT_UPDATE_GOLDEN") == "1":
        with open(path, "w") as fh:
            fh.write(text)
    with open(path) as fh:
        assert text == fh.read()


def test_reapply_keeps_admin_policy_and_adds_no_second_jump():
    existing = iptables.Existing(set(iptables.CHAINS), set(iptables.JUMPS))
    text = iptables.render(config(), None, existing)
    assert ":NFSHUNT_POLICY" not in text  # declaring would flush the admin's rules
    assert "-I PREROUTING" not in text and "-I POSTROUTING" not in text


def test_removal_text_touches_only_our_chains():
    text = iptables.render_removal(iptables.Existing(set(iptables.CHAINS), set(iptables.JUMPS)))
    for line in text.splitlines()[1:-1]:
        assert "NFSHUNT_" in line


def test_bridge_port_names_are_required(tmp_path):
    with pytest.raises(ConfigError, match=r"ports\[0\].bridge_port"):
        iptables.render(config(ports=[{"fast": 1, "slow": 2, "physdevin": 1}]), [])


def test_a_missing_bridge_port_is_named_where_it_is_in_a_file_of_several_switches():
    ports = [{"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "fw-eth0"},
             {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "fw-eth1"}]
    from nfshunt.config.settings import from_dict
    from tests.helpers import BASE
    raw = {k: v for k, v in BASE.items() if k not in ("ports", "datapath_id")}
    cfg = from_dict({**raw, "switches": [
        {"datapath_id": "a1", "ports": ports},
        {"datapath_id": "a2", "ports": [{"fast": 1, "slow": 2, "physdevin": 3, "bridge_port": "fw-eth2"},
                                        {"fast": 3, "slow": 4, "physdevin": 4}]}]})
    with pytest.raises(ConfigError) as info:
        iptables.render(cfg, [])
    assert info.value.key == "switches[1].ports[1].bridge_port"  # not the 4th of every group: ports[3]


def test_policy_file_lines_are_checked(tmp_path):
    bad = tmp_path / "p.rules"
    bad.write_text("-A FORWARD -j ACCEPT\n")
    with pytest.raises(iptables.IptablesError, match="p.rules:1"):
        iptables.read_policy(str(bad))


def test_mark_command(capsys):
    from nfshunt.cli import main
    assert main(["iptables", "mark", "shunt"]) == 0
    assert capsys.readouterr().out.strip() == "-j MARK --set-xmark 0x10010000/0x100f0000"
    assert main(["iptables", "mark", "block"]) == 0
    assert capsys.readouterr().out.strip() == "-j MARK --set-xmark 0x10020000/0x100f0000"
    assert main(["iptables", "mark", "forward"]) == 1


# --- VLAN trunks (issue 37, design section 6.2) -------------------------------------------

def trunks(**kw):
    """The design's trunks: VLANs 100 and 200 on both links, 30 inside bridged to 301 outside."""
    from nfshunt.config.settings import from_dict
    return from_dict({"ports": [
        {"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "eth0", "vlans": [100, 200, 30]},
        {"fast": 3, "slow": 4, "physdevin": 2, "bridge_port": "eth1",
         "vlans": [100, 200, {"id": 301, "zone": 30, "bridge_port": "eth1.301"}], **kw}],
        "mark_actions": {"1": "shunt"}, "openflow_versions": ["1.3"]})


def test_each_sub_interface_is_marked_with_its_link_s_physdevin_and_zoned_in_raw():
    text = iptables.render(trunks(), [])
    mangle, raw = text.split("COMMIT\n")[:2]
    for ifname, n in (("eth0.100", 1), ("eth0.200", 1), ("eth0.30", 1), ("eth1.100", 2), ("eth1.301", 2)):
        assert f"-A NFSHUNT_PRE_PD_IN -m physdev --physdev-in {ifname} -j MARK --set-xmark 0x4{n}000000/0x4f000000" \
            in mangle
        assert (f"-A NFSHUNT_POST_PD_OUT -m physdev --physdev-is-bridged --physdev-out {ifname} -j MARK "
                f"--set-xmark 0x20{n}00000/0x20f00000") in mangle
    assert "physdev-in eth0 " not in mangle  # a trunk without untagged frames: its own port is not plumbed
    assert raw.splitlines() == [
        "*raw", ":NFSHUNT_ZONE - [0:0]",
        "-A NFSHUNT_ZONE -m physdev --physdev-in eth0.100 -j CT --zone 100",
        "-A NFSHUNT_ZONE -m physdev --physdev-in eth0.200 -j CT --zone 200",
        "-A NFSHUNT_ZONE -m physdev --physdev-in eth0.30 -j CT --zone 30",
        "-A NFSHUNT_ZONE -m physdev --physdev-in eth1.100 -j CT --zone 100",
        "-A NFSHUNT_ZONE -m physdev --physdev-in eth1.200 -j CT --zone 200",
        "-A NFSHUNT_ZONE -m physdev --physdev-in eth1.301 -j CT --zone 30",
        "-I PREROUTING 1 -j NFSHUNT_ZONE"]
    again = iptables.render(trunks(), None, iptables.Existing({*iptables.CHAINS, *iptables.RAW_CHAINS},
                                                              {*iptables.JUMPS, *iptables.RAW_JUMPS}))
    assert "-I PREROUTING" not in again and ":NFSHUNT_ZONE - [0:0]" in again  # refilled, jumped to once


NATIVE_100 = {"untagged": {"zone": 100}, "vlans": [200, {"id": 301, "zone": 30, "bridge_port": "eth1.301"}]}


def test_untagged_frames_of_a_trunk_are_plumbed_in_their_zone():
    text = iptables.render(trunks(**NATIVE_100), [])
    assert "-A NFSHUNT_PRE_PD_IN -m physdev --physdev-in eth1 -j MARK --set-xmark 0x42000000/0x4f000000" in text
    assert "-A NFSHUNT_ZONE -m physdev --physdev-in eth1 -j CT --zone 100" in text


def test_an_untagged_config_has_no_raw_section_and_one_that_dropped_its_vlans_removes_it():
    assert "*raw" not in iptables.render(config(), [])  # byte-identical to before: the goldens above
    stale = iptables.Existing({*iptables.CHAINS, *iptables.RAW_CHAINS}, {*iptables.JUMPS, *iptables.RAW_JUMPS})
    raw = iptables.render(config(), None, stale).split("COMMIT\n")[1]
    assert raw.splitlines() == ["*raw", "-D PREROUTING -j NFSHUNT_ZONE", ":NFSHUNT_ZONE - [0:0]", "-X NFSHUNT_ZONE"]
    removal = iptables.render_removal(stale)
    assert "-D PREROUTING -j NFSHUNT_ZONE" in removal and "-X NFSHUNT_ZONE" in removal


def test_stacked_tags_are_dropped_on_every_interface_of_a_trunk_group_only():
    ports = iptables.bridge_ports(trunks(**NATIVE_100))
    guards = iptables.tagged_guards(ports)
    assert guards == ["eth0.100", "eth0.200", "eth0.30", "eth1", "eth1.200", "eth1.301"]
    assert iptables.tagged_guards(iptables.bridge_ports(config())) == []
    text = iptables.render_tagged(guards[:1], chain_exists=False)
    assert text.splitlines() == ["*filter", ":NFSHUNT_TAGGED RETURN", "-A NFSHUNT_TAGGED -i eth0.100 -p 802_1Q -j DROP",
                                 "-A NFSHUNT_TAGGED -i eth0.100 -p 0x88a8 -j DROP", "-I FORWARD 1 -j NFSHUNT_TAGGED",
                                 "COMMIT"]
    assert iptables.render_tagged(guards[:1], chain_exists=True).splitlines()[1] == "-F NFSHUNT_TAGGED"


def _links(**changed):
    """Netlink's view of the design's firewall, as read_links gives it; changed: name -> Link."""
    from nfshunt.iptables import Link
    links = {}
    for ifname in ("eth0.100", "eth0.200", "eth0.30", "eth1.100", "eth1.200", "eth1.301"):
        vid, zone = int(ifname.split(".")[1]), {"30": 30, "301": 30}.get(ifname.split(".")[1])
        links[ifname] = Link(ifname, True, f"br{zone or vid}", False, "vlan", vid, 0x8100, ifname.split(".")[0])
    links["eth0"] = Link("eth0")
    links["eth1"] = Link("eth1")
    links.update(changed)
    return links


def _problems(links, notes=None):
    cfg = trunks()
    ports = iptables.bridge_ports(cfg)
    return (iptables._check_bridge_ports(ports, links)
            + iptables.vlan_problems(ports, iptables.untagged_off(cfg), links, [] if notes is None else notes))


def test_a_bridge_per_vlan_over_real_vlan_devices_passes():
    assert _problems(_links()) == []


def test_vlan_device_checks_name_the_interface_and_what_the_config_says():
    from nfshunt.iptables import Link
    assert _problems(_links(**{"eth0.100": Link("eth0.100", True, "br100", False, "vlan", 200, 0x8100, "eth0")})) \
        == ["eth0.100 is VLAN 200 on eth0 (config: VLAN 100 on eth0)"]
    assert _problems(_links(**{"eth1.200": Link("eth1.200", True, "br200", False, "vlan", 200, 0x8100, "eth2")})) \
        == ["eth1.200 is VLAN 200 on eth2 (config: VLAN 200 on eth1)"]
    assert _problems(_links(**{"eth0.30": Link("eth0.30", True, "br30", False, "vlan", 30, 0x88A8, "eth0")})) \
        == ["eth0.30 is 802.1ad: use 802.1Q (ip link add ... type vlan protocol 802.1Q)"]
    notes = []
    assert _problems(_links(**{"eth0.30": Link("eth0.30", True, "br30", False, "veth")}), notes) == []
    assert notes == ["not VLAN devices, their VLAN id and trunk not checked: eth0.30 (veth)"]


def test_a_vlan_filtering_bridge_is_refused():
    from nfshunt.iptables import Link
    links = _links()
    links = {name: Link(**{**link.__dict__, "master_vlan_filtering": link.master == "br200"})
             for name, link in links.items()}
    assert _problems(links) == ['br200 has vlan_filtering on: NFShunt needs a bridge per VLAN over sub-interfaces '
                                '(see README "VLANs")']


def test_a_missing_sub_interface_says_how_to_make_it():
    links = _links()
    del links["eth1.301"]
    assert _problems(links) == ["interface eth1.301 does not exist: create it (ip link add link eth1 name eth1.301 "
                                "type vlan id 301) or fix ports[1].vlans[].bridge_port"]


def test_apply_says_how_many_decisions_read_during_the_clearing_were_not_acted_on(monkeypatch, capsys):
    """`iptables apply --policy` asks the running controller to re-evaluate: its answer's
    counts are printed, with the decisions it did not act on while the kernel cleared them."""
    from nfshunt.app import control
    replies = [{"ok": True, "removed": 3, "cleared": 40, "clear_failed": 0, "ignored_meanwhile": 2},
               {"ok": True, "removed": 0, "cleared": 5, "clear_failed": 0, "ignored_meanwhile": 0}]
    monkeypatch.setattr(control, "request", lambda _path, _req, timeout: replies.pop(0))
    cfg = config(control_socket="/run/nfshunt/control.sock")
    assert iptables.reevaluate(cfg) == 0
    assert "3 shunts and blocks taken down, decisions cleared on 40 conntrack entries; 2 decisions read while " \
           "they were cleared not acted on (a dump reads every entry again)" in capsys.readouterr().out
    assert iptables.reevaluate(cfg) == 0
    assert "not acted on" not in capsys.readouterr().out
