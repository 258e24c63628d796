"""The `nfshunt` command."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from . import __version__
from .config import ConfigError, Config, load

EXIT_CONFIG = 2
EXIT_FAILED = 1


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                 + f".{int(record.msecs):03d}Z", "ts": round(record.created, 6), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        # Structured fields a log call attaches with extra={"fields": {...}}.
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
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
    from . import controller
    return controller.run(cfg)


def cmd_check_config(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    print(f"{args.config}: OK: {len(cfg.ports)} port groups, actions "
          + ", ".join(f"{n}={a}" for n, a in sorted(cfg.mark_actions.items()))
          + f", OpenFlow {'/'.join(cfg.openflow_versions)} on {cfg.listen_address}:{cfg.listen_port}")
    return 0


def cmd_iptables(args: argparse.Namespace) -> int:
    from . import iptables
    if args.ipt_cmd == "mark":
        return iptables.cmd_mark(args)
    cfg = _load(args.config)
    return {"render": iptables.cmd_render, "apply": iptables.cmd_apply,
            "remove": iptables.cmd_remove}[args.ipt_cmd](cfg, args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nfshunt", description="OpenFlow hybrid shunting firewall controller")
    p.add_argument("--version", action="version", version=f"nfshunt {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="run the controller")
    run.add_argument("--config", "-c", required=True)
    run.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run.add_argument("--log-format", choices=["text", "json"])
    run.set_defaults(func=cmd_run)

    chk = sub.add_parser("check-config", help="validate a config file and exit")
    chk.add_argument("config")
    chk.set_defaults(func=cmd_check_config)

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
                   help="turn on net.bridge.bridge-nf-call-ip(6)tables if off")
    a.add_argument("--ipv4-only", action="store_true", help="leave ip6tables alone")
    rm = isub.add_parser("remove", help="remove NFShunt's chains and jumps only")
    rm.add_argument("--config", "-c", required=True)
    rm.add_argument("--ipv4-only", action="store_true", help="leave ip6tables alone")
    mk = isub.add_parser("mark", help="print MARK --set-xmark arguments for an action")
    mk.add_argument("action", help="ignore, shunt, block, or an action number 0-15")
    mk.add_argument("--config", "-c", help="config whose mark_actions maps names to numbers")
    ipt.set_defaults(func=cmd_iptables)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
