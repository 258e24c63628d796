"""`nfshunt run`: start os-ken with the NFShunt app and run until SIGTERM/SIGINT."""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading

from nfshunt.config.settings import Config

# os-ken picks its hub at import time; NFShunt uses plain threads (no eventlet).
os.environ.setdefault("OSKEN_HUB_TYPE", "native")

LOG = logging.getLogger("nfshunt")
STOP = (signal.SIGTERM, signal.SIGINT)


class Signals:
    """SIGTERM, SIGINT and SIGHUP for the main thread, the moment each arrives: the
    interpreter writes each one's number to a pipe (signal.set_wakeup_fd) that the main
    thread reads, blocked. No polling (SIGHUP was looked for every 0.5 s), and nothing done
    inside a handler (one that sets an Event takes a lock the interrupted thread may hold)."""

    def __init__(self) -> None:
        self._read, write = os.pipe()  # (not inherited by the processes we start)
        os.set_blocking(write, False)
        for signum in (*STOP, signal.SIGHUP):
            signal.signal(signum, _noted)  # a Python handler: the number goes to the pipe
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def wait(self) -> list[signal.Signals]:
        """Block until one of the signals comes; those that came, in order (ours only)."""
        ours = {*STOP, signal.SIGHUP}
        while True:
            got = [signal.Signals(n) for n in os.read(self._read, 64) if n in ours]
            if got:
                return got


def _noted(_signum: int, _frame: object) -> None:
    """Nothing: the main thread reads the signal from the wakeup pipe."""


def _configure_osken(cfg: Config) -> None:
    from os_ken import cfg as oscfg
    from os_ken.base import app_manager  # noqa: F401  (must precede the next import)
    # isort: split
    import os_ken.controller.controller  # noqa: F401  (registers the ofp_* options)
    conf = oscfg.CONF
    conf([], project="nfshunt", default_config_files=[])
    conf.set_override("ofp_listen_host", cfg.listen_address)
    # A dead connection is noticed by unanswered echoes (a peer that vanished without a
    # FIN) as well as by EOF; channel.ChannelDatapath makes sure either is reported.
    conf.set_override("echo_request_interval", cfg.echo_interval)
    conf.set_override("maximum_unreplied_echo_requests", cfg.echo_misses - 1)
    if cfg.tls is not None:
        conf.set_override("ofp_ssl_listen_port", cfg.listen_port)
        conf.set_override("ctl_privkey", cfg.tls.private_key)
        conf.set_override("ctl_cert", cfg.tls.certificate)
        if cfg.tls.ca_certificate:
            conf.set_override("ca_certs", cfg.tls.ca_certificate)
    else:
        conf.set_override("ofp_tcp_listen_port", cfg.listen_port)


def run(cfg: Config, path: str | None = None) -> int:
    # A fatal signal (a C extension's SIGSEGV, an abort) writes every thread's stack to the
    # log instead of ending the controller without a word.
    faulthandler.enable()
    _configure_osken(cfg)
    from os_ken.base.app_manager import AppManager

    from . import switch_app

    switch_app.NFShuntApp.OFP_VERSIONS = cfg.ofp_versions
    signals = Signals()  # (before start-up: one that comes meanwhile is acted on after it)

    manager = AppManager.get_instance()
    manager.load_apps(["nfshunt.app.switch_app"])
    contexts = manager.create_contexts()
    from nfshunt.observe import collector

    from .control import ControlError
    collector.tune()  # (the modules are in: what they made is frozen out of collections)
    try:
        manager.instantiate_apps(nfshunt_config=cfg, nfshunt_config_path=path, **contexts)
    except (OSError, ControlError) as exc:
        LOG.error("cannot start: %s", exc)
        return 1
    app = next(a for a in manager.applications.values() if isinstance(a, switch_app.NFShuntApp))
    LOG.info("NFShunt listening for OpenFlow %s on %s:%d%s",
             "/".join(cfg.openflow_versions), cfg.listen_address, cfg.listen_port,
             " (TLS)" if cfg.tls else "")
    for warning in cfg.security_warnings():
        LOG.warning("%s", warning)
    while True:
        got = signals.wait()
        if signal.SIGHUP in got:
            app.reopen_logs()
        stop = next((signum for signum in got if signum in STOP), None)
        if stop is not None:
            LOG.info("received %s, shutting down", stop.name)
            break
    done = threading.Event()
    app.send_event(app.name, switch_app.EventShutdown(done))
    if not done.wait(3.0):
        LOG.warning("switch did not confirm the shutdown flow removals in time")
    app.close()
    logging.shutdown()
    sys.stdout.flush()
    # os-ken's listening and per-switch threads cannot be stopped; everything that needed
    # an orderly end has had it.
    os._exit(0)
