"""A routing firewall's side of `nfshunt iptables` (forwarding "routed"): the interfaces its
plumbing names with -i/-o, and what they must be before the plumbing goes in.

The firewall routes between its interfaces, each cabled to a slow port of the switch: each is
the gateway of the hosts behind its fast port, so it must exist, be up, carry an address of each
family applied, and not be a bridge port; the kernel must forward; and every routed interface
must have one MTU: a shunt carries frames from one port group's link to another's, and a switch
drops a frame too big for its egress port silently (no ICMP, no counter: design F8), where the
router would have fragmented it or answered "packet too big". Read over netlink (pyroute2), as
the bridged checks are (docs/design/routed.md, section 3).
"""
from __future__ import annotations

import ipaddress
import socket

from nfshunt.config.settings import Config, ConfigError
from nfshunt.config.static import VIA_TABLE, routed_sides_of

IFF_UP = 0x1
FORWARDING = {"ipv4": "/proc/sys/net/ipv4/ip_forward", "ipv6": "/proc/sys/net/ipv6/conf/all/forwarding"}
FAMILY = {"ipv4": (socket.AF_INET, "IPv4"), "ipv6": (socket.AF_INET6, "IPv6")}


def routed(cfg: Config) -> bool:
    """The firewall routes (every switch's forwarding is the same: config/settings holds it)."""
    return cfg.switches[0].forwarding == "routed"


def interfaces(cfg: Config) -> list[tuple[int, str]]:
    """(physdevin, interface) of every routed interface (a group's own, carrying its untagged
    frames, and each VLAN's sub-interface); ConfigError naming the first without one."""
    for sw in cfg.switches:
        for i, g in enumerate(sw.ports):
            if g.untagged is not None and not g.interface:
                raise ConfigError(f"{sw.at}ports[{i}].interface", "required for iptables in routed mode: the "
                                  "firewall's interface cabled to this group's slow port" +
                                  (" (or \"untagged\": false, if its trunk carries VLANs only)" if g.vlans else ""))
    return [(side.physdevin, side.interface) for sw in cfg.switches  # type: ignore[misc]
            for side in sw.sides.values()]


def preflight(cfg: Config, families: list[str], fix_sysctl: bool) -> list[str]:
    """Problems that must stop an apply on a routing firewall, each with what to do."""
    try:
        names = [name for _, name in interfaces(cfg)]
    except ConfigError as exc:
        return [str(exc)]
    problems = check_interfaces(names, families) + via_problems(cfg)
    for family in families:
        name = FORWARDING[family].removeprefix("/proc/sys/").replace("/", ".")
        try:
            with open(FORWARDING[family]) as fh:
                on = fh.read().strip() == "1"
        except OSError:
            problems.append(f"{name} is missing: this kernel has no {FAMILY[family][1]}")
            continue
        if not on and not fix_sysctl:
            problems.append(f"{name} is 0, so the firewall does not route {FAMILY[family][1]}: "
                            f"run `sysctl -w {name}=1` or pass --fix-sysctl")
    return problems


def fix_sysctls(families: list[str]) -> None:
    for family in families:
        with open(FORWARDING[family], "w") as fh:
            fh.write("1\n")


def mtu_problem(mtus: dict[str, int]) -> str | None:
    """What is wrong when the routed interfaces' MTUs differ (None when they agree), naming
    each interface with its MTU, the largest first."""
    if len(set(mtus.values())) <= 1:
        return None
    named = ", ".join(f"{name} has MTU {mtu}" for name, mtu in sorted(mtus.items(), key=lambda nm: (-nm[1], nm[0])))
    return (f"the routed interfaces' MTUs differ ({named}): a routed shunt would carry a frame the router must "
            "fragment or answer with \"packet too big\" to a smaller link, where the switch drops it silently; "
            "give every routed interface (and its switch ports) one MTU")


def via_problems(cfg: Config) -> list[str]:
    """Each static shunt's `via` address on a subnet of its destination side's routed interface
    (the next hop is a neighbour on that link); one that is not is named with its key."""
    problems: list[str] = []
    given = [(i, s, s.via) for i, s in enumerate(cfg.static_shunts) if s.via is not None and s.via != VIA_TABLE]
    if not given:
        return problems
    from pyroute2 import IPRoute
    with IPRoute() as ipr:
        for i, shunt, via in given:
            sw = next(sw for sw in cfg.switches if shunt.on(sw))
            sides = routed_sides_of(shunt, sw)  # (config.static checked them)
            interface = sides[1].interface if sides is not None else None
            index = ipr.link_lookup(ifname=interface) if interface else []
            nets = [ipaddress.ip_interface(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}").network
                    for a in (ipr.get_addr(index=index[0]) if index else ()) if a["scope"] == 0]
            if not any(ipaddress.ip_address(via) in net for net in nets):
                problems.append(f"static_shunts[{i}].via: {via} is not on a subnet of {interface}, the "
                                f"destination side's routed interface ({', '.join(map(str, nets)) or 'no address'}): "
                                "a next hop is a neighbour on that link; name one there, or \"table\"")
    return problems


def check_interfaces(names: list[str], families: list[str]) -> list[str]:
    from pyroute2 import IPRoute
    problems: list[str] = []
    mtus: dict[str, int] = {}
    with IPRoute() as ipr:
        for ifname in names:
            index = ipr.link_lookup(ifname=ifname)
            if not index:
                problems.append(f"interface {ifname} does not exist: create it or fix ports[].interface (a "
                                "routed VLAN's: ports[].vlans[].interface)")
                continue
            link = ipr.get_links(index[0])[0]
            mtus[ifname] = link.get_attr("IFLA_MTU")
            if link.get_nested("IFLA_LINKINFO", "IFLA_INFO_SLAVE_KIND") == "bridge":
                problems.append(f"interface {ifname} is a bridge port: a routing firewall routes between its "
                                f"interfaces (`ip link set {ifname} nomaster`, or forwarding \"bridged\")")
            if not link["flags"] & IFF_UP:
                problems.append(f"interface {ifname} is down: `ip link set {ifname} up`")
            for family in families:
                af, label = FAMILY[family]
                if not [a for a in ipr.get_addr(family=af, index=index[0]) if a["scope"] == 0]:  # (not link-local)
                    problems.append(f"interface {ifname} has no {label} address: a routed interface is the "
                                    f"gateway of the hosts behind its port group, give it one (or --ipv4-only)")
    mtu = mtu_problem(mtus)
    return problems + [mtu] if mtu else problems
