"""The `nfshunt` command."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from nfshunt.config.settings import DEFAULT_CONTROL_SOCKET, Config, ConfigError, load

from . import __version__

# Exit codes (docs/operating.md's table): 0 done; 1 failed (the controller not
# reached, a request refused or not answered, a reload failed on it and put back); 2 a
# config that fails validation (or a usage error: argparse's); reload only: 3 applied
# but not known to be in every switch yet (pending), 4 applied and a switch refused a
# flow-mod of it.
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_PENDING = 3
EXIT_REFUSED = 4


class JsonFormatter(logging.Formatter):
    """One JSON object a line. The time's text to the second is made once a second, not per
    line: at thousands of lines a second (a shunt's and a removal's each) strftime was a
    good part of a line's cost."""

    _second: tuple[int, str] = (-1, "")  # (whole second, its text): replaced whole, never half-updated

    def format(self, record: logging.LogRecord) -> str:
        whole = int(record.created)
        second, text = self._second
        if whole != second:
            text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
            self._second = (whole, text)
        entry = {"time": f"{text}.{int(record.msecs):03d}Z", "ts": round(record.created, 6),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        # Structured fields a log call attaches with extra={"fields": {...}}.
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str = "text") -> None:
    from nfshunt.observe.logs import BatchedStreamHandler
    handler: logging.Handler = BatchedStreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # No format here (nor os-ken's) shows a record's caller, thread or process: logging
    # finds each record's caller by walking the stack, and names its thread and process,
    # for every line unless told not to (its documented switches; a third of a line's cost).
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root.setLevel(logging.WARNING)  # os-ken is chatty at INFO
    logging.getLogger("nfshunt").setLevel(level)


def _load(path: str) -> Config:
    try:
        return load(path)
    except ConfigError as exc:
        print(f"nfshunt: {path}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    setup_logging(args.log_level or cfg.log_level, args.log_format or cfg.log_format)
    from nfshunt.app import controller
    return controller.run(cfg, os.path.abspath(args.config))


def cmd_check_config(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    print(f"{args.config}: OK: {len(cfg.all_port_groups)} port groups, actions "
          + ", ".join(f"{n}={a}" for n, a in sorted(cfg.mark_actions.items()))
          + f", OpenFlow {'/'.join(cfg.openflow_versions)} on {cfg.listen_address}:{cfg.listen_port}")
    for sw in cfg.switches:
        where = f"switch {sw.datapath_id:016x} (port groups " + ", ".join(str(g.physdevin) for g in sw.ports) + \
            "): " if sw.at else ""  # listed in `switches`
        print(f"{where}entries deleted after confirm={sw.confirm}"
              + (f" (+{sw.confirm_delay:g} s)" if sw.confirm != "barrier" else "") + f" and a {sw.drain:g} s drain")
    if cfg.pair is not None:
        print(f"firewall pair member: starts {cfg.pair.start_role} unless {cfg.pair.state_file} says otherwise; "
              "`nfshunt role master|backup` (keepalived's notify) changes it, for the VRRP instance(s) "
              + ", ".join(cfg.pair.vrrp_instances) + " only")
    for warning in cfg.security_warnings():
        print(f"WARNING: {warning}")
    return 0


def cmd_vrrp_instances(args: argparse.Namespace) -> int:
    """The VRRP instances whose state changes move this controller, one a line: what
    nfshunt-notify-fifo acts on (keepalived's other instances are not NFShunt's)."""
    cfg = _load(args.config)
    if cfg.pair is None:
        print(f"nfshunt: {args.config}: no 'pair': this controller follows no VRRP instance", file=sys.stderr)
        return EXIT_FAILED
    print("\n".join(cfg.pair.vrrp_instances))
    return 0


def cmd_iptables(args: argparse.Namespace) -> int:
    from . import iptables
    if args.ipt_cmd == "mark":
        return iptables.cmd_mark(args)
    cfg = _load(args.config)
    return {"render": iptables.cmd_render, "apply": iptables.cmd_apply,
            "remove": iptables.cmd_remove}[args.ipt_cmd](cfg, args)


def _socket(args: argparse.Namespace) -> str:
    if args.socket:
        return args.socket
    if args.config:
        path = _load(args.config).control_socket
        if not path:
            print("nfshunt: the config sets no control_socket", file=sys.stderr)
            raise SystemExit(1)
        return path
    return DEFAULT_CONTROL_SOCKET


def _ask(args: argparse.Namespace, payload: dict) -> dict | None:
    from nfshunt.app.control import ControlError, request
    try:
        reply = request(_socket(args), payload)
    except ControlError as exc:
        print(f"nfshunt: {exc}", file=sys.stderr)
        return None
    if "error" in reply:
        print(f"nfshunt: {reply['error']}", file=sys.stderr)
        return None
    return reply


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def cmd_status(args: argparse.Namespace) -> int:
    request: dict[str, Any] = {"cmd": "status"}
    if args.static is not None:  # one page of the static flows' rows (all streams', or NAME's)
        request.update({"static": True, "limit": args.limit, "offset": args.offset})
        if args.static:
            request["name"] = args.static
    reply = _ask(args, request)
    if reply is None:
        return 1
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
        return 0
    switches = reply["switches"]
    for sw in switches:
        name = f"switch {sw['datapath_id']}" if len(switches) > 1 else "switch"
        print(f"{name}: {'connected' if sw['connected'] else 'NOT CONNECTED'}"
              + (f" dpid {sw['datapath_id']} OpenFlow {sw['openflow']} from {sw['address']}" if sw["connected"]
                 else "")
              + (f", shunts {sw['shunts']}, blocks {sw['blocks']}" if len(switches) > 1 else ""))
        pair = sw.get("pair")
        if pair:
            print(f"pair: {pair['wanted']} (switch granted: {pair['granted'] or 'nothing yet'}), generation "
                  f"{pair['generation']}, switch's {pair['switch_generation']}"
                  + (f"; backup because {pair['why_backup']}" if pair["why_backup"] and pair["wanted"] == "backup"
                     else "")
                  + (f"; yielding to the claim of generation {pair['yielded_to']} (claimed again once it is let go)"
                     if pair.get("yielded_to") is not None else ""))
        table = sw.get("table") or {}
        if table.get("layout"):
            size = (f"{table['used']} of {table['max_entries']} entries used by NFShunt, {table['free']} free"
                    if table.get("max_entries") is not None else f"{table['used']} entries used by NFShunt")
            shared = f"; table 1: {table['table_1']} shared entries" if table.get("layout") == "pipeline" else ""
            print(f"{name} table 0: {size} ({table['layout']} flow layout{shared})")
    budget = f" of {reply['max_shunts']}" if reply["max_shunts"] else ""
    print(f"shunts {reply['shunts']}, blocks {reply['blocks']}{budget}, waiting for room {reply['waiting']}, "
          f"waiting for the switch {reply.get('pending', 0)}, "
          f"up {reply['uptime']:.0f} s")
    sources = reply.get("rules_by_source") or {}
    if sources:
        print("decided by: " + ", ".join(f"{source} {n}" for source, n in sources.items()))
    _print_static(reply)
    conns = reply["connections"]
    if conns:
        print(f"{'action':<7}{'state':<9}{'tuple':<48}{'ports':>7}{'age s':>9}{'packets':>17}{'bytes':>17}")
        for cn in sorted(conns, key=lambda x: x["age"]):
            pk = "/".join(_size(x) for x in cn["packets"])
            by = "/".join(_size(x) for x in cn["bytes"])
            print(f"{cn['action']:<7}{cn['state']:<9}{cn['tuple']:<48}{cn['ingress']:>3}->{cn['egress']:<3}"
                  f"{cn['age']:>9.1f}{pk:>17}{by:>17}")
    return 0


def _print_static(reply: dict[str, Any]) -> None:
    """The static shunts' counts, and the page of their flows if one was asked."""
    st = reply.get("static") or {}
    if st.get("flows"):
        missing = f" ({st['missing']} NOT on the switch at the last read)" if st["missing"] else ""
        print(f"static shunts: {st['streams']} streams, {st['flows']} flows, {st['on_switch']} on the switch{missing}; "
              f"packets {_size(st['packets'])}, bytes {_size(st['bytes'])}"
              + ("" if "static_page" in reply else "  (nfshunt status --static [NAME] lists them)"))
    page = reply.get("static_page")
    if page is None:
        return
    rows = reply["static_shunts"]
    which = f" of {page['name']!r}" if page["name"] else ""
    more = f"; the next: --offset {page['next']}" if page["next"] is not None else ""
    first = f"{page['offset'] + 1}-{page['offset'] + len(rows)}" if rows else "none"
    print(f"static flows{which}: {first} of {page['matched']}{more}")
    if rows:
        print(f"{'name':<20}{'dir':<6}{'flow':<64}{'packets':>12}{'bytes':>12}")
    for row in rows:
        where = "" if row["on_switch"] else "  (not on the switch at the last read)"
        if "next_hop" in row:  # a routed flow (`via`): where it leaves, or why it crosses the firewall
            hop = row["next_hop"]
            where += f"  via {hop['neighbour'] or '?'} {hop['mac']} on {hop['interface']}" if hop else \
                f"  ({row['no_next_hop']})"
        print(f"{row['name'][:19]:<20}{row['direction'][:4]:<6}{row['flow']:<64}{_size(row['packets']):>12}"
              f"{_size(row['bytes']):>12}{where}")


def cmd_control(args: argparse.Namespace) -> int:
    payload: dict = {"cmd": args.cmd}
    if args.cmd == "flush":
        payload["reason"] = args.reason
    elif args.target.isascii() and args.target.isdigit():
        payload["ct_id"] = int(args.target)
    else:
        payload["tuple"] = args.target
    payload.update(_zone_args(args))
    reply = _ask(args, payload)
    if reply is None:
        return 1
    if args.cmd == "flush":
        print(f"flushed: {reply['removed']} shunts and blocks back to the slow path")
    else:
        print(f"{args.cmd}: {reply['tuple']}" + ("" if reply.get("flows_removed") or args.cmd == "block"
                                                 else " (not shunted now; held for its next appearance)"))
    return 0


def _zone_args(args: argparse.Namespace) -> dict[str, int]:
    """--vlan N / --zone N as the request's fields (the controller resolves a VLAN to its zone)."""
    return {k: v for k in ("vlan", "zone") if (v := getattr(args, k, None)) is not None}


def _zone_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--vlan", type=int, help="the connection's VLAN id (its zone, as the config's trunks carry it)")
    sp.add_argument("--zone", type=int, help="the connection's conntrack zone (0-65535; the tuple's ' zone N' alike)")


def cmd_explain(args: argparse.Namespace) -> int:
    from .explainview import cmd_explain as explain
    return explain(args, _socket(args))


def cmd_top(args: argparse.Namespace) -> int:
    from .topview import cmd_top as top
    if not 0.2 <= args.interval <= 60:
        print("nfshunt top: --interval must be 0.2-60 seconds", file=sys.stderr)
        return EXIT_CONFIG
    return top(args, _socket(args))


def cmd_ids_remove(args: argparse.Namespace) -> int:
    reply = _ask(args, {"cmd": "ids_remove", "source": args.source, "id": args.id})
    if reply is None:
        return 1
    print(f"removed IDS rule {reply['source']}/{reply['id']}")
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    """Exit 0 only when every flow-mod of the change is in every switch; 3 pending, 4 refused
    (2: the config fails validation, here or in the controller; 1: not reached, refused,
    failed on the controller (put back, nothing of it kept), or not answered in time)."""
    from nfshunt.app.control import REQUEST_TIMEOUT, ControlError, NotAnswered, request
    from nfshunt.app.reloading import answer_waits
    try:  # (the time any request gets for its work, and what a reload may wait for besides)
        reply = request(_socket(args), {"cmd": "reload"}, REQUEST_TIMEOUT + answer_waits())
    except NotAnswered as exc:
        print(f"nfshunt: {exc}: the reload may still be in progress. Its outcome will be in the controller's log "
              "(the lines \"reload (control socket) ...\"); a reload asked meanwhile is refused as busy, saying "
              "how far this one got", file=sys.stderr)
        return EXIT_FAILED
    except ControlError as exc:
        print(f"nfshunt: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if "error" in reply:
        print(f"nfshunt: {reply['error']}", file=sys.stderr)
        return EXIT_CONFIG if reply.get("invalid_config") else EXIT_FAILED
    st = reply["static"]
    print(f"reloaded: changed {', '.join(reply['changed']) or 'nothing'}; static flows {st['added']} added, "
          f"{st['removed']} removed, {st['flows']} in all")
    for key, why in reply["kept"].items():
        print(f"  {key}: {why}")
    states = set()
    for row in reply["switches"]:
        states.add(row["state"])
        print(f"switch {row['datapath_id']}: " + _reload_row(row))
        for refusal in row.get("refused", ()):
            print(f"  refused: {refusal['flow']}: {refusal['error']}")
    if reply["confirmed"]:
        print(f"confirmed: every flow-mod of the change is in the switch ({reply['confirmed_ms']:.1f} ms)")
        return 0
    print("NOT confirmed: " + ("the switch refused part of the change" if "failed" in states
                               else "not every flow-mod of the change is known to be in the switch yet"))
    return EXIT_REFUSED if "failed" in states else EXIT_PENDING


def _reload_row(row: dict[str, Any]) -> str:
    state, sent = row["state"], row.get("sent", 0)
    if state == "confirmed":
        return f"confirmed ({sent} flow-mods)"
    if state == "failed":
        return f"FAILED: {len(row['refused'])} of {sent} flow-mods refused"
    if state == "pending":
        return f"PENDING ({sent} flow-mods sent): {row['why']}"
    return f"{state}: {row.get('why', '')}"


def cmd_role(args: argparse.Namespace) -> int:
    """A takeover or step-down; with the controller not running (keepalived may start
    first) it is recorded in the pair's state file, and the controller acts on it when it
    starts. The controller binds its socket before it reads that file, so asking the socket
    again after the write leaves no moment in which the request could fall between them."""
    from nfshunt.app.control import ControlError, NotRunning, request
    payload = {"cmd": "role", "role": args.role}
    try:
        reply = request(_socket(args), payload)
    except NotRunning as exc:
        recorded = _record_role(args, str(exc))
        if recorded is None:
            return EXIT_FAILED
        try:
            reply = request(_socket(args), payload)
        except NotRunning:
            print(f"nfshunt: the controller is not running: role {args.role} recorded in {recorded}; "
                  f"it {'claims the switch' if args.role == 'master' else 'stays backup'} when it starts")
            return 0
        except ControlError as exc2:
            print(f"nfshunt: role {args.role} recorded in {recorded}, but the controller: {exc2}", file=sys.stderr)
            return EXIT_FAILED
    except ControlError as exc:
        print(f"nfshunt: role {args.role} failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if "error" in reply:
        print(f"nfshunt: role {args.role} failed: {reply['error']}", file=sys.stderr)
        return EXIT_FAILED
    print(f"role {reply['wanted']} requested with generation {reply['generation']}"
          + ("" if reply["switch_connected"] else " (the switch is not connected: claimed when it is)"))
    if reply.get("state_file_error"):  # (keepalived's notify logs the failure)
        print(f"nfshunt: role {args.role}: {reply['state_file_error']}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _record_role(args: argparse.Namespace, why: str) -> str | None:
    """Write the wanted role to the pair's state file for a controller that is not running;
    its path, or None (said why) when that cannot be done."""
    from nfshunt.core.roles import Roles
    cfg = _load(args.config) if args.config else None
    if cfg is None or cfg.pair is None:
        print(f"nfshunt: role {args.role} failed: {why}; without --config naming a `pair` it cannot be recorded "
              "for the controller's start", file=sys.stderr)
        return None
    roles = Roles(cfg.pair.state_file, cfg.pair.start_role)
    if args.role == "master":
        roles.take_over()
    else:
        roles.stand_by()
    if roles.save_error is not None:
        print(f"nfshunt: role {args.role} failed: {why}, and the pair state file {cfg.pair.state_file} cannot be "
              f"written ({roles.save_error})", file=sys.stderr)
        return None
    return cfg.pair.state_file


def cmd_probe_switch(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    setup_logging("WARNING")
    from . import probe, probe_routed
    return probe.run(cfg, args.wait, args.pairs, args.lag_runs, (probe_routed.probe,))


def _control_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--config", "-c", help="config naming the control_socket")
    sp.add_argument("--socket", help=f"control socket path (default {DEFAULT_CONTROL_SOCKET})")


def _controller_commands(sub: Any) -> None:
    """run, check-config, vrrp-instances, probe-switch: the controller itself and what is read before it runs."""
    run = sub.add_parser("run", help="run the controller")
    run.add_argument("--config", "-c", required=True)
    run.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run.add_argument("--log-format", choices=["text", "json"])
    run.set_defaults(func=cmd_run)

    chk = sub.add_parser("check-config", help="validate a config file and exit")
    chk.add_argument("config")
    chk.set_defaults(func=cmd_check_config)

    vi = sub.add_parser("vrrp-instances", help="the VRRP instances a pair member follows (pair.vrrp_instances), "
                        "one a line: for nfshunt-notify-fifo")
    vi.add_argument("--config", "-c", required=True)
    vi.set_defaults(func=cmd_vrrp_instances)

    pr = sub.add_parser("probe-switch", help="what a new switch can do, and the settings to use with it "
                        "(the controller must be stopped: the switch connects to the probe)")
    pr.add_argument("--config", "-c", required=True)
    pr.add_argument("--wait", type=float, default=60, help="seconds to wait for the switch (default 60)")
    pr.add_argument("--pairs", type=int, default=1000, help="shunt pairs in the flow-mod rate test (default 1000)")
    pr.add_argument("--lag-runs", type=int, default=5, help="flows timed from barrier to forwarding (default 5)")
    pr.set_defaults(func=cmd_probe_switch)


def _control_commands(sub: Any) -> None:
    """Requests to the running controller over its control socket."""
    st = sub.add_parser("status", help="the running controller's switch and connections")
    _control_args(st)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--static", nargs="?", const="", metavar="NAME",
                    help="list the static shunts' flows, one row each (of the stream NAME only, if given)")
    st.add_argument("--limit", type=int, default=100, help="rows of --static's listing (1-1000, default 100)")
    st.add_argument("--offset", type=int, default=0, help="rows of --static's listing to skip (default 0)")
    st.set_defaults(func=cmd_status)
    for name, text in (("unshunt", "send a shunted connection back through the firewall and keep it there"),
                       ("block", "drop a connection in the switch")):
        sp = sub.add_parser(name, help=text)
        _control_args(sp)
        sp.add_argument("target", help="conntrack id, or a tuple like 'tcp 10.0.0.1:40000 -> 10.0.0.2:5201'")
        _zone_options(sp)
        sp.set_defaults(func=cmd_control)
    ex = sub.add_parser("explain", help="why a connection is (not) on the fast path, through every layer: "
                        "conntrack, the policy rule, the controller, the switch's flows")
    _control_args(ex)
    ex.add_argument("target", nargs="+", help="a tuple like 'tcp 10.0.0.1:40000 -> 10.0.0.2:5201', a conntrack "
                    "id, or a pair's cookie (0x...)")
    ex.add_argument("--json", action="store_true", help="machine-readable output")
    _zone_options(ex)
    ex.set_defaults(func=cmd_explain)
    tp = sub.add_parser("top", help="a live view of the busiest connections on both paths (q quits)")
    _control_args(tp)
    tp.add_argument("--once", action="store_true", help="print one frame as text and exit")
    tp.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    tp.set_defaults(func=cmd_top)
    ir = sub.add_parser("ids-remove", help="take an IDS's rule out (the operator beats every IDS), e.g. an "
                        "address block: its flows go, it is reported ended")
    _control_args(ir)
    ir.add_argument("source", help="the requester, e.g. ids:zeek")
    ir.add_argument("id", help="the requester's rule id")
    ir.set_defaults(func=cmd_ids_remove)
    fl = sub.add_parser("flush", help="remove every shunt and block (connections re-evaluated by policy)")
    _control_args(fl)
    fl.add_argument("--reason", default="flush by operator")
    fl.set_defaults(func=cmd_control)

    rl = sub.add_parser("reload", help="read the config again: static shunts and the live keys change, "
                        "a bad config changes nothing (also SIGHUP)")
    _control_args(rl)
    rl.set_defaults(func=cmd_reload)

    ro = sub.add_parser("role", help="a firewall pair's takeover (master) or step-down (backup): keepalived's notify")
    _control_args(ro)
    ro.add_argument("role", choices=["master", "backup"])
    ro.set_defaults(func=cmd_role)


def _iptables_commands(sub: Any) -> None:
    ipt = sub.add_parser("iptables", help="render, apply or remove the NFSHUNT iptables chains")
    isub = ipt.add_subparsers(dest="ipt_cmd", required=True)
    r = isub.add_parser("render", help="print the iptables-restore text")
    r.add_argument("--config", "-c", required=True)
    r.add_argument("--policy", help="policy file whose rules fill NFSHUNT_POLICY")
    r.add_argument("--family", choices=["ipv4", "ipv6"], default="ipv4")
    a = isub.add_parser("apply", help="install the chains atomically")
    a.add_argument("--config", "-c", required=True)
    a.add_argument("--policy", help="policy file replacing NFSHUNT_POLICY's rules")
    a.add_argument("--fix-sysctl", action="store_true",
                   help="turn on net.bridge.bridge-nf-call-ip(6)tables and bridge-nf-filter-vlan-tagged if off")
    a.add_argument("--ipv4-only", action="store_true", help="leave ip6tables alone")
    a.add_argument("--no-reevaluate", action="store_true",
                   help="with --policy: leave existing shunts and blocks alone")
    rm = isub.add_parser("remove", help="remove NFShunt's chains and jumps only")
    rm.add_argument("--config", "-c", required=True)
    rm.add_argument("--ipv4-only", action="store_true", help="leave ip6tables alone")
    mk = isub.add_parser("mark", help="print MARK --set-xmark arguments for an action")
    mk.add_argument("action", help="ignore, shunt, block, or an action number 0-15")
    mk.add_argument("--config", "-c", help="config whose mark_actions maps names to numbers")
    ipt.set_defaults(func=cmd_iptables)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nfshunt", description="OpenFlow hybrid shunting firewall controller")
    p.add_argument("--version", action="version", version=f"nfshunt {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    _controller_commands(sub)
    _control_commands(sub)
    _iptables_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
