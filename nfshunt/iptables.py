"""The NFSHUNT mangle chains: rendered from the config, applied atomically, removed cleanly.

All changes go through one `iptables-restore --noflush` transaction per address family,
so either the whole ruleset goes in or nothing changes. Only NFShunt's own chains and
its two jump rules are ever touched. Both Debian back ends (nft and legacy) are driven
through the same front-end commands the system has selected.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass

from nfshunt.config.settings import ACTIONS, Config, ConfigError
from nfshunt.records import markcodec
from nfshunt.records.model import Action

EXIT_FAILED = 1

# Decision chains: a policy rule `-g NFSHUNT_SHUNT` marks and ends NFSHUNT_POLICY for that
# packet (first match wins). A bare `-j MARK` rule does not end the chain: a later
# matching rule would overwrite its decision.
DECISIONS = {Action.SHUNT: "NFSHUNT_SHUNT", Action.BLOCK: "NFSHUNT_BLOCK", Action.IGNORE: "NFSHUNT_IGNORE"}
CHAINS = ("NFSHUNT_PRE", "NFSHUNT_PRE_PD_IN", "NFSHUNT_POST", "NFSHUNT_POST_PD_OUT",
          *DECISIONS.values(), "NFSHUNT_POLICY")
JUMPS = (("PREROUTING", "NFSHUNT_PRE"), ("POSTROUTING", "NFSHUNT_POST"))
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


def bridge_ports(cfg: Config) -> list[tuple[int, str]]:
    for sw in cfg.switches:  # the key named as it is in the file (switches[i].ports[j] with several)
        for i, g in enumerate(sw.ports):
            if g.vlans or g.untagged != 0:
                raise ConfigError(f"{sw.at}ports[{i}]", "nfshunt iptables does not plumb VLANs yet (their "
                                  "conntrack zones and sub-interfaces): VLAN shunts arrive in the next release")
            if not g.bridge_port:
                raise ConfigError(f"{sw.at}ports[{i}].bridge_port",
                                  "required for iptables: the bridge interface cabled to this group's slow port")
    return [(g.physdevin, g.bridge_port) for g in cfg.all_port_groups]  # type: ignore[misc]


def plumbing_rules(cfg: Config) -> list[str]:
    """The rules of NFShunt's four plumbing chains (BRIEF.md section 4)."""
    ports = bridge_ports(cfg)
    rules = [
        # Only packets that entered through a bridge port concern NFShunt.
        "-A NFSHUNT_PRE -m physdev ! --physdev-is-in -j RETURN",
        f"-A NFSHUNT_PRE -j CONNMARK --restore-mark --nfmask {OURS} --ctmask {OURS}",
        f"-A NFSHUNT_PRE -m mark --mark 0x0/{_hex(markcodec.FLAG_INGRESS)} -j NFSHUNT_PRE_PD_IN",
    ]
    rules += [f"-A NFSHUNT_PRE_PD_IN -m physdev --physdev-in {ifname} -j MARK --set-xmark "
              f"{xmark(markcodec.ingress_xmark(n))}" for n, ifname in ports]
    rules += [
        "-A NFSHUNT_POST -m physdev ! --physdev-is-bridged -j RETURN",
        f"-A NFSHUNT_POST -m mark --mark 0x0/{_hex(markcodec.FLAG_INGRESS)} -j RETURN",
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
    missing, so applying twice leaves one copy."""
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
    return "\n".join(out) + "\n"


def render_removal(existing: Existing) -> str:
    out = ["*mangle"]
    for builtin, target in JUMPS:
        if (builtin, target) in existing.jumps:
            out.append(f"-D {builtin} -j {target}")
    present = [c for c in CHAINS if c in existing.chains]
    out += [f":{c} - [0:0]" for c in present]  # flush first: the chains refer to each other
    out += [f"-X {c}" for c in present]
    out.append("COMMIT")
    return "\n".join(out) + "\n"


class Iptables:
    """One address family's iptables front end."""

    def __init__(self, family: str):
        self.family = family
        self.cmd, self.restore = TOOLS[family]

    def available(self) -> bool:
        return shutil.which(self.cmd) is not None and shutil.which(self.restore) is not None

    def _ok(self, *args: str) -> bool:
        return subprocess.run([self.cmd, "-w", "5", "-t", "mangle", *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode == 0

    def existing(self) -> Existing:
        chains = {c for c in CHAINS if self._ok("-S", c)}
        jumps = {(b, t) for b, t in JUMPS if t in chains and self._ok("-C", b, "-j", t)}
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


# --- pre-flight checks ------------------------------------------------------------------

def preflight(cfg: Config, families: list[str], fix_sysctl: bool) -> list[str]:
    """Problems that must stop an apply, each with what to do; [] when all is well."""
    problems = []
    try:
        ports = bridge_ports(cfg)
    except ConfigError as exc:
        return [str(exc)]
    for family in families:
        ipt = Iptables(family)
        if not ipt.available():
            problems.append(f"{ipt.cmd}/{ipt.restore} not found: install the iptables package")
    problems += _check_bridge_ports([ifname for _, ifname in ports])
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


def _check_bridge_ports(names: list[str]) -> list[str]:
    # Netlink rather than /sys: sysfs shows the namespace it was mounted in, not ours.
    from pyroute2 import IPRoute
    problems = []
    with IPRoute() as ipr:
        for ifname in names:
            links = ipr.get_links(ifname=ifname) if ipr.link_lookup(ifname=ifname) else []
            if not links:
                problems.append(f"interface {ifname} does not exist: create it or fix ports[].bridge_port")
                continue
            if links[0].get_nested("IFLA_LINKINFO", "IFLA_INFO_SLAVE_KIND") != "bridge":
                problems.append(f"interface {ifname} is not a bridge port: `ip link set {ifname} master BRIDGE`")
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
    problems = preflight(cfg, families, args.fix_sysctl)
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
    except IptablesError as exc:
        return _fail(str(exc))
    if args.fix_sysctl:
        fix_sysctls(families)
    for ipt, text in zip(tables, texts, strict=True):
        try:
            ipt.restore_text(text)
        except IptablesError as exc:
            return _fail(f"{ipt.family}: {exc}")
    print(f"NFSHUNT chains applied ({', '.join(families)}); "
          + ("NFSHUNT_POLICY replaced from " + args.policy if policy is not None else "NFSHUNT_POLICY kept"))
    if policy is not None and not getattr(args, "no_reevaluate", False):
        return reevaluate(cfg)
    return 0


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
