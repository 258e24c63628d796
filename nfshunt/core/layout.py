"""How a pair lies on the switch: the entries it takes in table 0, and whether its flows
go on to the pipeline layout's table 1 (whose catchers every TCP shunt shares) or carry
catchers of their own (the single layout). Read by the core's budget, the flow builder
and the probe's recommendation. No I/O."""
from __future__ import annotations

from nfshunt.config.settings import Config
from nfshunt.config.switch import SwitchConfig
from nfshunt.records.model import OFP10, OFP13, TCP, Action

from .connection import Conn

PIPELINE_ENTRIES = 5  # table-1 flows per port group: FIN and RST catchers for IPv4 and IPv6, the output
SINGLE_TCP_ENTRIES = 6  # a TCP shunt in the single layout: its two flows and four catchers


def catches_teardown(version: int | None, cfg: Config, conn: Conn) -> bool:
    """A TCP shunt on OpenFlow 1.3 gets FIN and RST catchers (see teardown.py)."""
    return version != OFP10 and cfg.tcp_teardown and conn.action is Action.SHUNT and conn.orig.proto == TCP


def watches_closes(version: int, cfg: Config, switch: SwitchConfig) -> bool:
    """The switch can show a watched close's packets to the controller: the catchers' own
    terms (OpenFlow 1.3, tcp_teardown), with their packet-in meter."""
    return version >= OFP13 and cfg.tcp_teardown and bool(switch.packet_in_rate)


def entries_per_pair(teardown: bool, pipeline: bool) -> int:
    """Entries a pair takes in table 0: a TCP shunt with its catchers (`teardown`) in the
    single layout, else its two flows (the pipeline layout shares its catchers)."""
    return SINGLE_TCP_ENTRIES if teardown and not pipeline else 2


def max_pair_entries(version: int | None, cfg: Config, pipeline: bool) -> int:
    """The most entries one pair takes in table 0."""
    return entries_per_pair(version != OFP10 and cfg.tcp_teardown, pipeline)


def pair_entries(version: int | None, cfg: Config, conn: Conn, pipeline: bool = False) -> int:
    """Flow entries this pair takes on the switch (every new pair asks: the pipeline
    layout's answer needs no look at the pair)."""
    return entries_per_pair(not pipeline and catches_teardown(version, cfg, conn), pipeline)


def goes_to_pipeline(version: int | None, cfg: Config, action: Action, proto: int, pipeline: bool) -> bool:
    """Whether a pair's table-0 flows go on to table 1 (pipeline layout, TCP shunt with
    teardown) instead of outputting (or dropping) themselves."""
    return pipeline and version != OFP10 and cfg.tcp_teardown and action is Action.SHUNT and proto == TCP
