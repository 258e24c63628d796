"""A routing firewall pair's new master tells the hosts its MAC (docs/routed.md, "A firewall
pair"): keepalived announces the gateways the moment it makes a host master, which is before
that host's controller holds the switch, so those frames reach no host and the hosts keep
sending the slow path to the dead master's MAC until their neighbour entries go stale. Once it
holds the switch the controller sends the same announcements itself, out of the fast ports:
for each address of each routed interface (a trunk's VLAN sub-interface: tagged), a gratuitous ARP request (IPv4) or an
unsolicited neighbour advertisement with the override flag (IPv6; the link-local address too:
hosts that learnt their router from its advertisements send to that one). Pure: the
interface's MAC and addresses in, frames out (built with os-ken's packet library).
"""
from __future__ import annotations

import ipaddress

from os_ken.lib.packet import arp, ethernet, icmpv6, ipv6, packet, vlan
from os_ken.lib.packet.ether_types import ETH_TYPE_8021Q, ETH_TYPE_ARP, ETH_TYPE_IPV6
from os_ken.lib.packet.in_proto import IPPROTO_ICMPV6

BROADCAST = "ff:ff:ff:ff:ff:ff"
ALL_NODES, ALL_NODES_MAC = "ff02::1", "33:33:00:00:00:01"
NA_ROUTER, NA_OVERRIDE = 0b100, 0b001  # (neighbour advertisement flags R, S, O: not solicited)


def _ethernet(pkt: packet.Packet, dst: str, src: str, ethertype: int, vid: int) -> None:
    """The frame's Ethernet header, and its 802.1Q tag when the interface is a VLAN's (vid)."""
    if vid:
        pkt.add_protocol(ethernet.ethernet(dst=dst, src=src, ethertype=ETH_TYPE_8021Q))
        pkt.add_protocol(vlan.vlan(vid=vid, ethertype=ethertype))
    else:
        pkt.add_protocol(ethernet.ethernet(dst=dst, src=src, ethertype=ethertype))


def gratuitous_arp(mac: str, address: str, vid: int = 0) -> bytes:
    """An ARP request for the address by itself (sender and target the same, as keepalived
    sends): every host that holds an entry for it takes the new MAC."""
    pkt = packet.Packet()
    _ethernet(pkt, BROADCAST, mac, ETH_TYPE_ARP, vid)
    pkt.add_protocol(arp.arp(opcode=arp.ARP_REQUEST, src_mac=mac, src_ip=address, dst_mac=BROADCAST,
                             dst_ip=address))
    pkt.serialize()
    return bytes(pkt.data)


def unsolicited_advertisement(mac: str, address: str, vid: int = 0) -> bytes:
    """A neighbour advertisement of the address to all nodes: a router's, not solicited, its
    override flag set, so a host's existing entry takes the new MAC (RFC 4861 7.2.6)."""
    pkt = packet.Packet()
    _ethernet(pkt, ALL_NODES_MAC, mac, ETH_TYPE_IPV6, vid)
    pkt.add_protocol(ipv6.ipv6(nxt=IPPROTO_ICMPV6, hop_limit=255, src=address, dst=ALL_NODES))
    pkt.add_protocol(icmpv6.icmpv6(type_=icmpv6.ND_NEIGHBOR_ADVERT, data=icmpv6.nd_neighbor(
        res=NA_ROUTER | NA_OVERRIDE, dst=address, option=icmpv6.nd_option_tla(hw_src=mac))))
    pkt.serialize()
    return bytes(pkt.data)


def announcements(mac: str, addresses: tuple[str, ...], vid: int = 0) -> list[bytes]:
    """What a new master sends for one interface: a frame for each address on it (tagged
    with its VLAN's id on a trunk: a routed sub-interface's hosts are on that VLAN)."""
    return [gratuitous_arp(mac, a, vid) if ipaddress.ip_address(a).version == 4 else
            unsolicited_advertisement(mac, a, vid) for a in addresses]
