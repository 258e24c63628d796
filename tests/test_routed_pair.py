"""A pair of routing firewalls (docs/routed.md "A firewall pair"), the pure parts and the
controller on the rig: the announcements a new master sends the hosts (openflow/announce.py)
read back as a host's stack reads them, and sent out of each group's fast port when, and only
when, the controller holds the switch. On the real testbed with keepalived and conntrackd:
tests/test_routed_ha.py."""
from __future__ import annotations

from typing import Any, Callable

from os_ken.lib.packet import arp, ethernet, icmpv6, ipv6, packet

from nfshunt.kernel.routes import Interface
from nfshunt.openflow.announce import NA_OVERRIDE, NA_ROUTER, announcements
from nfshunt.records import cookies
from tests.support import fakeswitch as fs
from tests.test_role_link import pair_rig
from tests.test_routed import FW0, FW1, GOOD, ROUTED_PORTS
from tests.test_routed_adopt import FakeFollower

MAC = "02:00:00:00:fe:0a"


def test_an_ipv4_address_is_announced_by_a_gratuitous_arp_request():
    (frame,) = announcements(MAC, ("10.0.1.254",))
    pkt = packet.Packet(frame)
    eth, req = pkt.get_protocol(ethernet.ethernet), pkt.get_protocol(arp.arp)
    assert (eth.src, eth.dst) == (MAC, "ff:ff:ff:ff:ff:ff")
    assert (req.opcode, req.src_mac, req.src_ip, req.dst_ip) == (arp.ARP_REQUEST, MAC, "10.0.1.254", "10.0.1.254")


def test_an_ipv6_address_is_announced_by_an_unsolicited_override_advertisement_and_link_local_ones_not():
    (frame,) = announcements(MAC, ("fd01::fe", "fe80::1"))
    pkt = packet.Packet(frame)
    eth, ip6, icmp = pkt.get_protocol(ethernet.ethernet), pkt.get_protocol(ipv6.ipv6), pkt.get_protocol(icmpv6.icmpv6)
    assert (eth.src, eth.dst) == (MAC, "33:33:00:00:00:01")
    assert (ip6.src, ip6.dst, ip6.hop_limit) == ("fd01::fe", "ff02::1", 255)  # (a host drops an NA under 255)
    assert icmp.type_ == icmpv6.ND_NEIGHBOR_ADVERT
    na = icmp.data
    # A router's, overriding the host's entry, not solicited (an unsolicited NA with S set is invalid).
    assert na.res == NA_ROUTER | NA_OVERRIDE and na.dst == "fd01::fe"
    assert isinstance(na.option, icmpv6.nd_option_tla) and na.option.hw_src == MAC
    # The checksum is right: serialized again from what was parsed, the same bytes.
    again = packet.Packet()
    for proto in pkt.protocols:
        again.add_protocol(proto)
    icmp.csum = 0
    again.serialize()
    assert bytes(again.data) == frame


class Follower(FakeFollower):
    """The route follower with the interfaces as the kernel has them (keepalived has just
    added the gateways)."""

    def __init__(self, interfaces: dict[str, Interface | None]):
        super().__init__(dict(GOOD))
        self.interface_of = interfaces
        self.read: list[tuple[str, ...]] = []

    def interfaces(self, names: tuple[str, ...], reply: Callable[[dict[str, Any]], None]) -> None:
        self.read.append(names)
        reply({name: self.interface_of.get(name) for name in names})


ROUTED_PAIR = dict(forwarding="routed", ports=ROUTED_PORTS, experimental_routed=True)


def _routed_pair(tmp_path, interfaces, role="master", switch=None):
    """A routed pair's controller: its follower in place before the switch connects."""
    rig = pair_rig(tmp_path, role=role, switch=switch, connect=False, **ROUTED_PAIR)
    rig.dispatcher.tables.follower = Follower(interfaces)
    rig.connect(rig.switch)
    return rig


INTERFACES = {"fw-eth0": Interface(FW0, ("10.0.1.253", "10.0.1.254", "fd01::fe", "fe80::1")),
              "fw-eth1": Interface(FW1, ("10.0.2.253", "10.0.2.254"))}


def _announced(rig) -> dict[int, list[tuple[str, str]]]:
    """Port -> (source MAC, address announced) of each packet-out the switch got."""
    out: dict[int, list[tuple[str, str]]] = {}
    for port, frame in rig.switch.packet_outs:
        pkt = packet.Packet(frame)
        req, icmp = pkt.get_protocol(arp.arp), pkt.get_protocol(icmpv6.icmpv6)
        out.setdefault(port, []).append((pkt.get_protocol(ethernet.ethernet).src,
                                         req.src_ip if req is not None else icmp.data.dst))
    return out


def test_a_new_master_of_a_routed_pair_tells_the_hosts_its_macs_out_of_each_fast_port(tmp_path):
    backup = _routed_pair(tmp_path / "b", INTERFACES, role="backup")
    assert backup.switch.packet_outs == [] and not backup.dispatcher.tables.follower.read  # a backup says nothing
    backup.app.role_change(backup.sw, backup.sw.roles.take_over())
    backup.run()
    assert backup.sw.roles.granted == "master" and backup.flows(cookies.Kind.DEFAULT)
    assert backup.dispatcher.tables.follower.read == [("fw-eth0", "fw-eth1")]  # read off the loop, once
    assert _announced(backup) == {1: [(FW0, "10.0.1.253"), (FW0, "10.0.1.254"), (FW0, "fd01::fe")],
                                  3: [(FW1, "10.0.2.253"), (FW1, "10.0.2.254")]}


def test_an_interface_gone_is_said_and_counted_and_the_others_still_announced(tmp_path):
    rig = _routed_pair(tmp_path, {"fw-eth1": INTERFACES["fw-eth1"]})
    assert rig.sw.roles.granted == "master"
    assert _announced(rig) == {3: [(FW1, "10.0.2.253"), (FW1, "10.0.2.254")]}
    assert rig.counters.flat().get("routed_table_errors:interface not found") == 1


def test_a_bridged_pair_and_a_routed_firewall_alone_announce_nothing(tmp_path):
    bridged = pair_rig(tmp_path / "bridged")
    assert bridged.sw.roles.granted == "master" and bridged.switch.packet_outs == []
    from tests.test_routed_adopt import _rig
    alone = _rig(switch=fs.FakeSwitch())
    assert alone.flows(cookies.Kind.DEFAULT) and alone.switch.packet_outs == []
