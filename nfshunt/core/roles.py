"""A firewall pair's controller roles (OpenFlow 1.3 MASTER/SLAVE with generation_id).

Pure logic, no I/O but the state file: the app feeds it the switch's role replies and
role errors and sends the role requests it returns.

Both controllers of a pair are connected to the switch all the time. Only the active
firewall's controller is MASTER and programs the switch; the backup is SLAVE, which the
switch enforces (it refuses a slave's flow-mods and sends it no packet-ins or
flow-removed). Which one is active is decided outside NFShunt (keepalived's notify, or an
admin) through `nfshunt role master|backup`.

Generations: a takeover first asks the switch for its generation (a backup that asked for
SLAVE before the other controller's claim has never heard of it), then claims MASTER with
one above it, written to the state file before the claim. A master that reconnects (or
restarts: the file keeps the role) claims again with the generation it took over with, so
a newer master's claim makes the switch refuse it as stale instead of taking the switch
back. Open vSwitch sends OpenFlow 1.3 controllers no role status, so a master learns that
another one took over from a refused message (IS_SLAVE) or from the role query it sends
every `role_check_interval`.

The switch's generation also says whether anyone holds the switch: a claim takes the next
even generation, and a controller that steps down from holding it (keepalived: BACKUP)
releases it with a SLAVE request at the next odd one. A controller keepalived made master
that finds the switch held by a newer claim (a split brain: the later claim wins, or both
hosts master for a moment at boot) yields to it and keeps asking every
`role_check_interval`; once the generation is odd, the other let go (it was told BACKUP:
the link healed, the boot's moment passed), and it claims the switch again. Without this,
the host keepalived kept as master stepped down for good and nobody held the switch.

A controller told BACKUP while its switch connection is down, or while it is not running
(the state file keeps the role and its generation), still holds the switch if its claim is
the switch's generation when it connects: it releases it then (the odd generation), or the
controller keepalived made master would yield to that claim for ever.

A master whose connection broke keeps its pairs (most reconnects find the switch still
its own: it claims again and adopts them). `held` says so across the break: when it learns
it lost the switch meanwhile (told BACKUP, its claim refused as stale, the switch at another
controller's generation), it is demoted, and its core forgets the pairs the other
controller owns now. Without it, they stayed, and a later takeover installed them again.

Nothing is programmed before MASTER is granted: a controller that has not asked for a
role is EQUAL, which the switch lets program.

A claim is made only with a generation the state file holds: one not saved could be lost by
a restart, which would then claim the older one, be refused as stale and yield to its own
lost claim for ever. A claim the file cannot be written for is withheld (logged, counted,
in status and the role command's answer) and tried again every `role_check_interval`.

A takeover asked for while the controller is not running (keepalived started first, or the
controller is restarting) is kept in the state file as pending (`takeover`): the controller
makes it once the switch connects, so the order in which the pair's services start does
not matter.
"""
from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import tempfile
from dataclasses import dataclass

from nfshunt.config import jsonfile

LOG = logging.getLogger("nfshunt")

# OpenFlow 1.3 controller roles (ofp_controller_role)
NOCHANGE, EQUAL, MASTER, SLAVE = 0, 1, 2, 3
ROLE_NAMES = {NOCHANGE: "nochange", EQUAL: "equal", MASTER: "master", SLAVE: "backup"}
UNDEFINED_GENERATION = (1 << 64) - 1  # a role reply's generation_id before any was set (Open vSwitch)


class Claim(enum.Enum):
    """Where a takeover stands."""
    QUERYING = "querying"  # asked the switch for its generation; the claim follows the answer
    CLAIMED = "claimed"  # MASTER claimed; replies to what was sent before it are not its answer


@dataclass(frozen=True, slots=True)
class RoleRequest:
    role: int
    generation: int


@dataclass(frozen=True, slots=True)
class Change:
    """What a role reply or error changed: the app acts on promoted/demoted."""
    promoted: bool = False
    demoted: str | None = None  # why this controller is no longer master
    request: RoleRequest | None = None  # the next role request to send
    withheld: str | None = None  # why a claim this called for was not made (the state file)


def newer(a: int, b: int) -> bool:
    """Generation a is newer than b, compared as the switch does (signed 64-bit distance)."""
    d = (a - b) & UNDEFINED_GENERATION
    return d != 0 and d < (1 << 63)


class Roles:
    def __init__(self, state_file: str | None, start_role: str = "backup"):
        self.state_file = state_file
        self.wanted = start_role  # "master" or "backup": what keepalived or the admin said
        self.generation = 0  # the generation this controller took over with
        self.switch_generation: int | None = None  # the newest the switch has reported
        self.granted: str | None = None  # the role the switch confirmed ("master", "backup")
        # Granted MASTER, and no demotion reported since: a lost connection does not clear it
        # (the core keeps its pairs across a reconnect), the news that the switch is lost does.
        self.held = False
        self.why: str | None = None  # why this controller is backup, when not asked to be
        self.claim: Claim | None = None  # a takeover under way
        # keepalived says master but another controller's claim holds the switch: the
        # generation of that claim (UNDEFINED_GENERATION: not known yet, a query is out)
        self.yielded: int | None = None
        self.save_error: str | None = None  # why the last write of the state file failed
        self._load()

    # --- the state file --------------------------------------------------------------------

    def _load(self) -> None:
        if not self.state_file or not os.path.exists(self.state_file):
            return
        try:
            # A regular file of a few bytes (one role, one generation): a FIFO must not hang the start.
            state = jsonfile.read(self.state_file, 4096)
            role, generation, takeover = state["role"], state["generation"], state.get("takeover", False)
            if role not in ("master", "backup") or not isinstance(generation, int) or isinstance(generation, bool) \
                    or not 0 <= generation < UNDEFINED_GENERATION or not isinstance(takeover, bool):
                raise ValueError("role must be master or backup, generation a 64-bit integer, takeover true or false")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Starting as backup is safe: the pair's other controller, or a takeover, decides.
            LOG.error("cannot read the pair state file %s (%s): starting as backup; `nfshunt role master` "
                      "takes over", self.state_file, exc)
            self.wanted = "backup"
            return
        self.wanted, self.generation = role, generation
        if takeover and role == "master":
            self.claim = Claim.QUERYING

    def _save(self) -> bool:
        """Write the state file; False (said once per error, `save_error`) if it cannot be."""
        if not self.state_file:
            return True
        tmp = None
        try:
            folder = os.path.dirname(self.state_file)
            os.makedirs(folder, mode=0o700, exist_ok=True)
            # A temporary file of this writer's own: keepalived's notify script (`nfshunt role`)
            # and a starting controller may write at once; with one shared name the second
            # rename found it gone (ENOENT) and that role was lost.
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(self.state_file)}.")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"role": self.wanted, "generation": self.generation,
                           "takeover": self.claim is Claim.QUERYING}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.state_file)
            tmp = None
            if self.save_error is not None:
                LOG.warning("the pair state file %s is written again", self.state_file)
            self.save_error = None
            return True
        except OSError as exc:
            error = str(exc.strerror or exc)
            if error != self.save_error:  # (a withheld claim tries again every role check: said once)
                LOG.error("cannot write the pair state file %s (%s): fix its path or permissions; role %s generation "
                          "%d is not saved (a restart starts from the file's older state; a claim is not made until "
                          "it is saved)", self.state_file, error, self.wanted, self.generation)
            self.save_error = error
            return False
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def state_file_error(self) -> str | None:
        """What the role command's answer and status say while the state file cannot be written."""
        if self.save_error is None:
            return None
        then = ("this controller does not claim the switch until it can (asked again every role_check_interval)"
                if self.wanted == "master" else "a restart would start from the file's older role")
        return (f"the pair state file {self.state_file} cannot be written ({self.save_error}): fix its path or "
                f"permissions; {then}")

    # --- the switch --------------------------------------------------------------------------

    def connected(self) -> RoleRequest:
        """A new switch connection: first learn the switch's generation."""
        self.granted = None
        return RoleRequest(NOCHANGE, 0)

    def disconnected(self) -> None:
        self.granted = None
        if self.claim is Claim.CLAIMED:  # the claimed generation is saved: claimed again on connect
            self.claim = None

    def _note_generation(self, generation: int) -> None:
        if generation != UNDEFINED_GENERATION and (self.switch_generation is None
                                                   or newer(generation, self.switch_generation)):
            self.switch_generation = generation

    def reply(self, role: int, generation: int) -> Change:
        """The switch's role reply (to a claim, a step-down or a query)."""
        self._note_generation(generation)
        if self.claim is Claim.CLAIMED and role != MASTER:
            # Replies come in the order of the requests: this one answers something sent
            # before the claim (a step-down, a query), not the claim.
            return Change()
        if self.claim is Claim.QUERYING and self.wanted == "master":
            # The switch's generation is known now: claim one above it.
            return self._claim(self._lost_while_away(role, generation))
        self.claim = None
        if role == MASTER:
            if self.wanted == "master":
                promoted = self.granted != "master"
                self.granted, self.held, self.yielded, self.why = "master", True, None, None
                return Change(promoted=promoted)
            return Change(request=self._release_request())  # asked to step down meanwhile
        if self.wanted != "master":
            if role == SLAVE:
                self.granted = "backup"
            if self._ours(generation):
                # Told backup while the connection was down, or the controller stopped: its
                # claim still holds the switch. Released, or keepalived's master yields for ever.
                return Change(request=self._release_request(), demoted=self._demoted("asked to be backup"))
            if role == SLAVE:
                return Change(demoted=self._demoted("asked to be backup"))
            return Change(request=self._backup_request(), demoted=self._demoted("role query answered equal"))
        if role == SLAVE or self.yielded is not None:
            return self._judge(role, generation)
        # EQUAL (a new connection): claim what we want.
        lost = self._lost_while_away(role, generation)
        if self.generation == 0:  # master in the config, never took over: a takeover now
            return self._claim(lost)  # (this reply told us the switch's generation)
        self.claim = Claim.CLAIMED
        if lost is None and self.granted == "master":
            lost = self._demoted("role query answered equal")
        return Change(request=RoleRequest(MASTER, self.generation), demoted=lost)

    def _judge(self, role: int, generation: int) -> Change:
        """keepalived says master and the switch does not: its generation says whether a
        newer claim holds it (even: yield, the later claim wins) or the last holder let it
        go (odd, or never set: claim it)."""
        self.granted = "backup" if role == SLAVE else None
        why = f"another controller took the switch over (generation {generation})"
        demoted = self._demoted(why)
        if generation & 1:
            self.yielded = None
            LOG.warning("the switch's last holder let it go (generation %d): claiming it, as keepalived's master",
                        generation)
            return self._claim(demoted)
        if self.yielded != generation:
            LOG.warning("yielding the switch to the newer claim of generation %d (keepalived says master here: "
                        "claimed again once that controller lets it go)", generation)
        self.yielded, self.why = generation, why
        return Change(demoted=demoted, request=None if role == SLAVE else RoleRequest(SLAVE, generation))

    def _demoted(self, why: str) -> str | None:
        """`why`, if this controller is to be demoted: it was granted MASTER and has not been
        demoted since (its core holds the pairs). Said once."""
        if not self.held:
            return None
        self.held = False
        return why

    def _ours(self, generation: int) -> bool:
        """The switch's generation is this controller's own claim (every claim is even, and
        above 0; the other controller's claim of the same generation may hold it instead, which
        a release does not take from it: a SLAVE request changes only the sender's role)."""
        return self.generation != 0 and generation == self.generation

    def _lost_while_away(self, role: int, generation: int) -> str | None:
        """A master whose connection broke (its core kept the pairs) that finds the switch at
        another generation than its claim's: another controller claimed it meanwhile, owns the
        pairs and may have taken them down. Demoted now, before any new claim of its own; a
        switch that restarted (no generation) is its own still."""
        if role == MASTER or self.granted == "master" or generation in (self.generation, UNDEFINED_GENERATION):
            return None
        return self._demoted(f"another controller claimed the switch while this controller's connection was "
                             f"down (generation {generation})")

    def stale(self) -> Change:
        """The switch refused our claim as stale: a newer claim was made. Stand by and ask
        the switch whether that claim still holds it (reply: _judge)."""
        self.claim = None
        self.granted = None
        why = f"the switch refused generation {self.generation} as stale: a newer claim was made"
        if self.wanted == "master":
            self.yielded, self.why = UNDEFINED_GENERATION, why
            LOG.warning("%s; asking the switch whether it still holds it", why)
        return Change(demoted=self._demoted(why), request=RoleRequest(NOCHANGE, 0))

    def refused_as_slave(self) -> Change:
        """The switch refused a message because we are slave (IS_SLAVE): stand by and ask
        it whether a newer claim holds it (reply: _judge)."""
        if self.granted != "master":
            return Change()
        self.granted = None
        if self.wanted == "master":
            self.yielded = UNDEFINED_GENERATION
        return Change(demoted=self._demoted("the switch refused a message as from a slave: another controller "
                                            "claimed it"),
                      request=RoleRequest(NOCHANGE, 0))

    def check(self) -> RoleRequest | None:
        """The periodic query (no role status in 1.3): a master's, to notice a takeover; a
        yielded one's, to notice the other letting go; a withheld claim's, to try again."""
        if self.granted == "master" or (self.wanted == "master" and (self.yielded is not None
                                                                     or self.claim is Claim.QUERYING)):
            return RoleRequest(NOCHANGE, 0)
        return None

    def _backup_request(self) -> RoleRequest:
        gen = self.switch_generation if self.switch_generation is not None else self.generation
        return RoleRequest(SLAVE, gen)

    def _release_request(self) -> RoleRequest:
        """A step-down from holding the switch: SLAVE with the next odd generation, which
        tells a yielded controller's query that nobody holds the switch now."""
        base = max(self.generation, self.switch_generation or 0)
        return RoleRequest(SLAVE, (base + 1 + (base & 1)) & UNDEFINED_GENERATION)

    def _claim(self, demoted: str | None = None) -> Change:
        """A takeover's claim: the next even generation above this controller's and the newest
        the switch reported, saved first. One the state file cannot hold is not made (the
        takeover stays pending, asked again at each role check): a restart would claim the
        file's older generation, be refused as stale and yield to its own lost claim."""
        before = self.generation
        base = max(self.generation, self.switch_generation or 0)
        self.generation = (base + 2 - (base & 1)) & UNDEFINED_GENERATION
        self.claim = Claim.CLAIMED
        if self._save():
            return Change(demoted=demoted, request=RoleRequest(MASTER, self.generation))
        self.generation, self.claim = before, Claim.QUERYING
        why = (f"not claiming the switch: the pair state file {self.state_file} cannot be written "
               f"({self.save_error}); fix its path or permissions (claimed once it can be written: tried again "
               f"every role_check_interval)")
        if why != self.why:
            LOG.error("%s", why)
        self.why = why
        return Change(demoted=demoted, withheld=why)

    # --- the operator (keepalived's notify) ---------------------------------------------------

    def take_over(self) -> Change:
        """Become master: ask the switch for its generation first (the claim follows its
        answer, see reply); pending in the state file until then, so a restart or a
        controller that is not running yet still makes it. Said again to a master, or to one
        that yields to a newer claim (keepalived re-sends the states at a reload), it only
        asks the switch: a repeat is no new takeover."""
        if self.wanted == "master" and (self.granted == "master" or self.yielded is not None):
            return Change(request=RoleRequest(NOCHANGE, 0))
        self.wanted = "master"
        self.why = None
        self.claim = Claim.QUERYING
        self._save()
        return Change(request=RoleRequest(NOCHANGE, 0))

    def stand_by(self) -> Change:
        """Become backup: a master stops programming at once, before the switch answers, and
        releases the switch (the next odd generation); so does one whose claim is out. One
        whose connection is down is demoted now (its core forgets the pairs) and releases the
        switch when it connects, if its claim still holds it then (reply)."""
        holds = self.held or self.claim is Claim.CLAIMED
        demoted = self._demoted("asked to be backup")
        self.wanted = "backup"
        self.why = "asked to be backup"
        self.claim = None
        self.yielded = None
        self._save()
        if self.granted == "master":
            self.granted = None
        return Change(demoted=demoted, request=self._release_request() if holds else self._backup_request())

    def status(self) -> dict[str, object]:
        return {"wanted": self.wanted, "granted": self.granted, "generation": self.generation,
                "switch_generation": self.switch_generation, "why_backup": self.why,
                "takeover": self.claim.value if self.claim is not None else None,
                "yielded_to": None if self.yielded in (None, UNDEFINED_GENERATION) else self.yielded,
                "state_file_error": self.state_file_error()}
