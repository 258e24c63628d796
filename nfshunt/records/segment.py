"""A TCP segment as a packet-in carries it: the first bytes of an Ethernet frame, untagged
or with one 802.1Q tag (a VLAN trunk's), then IPv4 or IPv6 and the TCP header right after
the IP one, read for its flags and how much data it carries. What a caught close's watch
judges (core/close_watch.py). No I/O."""
from __future__ import annotations

import struct
from dataclasses import dataclass

FIN, SYN, RST, ACK = 0x01, 0x02, 0x04, 0x10
ETH_IPV4, ETH_IPV6, ETH_8021Q = 0x0800, 0x86DD, 0x8100
_TCP_PROTO = 6


@dataclass(frozen=True, slots=True)
class Segment:
    flags: int  # the TCP flags byte
    payload: int  # bytes of data, from the IP length (the frame itself may be cut short)
    seq: int = 0  # its sequence number

    @property
    def closes(self) -> bool:
        """A FIN or RST: part of a close, whoever sent it."""
        return bool(self.flags & (FIN | RST))

    def describe(self) -> str:
        """Its flags and data, for a log line: "ACK with 1448 bytes of data"."""
        names = [name for bit, name in ((SYN, "SYN"), (FIN, "FIN"), (RST, "RST"), (ACK, "ACK")) if self.flags & bit]
        return f"{'/'.join(names) or 'no flags'} with {self.payload} bytes of data"


def parse_segment(frame: bytes) -> Segment | None:
    """The segment in a frame's headers; None if they are not those of a TCP segment over
    IPv4 or IPv6 without extension headers (untagged or one 802.1Q tag), or are cut before
    its flags."""
    eth = 14
    if len(frame) < eth + 20:
        return None
    eth_type = struct.unpack_from("!H", frame, 12)[0]
    if eth_type == ETH_8021Q:  # a trunk's frame: the ethertype follows the tag
        eth = 18
        eth_type = struct.unpack_from("!H", frame, 16)[0]
        if len(frame) < eth + 20:
            return None
    if eth_type == ETH_IPV4:
        ihl = (frame[eth] & 0x0F) * 4
        if frame[eth + 9] != _TCP_PROTO or ihl < 20:
            return None
        tcp, ip_data = eth + ihl, struct.unpack_from("!H", frame, eth + 2)[0] - ihl
    elif eth_type == ETH_IPV6 and len(frame) >= eth + 40:
        if frame[eth + 6] != _TCP_PROTO:
            return None
        tcp, ip_data = eth + 40, struct.unpack_from("!H", frame, eth + 4)[0]
    else:
        return None
    if len(frame) < tcp + 14:
        return None
    header = (frame[tcp + 12] >> 4) * 4
    return Segment(frame[tcp + 13], max(0, ip_data - header), struct.unpack_from("!I", frame, tcp + 4)[0])
