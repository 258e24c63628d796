"""A firewall pair's role requests on the switch connection, and what the switch's
answers change (roles.py decides; this sends its requests and acts on its changes)."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from nfshunt.core import commands as c
from nfshunt.core.roles import MASTER, ROLE_NAMES, Change, RoleRequest
from nfshunt.observe.metrics import Counters
from nfshunt.openflow.inflight import RoleAsk

from .switch import Switch

LOG = logging.getLogger("nfshunt")

Run = Callable[[Switch, Iterable[c.Command]], None]


class RoleLink:
    def __init__(self, counters: Counters, run: Run, clock: Callable[[], float] = time.monotonic):
        self.counters = counters
        self.run = run
        self.clock = clock  # the event loop's

    def request(self, sw: Switch, req: RoleRequest) -> None:
        s = sw.session
        if s is None:
            return
        s.ask(s.dp.ofproto_parser.OFPRoleRequest(s.dp, req.role, req.generation), RoleAsk(self.clock(), req))
        sw.role_checked = self.clock()  # its reply says the role: the next check is an interval on
        if req.role == MASTER:
            LOG.info("claiming MASTER of switch %s with generation %d", sw.name, req.generation)
        s.send.flush()

    def change(self, sw: Switch, change: Change) -> None:
        roles = sw.roles
        if roles is None:
            return
        if change.demoted is not None:
            self.counters.inc("role_demotions")
            LOG.warning("no longer master of switch %s (%s): standing by, the switch's pairs are the other "
                        "controller's now", sw.name, change.demoted)
            if sw.session is not None:  # what was queued for the switch is not ours to send any more
                sw.session.disown(sw.switch)
            self.run(sw, sw.core.stand_by())
        if change.withheld is not None:  # (roles.py logged it, once)
            self.counters.inc("role_claims_withheld")
        if change.promoted and sw.session is not None:
            self.counters.inc("role_promotions")
            LOG.warning("master of switch %s with generation %d: programming it (defaults to this firewall, "
                        "adopting the pairs on the switch)", sw.name, roles.generation)
            commands = sw.core.switch_connected(sw.session.dp.ofproto.OFP_VERSION, sw.session.fb.pipeline)
            if sw.switch.forwarding == "routed":  # the hosts told this host's MACs (docs/routed.md, "A firewall pair")
                commands.append(c.AnnounceGateways(tuple(sw.switch.sides.values())))
            self.run(sw, commands)
        if change.request is not None:
            self.request(sw, change.request)

    def reply(self, sw: Switch, msg: Any) -> None:
        if sw.roles is None:
            return
        LOG.debug("role reply: %s, generation %d", ROLE_NAMES.get(msg.role, msg.role), msg.generation_id)
        self.change(sw, sw.roles.reply(msg.role, msg.generation_id))

    def refused(self, sw: Switch, msg: Any) -> None:
        """The switch refused a role request."""
        assert sw.roles is not None
        if msg.code == msg.datapath.ofproto.OFPRRFC_STALE:
            LOG.warning("the switch refused this controller's role request as stale: a newer master holds it")
            self.change(sw, sw.roles.stale())
        else:
            LOG.error("the switch refused the role request (code %d): it may not support controller roles; "
                      "this controller stays backup and programs nothing", msg.code)

    def refused_as_slave(self, sw: Switch, msg: Any) -> None:
        """A message refused because we are slave: a takeover we had not noticed yet."""
        ofp = msg.datapath.ofproto
        if sw.roles is not None and msg.type == ofp.OFPET_BAD_REQUEST and msg.code == ofp.OFPBRC_IS_SLAVE:
            self.change(sw, sw.roles.refused_as_slave())

    def check(self, sw: Switch, now: float) -> None:
        """A master asks every role_check_interval whether it still is (no role status in 1.3)."""
        pair = sw.cfg.pair
        if sw.roles is not None and pair is not None and sw.session is not None and \
                now - sw.role_checked >= pair.role_check_interval:
            sw.role_checked = now
            check = sw.roles.check()
            if check is not None:
                self.request(sw, check)
