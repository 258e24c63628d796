"""The NFSHUNT mangle chains: rendered from the config, applied atomically, removed cleanly.

All changes go through one `iptables-restore --noflush` transaction per address family,
so either the whole ruleset goes in or nothing changes. Only NFShunt's own chains and
its jump rules are ever touched. Both Debian back ends (nft and legacy) are driven
through the same front-end commands the system has selected.

VLAN trunks (issue 37, docs/vlans.md): the firewall is a bridge per VLAN over VLAN
sub-interfaces. Each sub-interface gets the physdevin of its group's link in the mark,
and its VLAN's conntrack zone in the raw table (chain NFSHUNT_ZONE), so the same
5-tuple in two VLANs is two connections. A frame that still carries a tag inside a
per-VLAN bridge (QinQ after the sub-interface popped the outer tag) would be forwarded
unjudged: ebtables chain NFSHUNT_TAGGED drops it. A config without VLANs renders exactly
what it did before: no raw section, no ebtables.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

from nfshunt import routed_checks
from nfshunt.config.settings import ACTIONS, Config, ConfigError
from nfshunt.records import markcodec
from nfshunt.records.model import Action

EXIT_FAILED = 1

# Decision chains: a policy rule `-g NFSHUNT_SHUNT` marks and ends NFSHUNT_POLICY for that
# packet (first match wins). A bare `-j MARK` rule does not end the chain: a later
# matching rule would overwrite its decision.
DECISIONS = {Action.SHUNT: "NFSHUNT_SHUNT", Action.BLOCK: "NFSHUNT_BLOCK", Action.IGNORE: "NFSHUNT_IGNORE"}
CHAINS = ("NFSHUNT_PRE", "NFSHUNT_PRE_PD_IN", "NFSHUNT_PRE_PD_BACK", "NFSHUNT_POST", "NFSHUNT_POST_PD_OUT",
          *DECISIONS.values(), "NFSHUNT_POLICY")
JUMPS = (("PREROUTING", "NFSHUNT_PRE"), ("POSTROUTING", "NFSHUNT_POST"))
# The raw table's: each VLAN sub-interface's conntrack zone, set before conntrack looks.
ZONE_CHAIN = "NFSHUNT_ZONE"
ZONE_JUMP = ("PREROUTING", ZONE_CHAIN)
RAW_CHAINS = (ZONE_CHAIN,)
RAW_JUMPS = (ZONE_JUMP,)
OURS = "0xffff0000"  # CONNMARK masks: the low 16 bits stay the admin's
# Tagged frames are filtered as IP too; with 0 they cross the bridge unjudged.
VLAN_SYSCTL = "/proc/sys/net/bridge/bridge-nf-filter-vlan-tagged"
SYSCTL = {"ipv4": "/proc/sys/net/bridge/bridge-nf-call-iptables",
          "ipv6": "/proc/sys/net/bridge/bridge-nf-call-ip6tables"}
TOOLS = {"ipv4": ("iptables", "iptables-restore"), "ipv6": ("ip6tables", "ip6tables-restore")}


class IptablesError(RuntimeError):
    pass


def _hex(v: int) -> str:
    return f"0x{v:08x}"


def xmark(value_mask: tuple[int, int]) -> str:
    return f"{_hex(value_mask[0])}/{_hex(value_mask[1])}"


@dataclass(frozen=True)
class BridgePort:
    """One firewall interface the plumbing names: a port group's own bridge port (its
    untagged frames) or the sub-interface of one of its VLANs. physdevin is the group's
    link's either way (the mark's 15 numbers name links, not VLANs); the zone tells VLANs
    apart."""
    physdevin: int
    ifname: str
    zone: int = 0
    vlan: int = 0  # the VLAN id on the trunk; 0: untagged frames
    trunk: str | None = None  # the group's bridge_port when the group carries VLANs
    at: str = ""  # the group's key in the config


def bridge_ports(cfg: Config) -> list[BridgePort]:
    if routed_checks.routed(cfg):
        return []  # a routing firewall has no bridge: its interfaces are routed_checks.interfaces'
    ports = []
    for sw in cfg.switches:  # the key named as it is in the file (switches[i].ports[j] with several)
        for i, g in enumerate(sw.ports):
            at = f"{sw.at}ports[{i}]"
            if not g.bridge_port:
                raise ConfigError(f"{at}.bridge_port",
                                  "required for iptables: the bridge interface cabled to this group's slow port")
            trunk = g.bridge_port if g.trunk else None
            if g.untagged is not None:
                ports.append(BridgePort(g.physdevin, g.bridge_port, g.untagged, 0, trunk, at))
            ports += [BridgePort(g.physdevin, vlan.bridge_port or f"{g.bridge_port}.{vlan.id}", vlan.zone, vlan.id,
                                 trunk, at) for vlan in g.vlans]
    return ports


def untagged_off(cfg: Config) -> list[tuple[str, str]]:
    """(key, interface) of the trunks that carry no untagged frames: not bridge ports."""
    return [(f"{sw.at}ports[{i}]", g.bridge_port) for sw in cfg.switches for i, g in enumerate(sw.ports)
            if g.untagged is None and g.bridge_port]


def plumbing_rules(cfg: Config) -> list[str]:
    """The rules of NFShunt's four plumbing chains (BRIEF.md section 4)."""
    if routed_checks.routed(cfg):
        return routed_rules(cfg)
    ports = [(p.physdevin, p.ifname) for p in bridge_ports(cfg)]
    rules = [
        # Only packets that entered through a bridge port concern NFShunt.
        "-A NFSHUNT_PRE -m physdev ! --physdev-is-in -j RETURN",
        f"-A NFSHUNT_PRE -j CONNMARK --restore-mark --nfmask {OURS} --ctmask {OURS}",
        f"-A NFSHUNT_PRE -m mark --mark 0x0/{_hex(markcodec.FLAG_INGRESS)} -j NFSHUNT_PRE_PD_IN",
    ]
    rules += [f"-A NFSHUNT_PRE_PD_IN -m physdev --physdev-in {ifname} -j MARK --set-xmark "
              f"{xmark(markcodec.ingress_xmark(n))}" for n, ifname in ports]
    flooded = _floods(cfg)
    if flooded:
        rules += _egress_from_replies(ports)
    rules += [
        "-A NFSHUNT_POST -m physdev ! --physdev-is-bridged -j RETURN",
        f"-A NFSHUNT_POST -m mark --mark 0x0/{_hex(markcodec.FLAG_INGRESS)} -j RETURN",
        # Each copy of a flooded packet passes here with its own port out; the first records
        # the egress, the others take its record rather than write theirs over it.
        *([f"-A NFSHUNT_POST -j CONNMARK --restore-mark --nfmask {EGRESS} --ctmask {EGRESS}"] if flooded else []),
        f"-A NFSHUNT_POST -m mark --mark 0x0/{_hex(markcodec.FLAG_EGRESS)} -j NFSHUNT_POST_PD_OUT",
        # A packet that came in decided (its entry's mark, restored) saves nothing back: one
        # in flight when a policy change cleared the entry's decision would write the old
        # decision over the cleared one, and every later packet would keep it (seen: a
        # transfer left on the old policy's path after `iptables apply --policy`).
        f"-A NFSHUNT_POST -m mark --mark {_hex(markcodec.FLAG_DECIDED)}/{_hex(markcodec.FLAG_DECIDED)} -j RETURN",
        "-A NFSHUNT_POST -j NFSHUNT_POLICY",
        f"-A NFSHUNT_POST -j CONNMARK --save-mark --nfmask {OURS} --ctmask {OURS}",
    ]
    rules += [f"-A NFSHUNT_POST_PD_OUT -m physdev --physdev-is-bridged --physdev-out {ifname} "
              f"-j MARK --set-xmark {xmark(markcodec.egress_xmark(n))}" for n, ifname in ports]
    return rules + _decision_rules(cfg)


EGRESS = _hex(markcodec.FLAG_EGRESS | markcodec.EGRESS_MASK)


def _floods(cfg: Config) -> bool:
    """Whether a bridge has more than two of the plumbed ports: a first packet to a MAC it
    has not learnt (aged out, a failover's empty table) is flooded to all of them, and the
    port recorded as the egress may be another group's, whose network a shunt would then
    send the connection to. Bridges are per zone (one per VLAN, docs/vlans.md)."""
    per_zone = Counter(p.zone for p in bridge_ports(cfg))
    return any(n > 2 for n in per_zone.values())


def _egress_from_replies(ports: list[tuple[int, str]]) -> list[str]:
    """The egress as the connection's replies show it: a reply enters by the port its
    sender is behind, one port, never a flood. A reply that enters elsewhere than the
    recorded egress records its own port, in the entry too (its update tells the
    controller, which takes down a pair installed on the first record)."""
    rules = ["-A NFSHUNT_PRE -m conntrack --ctdir REPLY -m mark --mark "
             f"{_hex(markcodec.FLAG_EGRESS)}/{_hex(markcodec.FLAG_EGRESS)} -j NFSHUNT_PRE_PD_BACK"]
    for n, ifname in ports:
        value = xmark(markcodec.egress_xmark(n))
        rules += [f"-A NFSHUNT_PRE_PD_BACK -m physdev --physdev-in {ifname} -m mark ! --mark {value} "
                  f"-j CONNMARK --set-xmark {value}",
                  f"-A NFSHUNT_PRE_PD_BACK -m physdev --physdev-in {ifname} -m mark ! --mark {value} "
                  f"-j MARK --set-xmark {value}"]
    return rules


def routed_rules(cfg: Config) -> list[str]:
    """The same chains on a routing firewall: its interfaces named by -i / -o (mangle
    PREROUTING / POSTROUTING), no physdev. A packet the firewall sends itself never passes
    NFSHUNT_PRE, so it has no ingress flag and NFSHUNT_POST returns at once. Mangle
    POSTROUTING runs before nat's, and the NEW event after both: it carries the mark and a
    NAT's reply tuple together (docs/design/routed.md, 5.1)."""
    ports = routed_checks.interfaces(cfg)
    rules = [
        f"-A NFSHUNT_PRE -j CONNMARK --restore-mark --nfmask {OURS} --ctmask {OURS}",
        f"-A NFSHUNT_PRE -m mark --mark 0x0/{_hex(markcodec.FLAG_INGRESS)} -j NFSHUNT_PRE_PD_IN",
    ]
    rules += [f"-A NFSHUNT_PRE_PD_IN -i {ifname} -j MARK --set-xmark {xmark(markcodec.ingress_xmark(n))}"
              for n, ifname in ports]
    rules += [
        f"-A NFSHUNT_POST -m mark --mark 0x0/{_hex(markcodec.FLAG_INGRESS)} -j RETURN",
        f"-A NFSHUNT_POST -m mark --mark 0x0/{_hex(markcodec.FLAG_EGRESS)} -j NFSHUNT_POST_PD_OUT",
        f"-A NFSHUNT_POST -m mark --mark {_hex(markcodec.FLAG_DECIDED)}/{_hex(markcodec.FLAG_DECIDED)} -j RETURN",
        "-A NFSHUNT_POST -j NFSHUNT_POLICY",
        f"-A NFSHUNT_POST -j CONNMARK --save-mark --nfmask {OURS} --ctmask {OURS}",
    ]
    rules += [f"-A NFSHUNT_POST_PD_OUT -o {ifname} -j MARK --set-xmark {xmark(markcodec.egress_xmark(n))}"
              for n, ifname in ports]
    return rules + _decision_rules(cfg)


def _decision_rules(cfg: Config) -> list[str]:
    rules = []
    for action, chain in DECISIONS.items():
        number = _action_number(cfg, action)
        if number is not None:
            rules.append(f"-A {chain} -j MARK --set-xmark {xmark(markcodec.action_xmark(number))}")
    return rules


def _action_number(cfg: Config, action: Action) -> int | None:
    numbers = [n for n, a in cfg.mark_actions.items() if a is action]
    return min(numbers) if numbers else None


def read_policy(path: str) -> list[str]:
    """Rules for NFSHUNT_POLICY: lines starting '-A NFSHUNT_POLICY'; '#' comments.
    A rule with '-4' or '-6' applies to that family only (iptables-restore semantics)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise IptablesError(f"cannot read policy file {path}: {exc.strerror}") from None
    rules = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not line.startswith("-A NFSHUNT_POLICY "):
            raise IptablesError(f"{path}:{number}: policy rules must start with '-A NFSHUNT_POLICY', got: {line}")
        if any(ch in line for ch in "\n\r\0"):
            raise IptablesError(f"{path}:{number}: control characters in rule")
        rules.append(line)
    return rules


@dataclass
class Existing:
    """What of NFShunt is installed already (read through exit codes, not output)."""

    chains: set[str]
    jumps: set[tuple[str, str]]


def render(cfg: Config, policy: list[str] | None, existing: Existing | None = None) -> str:
    """iptables-restore --noflush input. Declaring a chain flushes it, so NFSHUNT_POLICY
    is declared only when it is new or a policy replaces it; jumps are added only when
    missing, so applying twice leaves one copy. The raw table's zones follow the mangle
    table (none without VLANs: a config that dropped its VLANs takes them out)."""
    existing = existing or Existing(set(), set())
    out = ["*mangle"]
    for chain in CHAINS:
        if chain != "NFSHUNT_POLICY" or policy is not None or chain not in existing.chains:
            out.append(f":{chain} - [0:0]")
    out += plumbing_rules(cfg)
    if policy:
        out += policy
    for builtin, target in JUMPS:
        if (builtin, target) not in existing.jumps:
            out.append(f"-I {builtin} 1 -j {target}")
    out.append("COMMIT")
    out += zone_section(bridge_ports(cfg), existing)
    return "\n".join(out) + "\n"


def zone_section(ports: list[BridgePort], existing: Existing) -> list[str]:
    """The raw table's NFSHUNT_ZONE: each zoned interface's packets get their VLAN's
    conntrack zone before conntrack looks them up (design F2); jumped to first."""
    zoned = [p for p in ports if p.zone]
    if not zoned:
        return _zone_removal(existing)
    out = ["*raw", f":{ZONE_CHAIN} - [0:0]"]
    out += [f"-A {ZONE_CHAIN} -m physdev --physdev-in {p.ifname} -j CT --zone {p.zone}" for p in zoned]
    if ZONE_JUMP not in existing.jumps:
        out.append(f"-I {ZONE_JUMP[0]} 1 -j {ZONE_CHAIN}")
    return out + ["COMMIT"]


def _zone_removal(existing: Existing) -> list[str]:
    if ZONE_CHAIN not in existing.chains and ZONE_JUMP not in existing.jumps:
        return []
    out = ["*raw"] + ([f"-D {ZONE_JUMP[0]} -j {ZONE_CHAIN}"] if ZONE_JUMP in existing.jumps else [])
    if ZONE_CHAIN in existing.chains:
        out += [f":{ZONE_CHAIN} - [0:0]", f"-X {ZONE_CHAIN}"]
    return out + ["COMMIT"]


def render_removal(existing: Existing) -> str:
    out = ["*mangle"]
    for builtin, target in JUMPS:
        if (builtin, target) in existing.jumps:
            out.append(f"-D {builtin} -j {target}")
    present = [c for c in CHAINS if c in existing.chains]
    out += [f":{c} - [0:0]" for c in present]  # flush first: the chains refer to each other
    out += [f"-X {c}" for c in present]
    out.append("COMMIT")
    out += _zone_removal(existing)
    return "\n".join(out) + "\n"


class Iptables:
    """One address family's iptables front end."""

    def __init__(self, family: str):
        self.family = family
        self.cmd, self.restore = TOOLS[family]

    def available(self) -> bool:
        return shutil.which(self.cmd) is not None and shutil.which(self.restore) is not None

    def _ok(self, table: str, *args: str) -> bool:
        return subprocess.run([self.cmd, "-w", "5", "-t", table, *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode == 0

    def existing(self) -> Existing:
        chains, jumps = set(), set()
        for table, names, links in (("mangle", CHAINS, JUMPS), ("raw", RAW_CHAINS, RAW_JUMPS)):
            chains |= {c for c in names if self._ok(table, "-S", c)}
            jumps |= {(b, t) for b, t in links if t in chains and self._ok(table, "-C", b, "-j", t)}
        # A jump can exist more than once if someone added it by hand; removal loops.
        return Existing(chains, jumps)

    def restore_text(self, text: str, test: bool = False) -> None:
        args = [self.restore, "-w", "5", "--noflush"] + (["--test"] if test else [])
        proc = subprocess.run(args, input=text, text=True, capture_output=True)
        if proc.returncode != 0:
            raise IptablesError(f"{self.restore} rejected the ruleset (nothing was changed): "
                                f"{proc.stderr.strip()}")

    def apply(self, cfg: Config, policy: list[str] | None) -> str:
        text = render(cfg, policy, self.existing())
        self.restore_text(text)
        return text

    def remove(self) -> None:
        for _ in range(16):  # duplicate jumps added by hand: remove them all
            existing = self.existing()
            if not existing.chains and not existing.jumps:
                return
            self.restore_text(render_removal(existing))
            if not existing.jumps:
                return


# --- ebtables: tagged frames inside a per-VLAN bridge ------------------------------------

TAGGED_CHAIN = "NFSHUNT_TAGGED"
# 802.1Q and 802.1ad: a frame a sub-interface handed on still tagged (the inner tag of a
# QinQ frame) crosses a Linux bridge with its tag and is not judged by iptables (F9, F10).
STACKED = ("802_1Q", "0x88a8")


def tagged_guards(ports: list[BridgePort]) -> list[str]:
    """The interfaces whose bridged frames must carry no tag: every interface of a group
    that carries VLANs (on its untagged port, a tagged frame is of a VLAN with no
    sub-interface: it reaches the bridge still tagged)."""
    return list(dict.fromkeys(p.ifname for p in ports if p.trunk))


def render_tagged(guards: list[str], chain_exists: bool) -> str:
    """ebtables-restore --noflush input: the chain (re)filled, jumped to first from FORWARD.
    Its policy is RETURN: a frame it does not drop goes on to the admin's own FORWARD rules
    (a user chain's default policy, ACCEPT, would end FORWARD for every frame)."""
    out = ["*filter"]
    out.append(f"-F {TAGGED_CHAIN}" if chain_exists else f":{TAGGED_CHAIN} RETURN")
    out += [f"-A {TAGGED_CHAIN} -i {ifname} -p {proto} -j DROP" for ifname in guards for proto in STACKED]
    if not chain_exists:
        out.append(f"-I FORWARD 1 -j {TAGGED_CHAIN}")
    return "\n".join(out + ["COMMIT"]) + "\n"


class Ebtables:
    """The bridge's own filter table (ebtables), for NFSHUNT_TAGGED only. The chain and its
    one jump go in and out in one transaction, so the chain's presence says the jump's
    (`ebtables -C` is unusable with ebtables-nft: design F11)."""

    cmd, restore = "ebtables", "ebtables-restore"

    def available(self) -> bool:
        return shutil.which(self.cmd) is not None and shutil.which(self.restore) is not None

    def exists(self) -> bool:
        if not self.available():
            return False
        return subprocess.run([self.cmd, "-t", "filter", "-L", TAGGED_CHAIN], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode == 0

    def restore_text(self, text: str) -> None:
        proc = subprocess.run([self.restore, "--noflush"], input=text, text=True, capture_output=True)
        if proc.returncode != 0:
            raise IptablesError(f"{self.restore} rejected the tagged-frame guard: {proc.stderr.strip()}")

    def apply(self, guards: list[str]) -> None:
        if guards:
            self.restore_text(render_tagged(guards, self.exists()))
        else:
            self.remove()

    def remove(self) -> None:
        if self.exists():
            self.restore_text(f"*filter\n-D FORWARD -j {TAGGED_CHAIN}\n-F {TAGGED_CHAIN}\n-X {TAGGED_CHAIN}\n"
                              "COMMIT\n")


# --- pre-flight checks ------------------------------------------------------------------

def preflight(cfg: Config, families: list[str], fix_sysctl: bool, notes: list[str] | None = None) -> list[str]:
    """Problems that must stop an apply, each with what to do; [] when all is well.
    Remarks that stop nothing go to `notes`."""
    if routed_checks.routed(cfg):
        return routed_checks.preflight(cfg, families, fix_sysctl)
    problems = []
    try:
        ports = bridge_ports(cfg)
    except ConfigError as exc:
        return [str(exc)]
    for family in families:
        ipt = Iptables(family)
        if not ipt.available():
            problems.append(f"{ipt.cmd}/{ipt.restore} not found: install the iptables package")
    vlans = any(p.trunk for p in ports)
    if vlans and not Ebtables().available():
        problems.append("ebtables/ebtables-restore not found: install the ebtables package (VLAN trunks need "
                        "it to drop stacked tags inside the per-VLAN bridges)")
    links = read_links([p.ifname for p in ports] + [ifname for _, ifname in untagged_off(cfg)])
    problems += _check_bridge_ports(ports, links)
    if vlans:
        problems += vlan_problems(ports, untagged_off(cfg), links, notes if notes is not None else [])
    problems += _sysctl_problems(families, fix_sysctl)
    return problems


def _sysctl_problems(families: list[str], fix_sysctl: bool) -> list[str]:
    problems = []
    for family in families:
        path = SYSCTL[family]
        name = path.removeprefix("/proc/sys/").replace("/", ".")
        try:
            with open(path) as fh:
                on = fh.read().strip() == "1"
        except OSError:
            problems.append(f"{name} is missing: the br_netfilter module is not loaded (modprobe br_netfilter)")
            continue
        if not on and not fix_sysctl:
            problems.append(f"{name} is 0, so iptables never sees bridged traffic: "
                            f"run `sysctl -w {name}=1` or pass --fix-sysctl")
    name = VLAN_SYSCTL.removeprefix("/proc/sys/").replace("/", ".")
    try:
        with open(VLAN_SYSCTL) as fh:
            vlan_on = fh.read().strip() == "1"
    except OSError:
        vlan_on = True  # no br_netfilter: reported above
    if not vlan_on and not fix_sysctl:
        problems.append(f"{name} is 0, so 802.1Q-tagged IP crosses the bridge without iptables: "
                        f"run `sysctl -w {name}=1` or pass --fix-sysctl")
    return problems


@dataclass(frozen=True)
class Link:
    """What netlink says of one interface, for the checks."""
    name: str
    bridge_port: bool = False
    master: str | None = None  # its bridge
    master_vlan_filtering: bool = False
    kind: str | None = None  # IFLA_INFO_KIND: "vlan", "veth", ...
    vlan_id: int | None = None  # a VLAN device's id, protocol (0x8100, 0x88a8) and parent
    vlan_protocol: int | None = None
    parent: str | None = None


def read_links(names: list[str]) -> dict[str, Link]:
    """The interfaces that exist, by name."""
    # Netlink rather than /sys: sysfs shows the namespace it was mounted in, not ours.
    from pyroute2 import IPRoute
    out = {}
    with IPRoute() as ipr:
        for ifname in dict.fromkeys(names):
            links = ipr.get_links(ifname=ifname) if ipr.link_lookup(ifname=ifname) else []
            if links:
                out[ifname] = _link(ipr, links[0])
    return out


def _link(ipr: Any, msg: Any) -> Link:
    def name_of(index: int | None) -> tuple[str | None, Any]:
        found = ipr.get_links(index) if index else []
        return (found[0].get_attr("IFLA_IFNAME"), found[0]) if found else (None, None)
    master, bridge = name_of(msg.get_attr("IFLA_MASTER"))
    filtering = bool(bridge is not None and bridge.get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA",
                                                              "IFLA_BR_VLAN_FILTERING"))
    kind = msg.get_nested("IFLA_LINKINFO", "IFLA_INFO_KIND")
    vlan: dict[str, Any] = {}
    if kind == "vlan":
        vlan = {"vlan_id": msg.get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA", "IFLA_VLAN_ID"),
                "vlan_protocol": msg.get_nested("IFLA_LINKINFO", "IFLA_INFO_DATA", "IFLA_VLAN_PROTOCOL"),
                "parent": name_of(msg.get_attr("IFLA_LINK"))[0]}
    return Link(msg.get_attr("IFLA_IFNAME"),
                msg.get_nested("IFLA_LINKINFO", "IFLA_INFO_SLAVE_KIND") == "bridge", master, filtering, kind,
                **vlan)


def _check_bridge_ports(ports: list[BridgePort], links: dict[str, Link]) -> list[str]:
    problems = []
    for p in ports:
        if p.ifname not in links:
            problems.append(f"interface {p.ifname} does not exist: " + (
                f"create it (ip link add link {p.trunk} name {p.ifname} type vlan id {p.vlan}) or fix "
                f"{p.at}.vlans[].bridge_port" if p.vlan else "create it or fix ports[].bridge_port"))
        elif not links[p.ifname].bridge_port:
            problems.append(f"interface {p.ifname} is not a bridge port: `ip link set {p.ifname} master BRIDGE`")
    return problems


def vlan_problems(ports: list[BridgePort], no_untagged: list[tuple[str, str]], links: dict[str, Link],
                  notes: list[str]) -> list[str]:
    """A bridge per VLAN over sub-interfaces, as the config names them (design section 6.2)."""
    problems = []
    bridged = [(p, links[p.ifname]) for p in ports if p.ifname in links and links[p.ifname].master]
    bridge_of: dict[int, tuple[str, str]] = {}  # zone -> (its first interface, that one's bridge)
    zone_in: dict[str, tuple[str, int]] = {}  # bridge -> (its first interface, that one's zone)
    for p, link in bridged:
        master = str(link.master)
        first, bridge = bridge_of.setdefault(p.zone, (p.ifname, master))
        if bridge != master:
            problems.append(f"zone {p.zone}: {first} is in {bridge} but {p.ifname} is in {master}; put every "
                            "interface of a zone in one bridge")
        other, zone = zone_in.setdefault(master, (p.ifname, p.zone))
        if zone != p.zone:
            problems.append(f"{master} holds {other} (zone {zone}) and {p.ifname} (zone {p.zone}): one bridge "
                            "per VLAN")
    for master in dict.fromkeys(str(link.master) for _, link in bridged if link.master_vlan_filtering):
        problems.append(f"{master} has vlan_filtering on: NFShunt needs a bridge per VLAN over sub-interfaces "
                        "(see README \"VLANs\")")
    for at, ifname in no_untagged:
        if ifname in links and links[ifname].bridge_port:
            problems.append(f"{at}: {ifname} is a port of {links[ifname].master}, but the group carries no "
                            "untagged frames (\"untagged\": false), which would be bridged there in zone 0: "
                            f"`ip link set {ifname} nomaster`, or set \"untagged\"")
    problems += _vlan_devices([(p, links[p.ifname]) for p in ports if p.vlan and p.ifname in links], notes)
    return problems


def _vlan_devices(subifs: list[tuple[BridgePort, Link]], notes: list[str]) -> list[str]:
    problems, unchecked = [], []
    for p, link in subifs:
        if link.kind != "vlan":
            unchecked.append(f"{p.ifname} ({link.kind or 'no kind'})")
        elif link.vlan_protocol == 0x88A8:
            problems.append(f"{p.ifname} is 802.1ad: use 802.1Q (ip link add ... type vlan protocol 802.1Q)")
        elif link.vlan_id != p.vlan or link.parent != p.trunk:
            problems.append(f"{p.ifname} is VLAN {link.vlan_id} on {link.parent} (config: VLAN {p.vlan} on "
                            f"{p.trunk})")
    if unchecked:
        notes.append(f"not VLAN devices, their VLAN id and trunk not checked: {', '.join(unchecked)}")
    return problems


def fix_sysctls(families: list[str]) -> None:
    for path in [SYSCTL[family] for family in families] + [VLAN_SYSCTL]:
        with open(path) as fh:
            if fh.read().strip() == "1":
                continue
        with open(path, "w") as fh:
            fh.write("1\n")


# --- CLI handlers -------------------------------------------------------------------------

def _families(args: argparse.Namespace) -> list[str]:
    return ["ipv4"] if getattr(args, "ipv4_only", False) else ["ipv4", "ipv6"]


def _fail(msg: str) -> int:
    print(f"nfshunt iptables: {msg}", file=sys.stderr)
    return 1


def cmd_render(cfg: Config, args: argparse.Namespace) -> int:
    try:
        policy = read_policy(args.policy) if args.policy else None
        sys.stdout.write(render(cfg, policy if policy is not None else []))
    except (IptablesError, ConfigError) as exc:
        return _fail(str(exc))
    return 0


def cmd_apply(cfg: Config, args: argparse.Namespace) -> int:
    families = _families(args)
    try:
        policy = read_policy(args.policy) if args.policy else None
    except IptablesError as exc:
        return _fail(str(exc))
    notes: list[str] = []
    problems = preflight(cfg, families, args.fix_sysctl, notes)
    for note in notes:
        print(f"nfshunt iptables: note: {note}")
    if problems:
        for p in problems:
            print(f"nfshunt iptables: {p}", file=sys.stderr)
        print("nfshunt iptables: nothing was changed", file=sys.stderr)
        return 1
    tables = [Iptables(f) for f in families]
    texts = []
    try:
        # Validate every family before changing any, so a bad policy changes nothing.
        for ipt in tables:
            text = render(cfg, policy, ipt.existing())
            ipt.restore_text(text, test=True)
            texts.append(text)
        # Before the zones: a VLAN is never bridged with its stacked tags unjudged.
        Ebtables().apply(tagged_guards(bridge_ports(cfg)))
    except IptablesError as exc:
        return _fail(str(exc))
    if args.fix_sysctl:
        (routed_checks.fix_sysctls if routed_checks.routed(cfg) else fix_sysctls)(families)
    for ipt, text in zip(tables, texts, strict=True):
        try:
            ipt.restore_text(text)
        except IptablesError as exc:
            return _fail(f"{ipt.family}: {exc}")
    print(f"NFSHUNT chains applied ({', '.join(families)}); " + _zones_applied(bridge_ports(cfg))
          + ("NFSHUNT_POLICY replaced from " + args.policy if policy is not None else "NFSHUNT_POLICY kept"))
    if policy is not None and not getattr(args, "no_reevaluate", False):
        return reevaluate(cfg)
    return 0


def _zones_applied(ports: list[BridgePort]) -> str:
    zones = list(dict.fromkeys(p.zone for p in ports if p.zone))
    if not zones:
        return ""
    return (f"zones {', '.join(map(str, zones))} on {sum(1 for p in ports if p.vlan)} sub-interfaces, "
            f"stacked tags dropped on {len(tagged_guards(ports))} interfaces ({TAGGED_CHAIN}); ")


def reevaluate(cfg: Config) -> int:
    """A new policy applies to connections that already have a decision too: the running
    controller clears the decision bits of every conntrack entry (so the next packet of
    each crosses NFSHUNT_POLICY again) and takes the shunts and blocks down. Without a
    controller (no socket, or a socket a stopped or crashed one left behind) the marks are
    cleared here. Non-zero when that could not happen."""
    from nfshunt.app.control import ControlError, NotRunning, request
    reason = "use --no-reevaluate to apply a policy to new connections only"
    if not cfg.control_socket:
        return _clear_without_controller(cfg, "no control socket configured", reason)
    try:
        reply = request(cfg.control_socket, {"cmd": "reevaluate", "reason": "policy changed"}, timeout=30)
    except NotRunning as exc:
        return _clear_without_controller(cfg, str(exc), reason)
    except ControlError as exc:
        return _fail(f"policy applied, but existing connections were not re-evaluated: {exc} ({reason})")
    if "error" in reply:
        return _fail(f"policy applied, but the controller could not re-evaluate: {reply['error']} ({reason})")
    print(f"existing connections sent back through the new policy: {reply.get('removed', 0)} shunts and blocks"
          f" taken down, decisions cleared on {reply.get('cleared', 0)} conntrack entries"
          + (f"; {reply['ignored_meanwhile']} decisions read while they were cleared not acted on (a dump reads"
             " every entry again)" if reply.get("ignored_meanwhile") else "")
          + ("" if reply.get("switch_connected", True) else " (switch away: its flows go when it returns)"))
    return 0 if not reply.get("clear_failed") else EXIT_FAILED


def _clear_without_controller(cfg: Config, why: str, reason: str) -> int:
    from nfshunt.kernel.table import clear_marks
    try:
        cleared, failed = clear_marks(markcodec.DECISION_MASK)
    except OSError as exc:
        return _fail(f"policy applied, but existing connections were not re-evaluated: {exc} ({reason})")
    print(f"no running controller ({why}); decisions cleared on {cleared} conntrack entries"
          + (f", {failed} could not be updated" if failed else "")
          + f". Shunts and blocks kept on the switch are handed back to this policy when the controller "
          f"starts: it finds the policy changed since they were decided (state_dir {cfg.state_dir})")
    return 0 if not failed else EXIT_FAILED


def cmd_remove(cfg: Config, args: argparse.Namespace) -> int:
    for family in _families(args):
        ipt = Iptables(family)
        if not ipt.available():
            return _fail(f"{ipt.cmd} not found")
        try:
            ipt.remove()
        except IptablesError as exc:
            return _fail(str(exc))
    try:
        Ebtables().remove()
    except IptablesError as exc:
        return _fail(str(exc))
    print("NFSHUNT chains and jumps removed")
    return 0


def cmd_mark(args: argparse.Namespace) -> int:
    from nfshunt.config.settings import load
    names = {"ignore": 0, "shunt": 1, "block": 2}
    if args.config:
        try:
            cfg = load(args.config)
        except ConfigError as exc:
            return _fail(str(exc))
        names = {}
        for number, action in sorted(cfg.mark_actions.items(), reverse=True):
            names[action] = number
    action = args.action
    if action.isascii() and action.isdigit():
        number = int(action)
        if number > markcodec.NIBBLE:
            return _fail(f"action number {number} does not fit in 4 bits (0-15)")
    elif action in names:
        number = names[action]
    else:
        known = ", ".join(sorted(names)) if names else ", ".join(ACTIONS)
        return _fail(f"unknown action {action!r} (known: {known})")
    print(f"-j MARK --set-xmark {xmark(markcodec.action_xmark(number))}")
    return 0
