"""The firewall's own route and neighbour tables over netlink (pyroute2): the next hop of a
destination as the router forwards to it, and the tables' changes that matter to the shunts
using it (docs/design/routed.md, 5.3). Every netlink exchange happens on the follower's own
thread: the event loop asks (TableFollower.ask) and gets the answer fed back, and hears the
changes the same way, as plain values (switch/feeds).
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import queue
import select
import socket
import threading
import time
from typing import Any, Callable

from nfshunt.records.model import NextHop
from nfshunt.records.routed import (  # (the reasons, re-exported: the answers this module gives)
    R_BLACKHOLE,
    R_LOOKUP_FAILED,
    R_NEXT_HOP_FAILED,
    R_NO_ROUTE,
    R_NOT_UNICAST,
    R_UNRESOLVED,
    Answer,
)

LOG = logging.getLogger("nfshunt.routes")

RTN_UNICAST = 1
# Neighbour states whose MAC the kernel itself would use (a STALE entry is used and checked
# in the background: traffic that bypasses the firewall makes its entries STALE).
NUD_USABLE = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80  # REACHABLE STALE DELAY PROBE NOARP PERMANENT
NUD_INCOMPLETE = 0x01
NTF_USE = 0x01  # RTM_NEWNEIGH: resolve the entry as a packet sent to it would, write nothing
IFA_F_NOT_YET = 0x08 | 0x40  # an address's flags: DADFAILED, TENTATIVE (not the host's to announce)
Key = tuple[int, str]  # a neighbour entry: (ifindex, address)

# RTMGRP_LINK | RTMGRP_NEIGH | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE
GROUPS = 0x1 | 0x4 | 0x40 | 0x400
NETLINK_ROUTE = 0
RCVBUF = 4 << 20  # a neighbour flapping a thousand times a second fills a small buffer
RECV_MAX = 1 << 16
TICK = 0.1  # seconds a neighbour's changes are coalesced: only its last state goes on
WAKE = 0.5  # seconds the follower waits for anything before it looks whether stop() was asked
WATCH_MAX = 4096  # destinations followed (the ones asked last); older ones are asked again


@dataclasses.dataclass(frozen=True)
class Interface:
    """A routed interface as the kernel has it now: its MAC and addresses."""
    mac: str
    addresses: tuple[str, ...]


class NextHops:
    """One netlink socket of its own, opened on first use; every answer a NextHop or the
    reason there is none (measured: no route answers ENETUNREACH, a blackhole EINVAL)."""

    def __init__(self) -> None:
        self._ipr: Any = None

    def resolve(self, address: str) -> Answer:
        return self.lookup(address)[0]

    def _socket(self) -> Any:
        """The netlink socket, opened on first use (and again after close())."""
        if self._ipr is None:
            from pyroute2 import IPRoute
            self._ipr = IPRoute()
        return self._ipr

    def lookup(self, address: str) -> tuple[Answer, Key | None]:
        """The answer, and the neighbour entry it depends on (None: no route to follow)."""
        from pyroute2.netlink.exceptions import NetlinkError
        self._socket()
        try:
            route = self._ipr.route("get", dst=address)[0]
            if route["type"] != RTN_UNICAST:
                return R_NOT_UNICAST, None
            oif = route.get("RTA_OIF")
            gateway = route.get("RTA_GATEWAY") or address
        except NetlinkError as exc:
            return {errno.ENETUNREACH: R_NO_ROUTE, errno.EINVAL: R_BLACKHOLE}.get(exc.code, R_NOT_UNICAST), None
        except (OSError, IndexError):
            self.close()  # a new socket next time
            return R_LOOKUP_FAILED, None
        try:
            link = self._ipr.get_links(oif)[0]
            neighbours = self._neighbour(gateway, oif)
        except NetlinkError:  # (the link gone meanwhile, or the kernel refused the question)
            return R_LOOKUP_FAILED, None
        except (OSError, IndexError):
            self.close()
            return R_LOOKUP_FAILED, None
        mac = next((n.get("NDA_LLADDR") for n in neighbours if n["state"] & NUD_USABLE and n.get("NDA_LLADDR")), None)
        if mac is None:
            return R_UNRESOLVED, (oif, gateway)
        return NextHop(link.get("IFLA_IFNAME"), link.get("IFLA_ADDRESS"), mac, gateway), (oif, gateway)

    def solicit(self, key: Key) -> None:
        """Make the kernel resolve a next hop it has no MAC for, as a packet it forwarded there
        would (its own ARP request or neighbour solicitation): RTM_NEWNEIGH with NTF_USE, which
        writes no MAC, so the tables stay the kernel's. The outcome comes as the neighbour's news."""
        oif, address = key
        self._socket().neigh("replace", dst=address, ifindex=oif, flags=NTF_USE, state=NUD_INCOMPLETE)

    def interface(self, name: str) -> Interface | None:
        """An interface's MAC and its addresses (IPv4 and IPv6; none still tentative or
        found a duplicate), or None: no such interface, or the question failed."""
        from pyroute2.netlink.exceptions import NetlinkError
        ipr = self._socket()
        try:
            (link,) = ipr.get_links(ifname=name)
            found = list(ipr.get_addr(index=link["index"]))
        except (NetlinkError, ValueError):  # (no such interface, or gone meanwhile; ValueError: not one answer)
            return None
        except OSError:
            self.close()  # a new socket next time
            return None
        addresses = tuple(a.get("IFA_ADDRESS") for a in found
                          if a.get("IFA_ADDRESS") and not (a.get("IFA_FLAGS") or a["flags"]) & IFA_F_NOT_YET)
        return Interface(link.get("IFLA_ADDRESS"), addresses)

    def _neighbour(self, address: str, oif: int) -> list[Any]:
        """The next hop's one neighbour entry, or none (RTM_GETNEIGH: get_neighbours dumps the
        whole cache and filters it here, which a router with thousands of neighbours would pay
        on every new destination)."""
        from pyroute2.netlink.exceptions import NetlinkError
        try:
            return list(self._ipr.neigh("get", dst=address, ifindex=oif))
        except NetlinkError as exc:
            if exc.code == errno.ENOENT:  # no entry: not resolved yet
                return []
            if exc.code == errno.EOPNOTSUPP:  # a kernel before 4.20 answers no single entry
                return list(self._ipr.get_neighbours(dst=address, ifindex=oif))
            raise

    def close(self) -> None:
        if self._ipr is not None:
            try:
                self._ipr.close()
            finally:
                self._ipr = None


def neighbour_news(msg: Any) -> tuple[Key, str | None] | None:
    """A neighbour message as (its entry, the MAC the kernel would use now, None for none:
    FAILED, INCOMPLETE or deleted); None for what is not a neighbour message."""
    event = msg.get("event")
    if event not in ("RTM_NEWNEIGH", "RTM_DELNEIGH"):
        return None
    address = msg.get_attr("NDA_DST")
    if address is None:
        return None
    lladdr = msg.get_attr("NDA_LLADDR")
    usable = event == "RTM_NEWNEIGH" and msg["state"] & NUD_USABLE and lladdr
    return (msg["ifindex"], address), (lladdr if usable else None)


class Followed:
    """What the follower knows of the destinations it was asked about: the answer last given
    to the event loop and the neighbour entry it depends on. Pure: a neighbour's new state in,
    the destinations whose answer changed out (what the loop must hear, nothing else)."""

    def __init__(self, lookup: Callable[[str], tuple[Answer, Key | None]]):
        self.lookup = lookup
        self.last: collections.OrderedDict[str, Answer] = collections.OrderedDict()
        self.via: dict[str, Key | None] = {}
        self.users: dict[Key, set[str]] = {}

    def ask(self, address: str) -> Answer:
        answer, key = self.lookup(address)
        self._note(address, answer, key)
        while len(self.last) > WATCH_MAX:
            self._forget(next(iter(self.last)))
        return answer

    def _note(self, address: str, answer: Answer, key: Key | None) -> None:
        old = self.via.get(address)
        if old is not None and old != key:
            self.users.get(old, set()).discard(address)
        self.last[address] = answer
        self.last.move_to_end(address)
        self.via[address] = key
        if key is not None:
            self.users.setdefault(key, set()).add(address)

    def _forget(self, address: str) -> None:
        self.last.pop(address, None)
        key = self.via.pop(address, None)
        if key is not None and key in self.users:
            self.users[key].discard(address)
            if not self.users[key]:
                del self.users[key]

    def neighbour(self, key: Key, mac: str | None) -> dict[str, Answer]:
        """A neighbour entry's coalesced state: the answers it changes. A MAC the pairs already
        use (STALE, DELAY, PROBE, REACHABLE churn) changes nothing."""
        news: dict[str, Answer] = {}
        for address in sorted(self.users.get(key, ())):
            old = self.last[address]
            via: Key | None = key
            if mac is None:
                new: Answer = R_NEXT_HOP_FAILED if isinstance(old, NextHop) else old
            elif isinstance(old, NextHop):
                new = dataclasses.replace(old, eth_dst=mac)
            else:
                new, via = self.lookup(address)  # newly resolved: the whole answer (link, gateway)
            if new != old:
                self._note(address, new, via)
                news[address] = new
        return news

    def routes(self) -> dict[str, Answer]:
        """A route (or link) changed: every destination followed is asked again; the answers
        that differ go on."""
        news: dict[str, Answer] = {}
        for address in list(self.last):
            old = self.last[address]
            new = self.ask(address)
            if isinstance(old, NextHop) and new == R_UNRESOLVED:
                new = self.last[address] = R_NEXT_HOP_FAILED  # (its neighbour went while a route changed)
            if new != old:
                news[address] = new
        return news


class TableFollower:
    """A thread with two netlink sockets of its own: a plain one bound to the link, neighbour
    and route groups, its datagrams parsed by pyroute2's rtnetlink marshal (an IPRoute bound
    and read with get() after select() from another thread than its maker's heard nothing
    here: pyroute2 0.9.7 reads its socket through an asyncio loop of its own), and NextHops'
    for the questions. It answers the event loop's questions and tells it what changed for
    the destinations it asked about, a neighbour's changes coalesced over TICK."""

    def __init__(self, on_news: Callable[[dict[str, Answer]], None],
                 on_error: Callable[[str], None] = lambda _what: None):
        self.on_news = on_news
        self.on_error = on_error  # a strange thing counted (the socket's loss, a lookup's failure)
        self.hops = NextHops()
        self.followed = Followed(self.hops.lookup)
        self.requests: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # run on the thread
        self._wake_r, self._wake_w = os.pipe()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._events: socket.socket | None = None
        self._marshal: Any = None
        self.pending: dict[Key, str | None] = {}
        self.tables_changed = False

    def start(self) -> None:
        from pyroute2.netlink.rtnl.marshal import MarshalRtnl
        self._marshal = MarshalRtnl()
        self._events = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        self._events.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        self._events.bind((0, GROUPS))
        self._thread = threading.Thread(target=self._run, name="route-follower", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=2)
        for closing in (self._events, self.hops):
            if closing is not None:
                closing.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def ask(self, addresses: tuple[str, ...], reply: Callable[[dict[str, Answer]], None],
            solicit: bool = False) -> None:
        """From the event loop: `reply` gets the answers, called on the follower's thread.
        `solicit`: the next hops not resolved are resolved by the kernel (NextHops.solicit)."""
        self._put(lambda: self._answer(addresses, reply, solicit))

    def interfaces(self, names: tuple[str, ...], reply: Callable[[dict[str, Interface | None]], None]) -> None:
        """From the event loop: each interface's MAC and addresses (None: not there), to
        `reply` on the follower's thread."""
        self._put(lambda: reply({name: self.hops.interface(name) for name in names}))  # (never raises)

    def _put(self, request: Callable[[], None]) -> None:
        self.requests.put(request)
        os.write(self._wake_w, b"x")

    def _run(self) -> None:
        assert self._events is not None
        events = self._events.fileno()
        due: float | None = None
        while not self._stop.is_set():
            wait = WAKE if due is None else max(0.0, due - time.monotonic())
            ready, _, _ = select.select([events, self._wake_r], [], [], wait)
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            try:
                if events in ready:
                    self._read()
                self._requests()
                if (self.pending or self.tables_changed) and due is None:
                    due = time.monotonic() + TICK
                if due is not None and time.monotonic() >= due:
                    due = None
                    self._flush()
            except Exception:  # a strange answer: counted, logged, the thread goes on
                self.on_error("route follower")
                LOG.exception("the route follower failed a turn")

    def _read(self) -> None:
        assert self._events is not None
        try:
            messages = self._marshal.parse(self._events.recv(RECV_MAX, socket.MSG_DONTWAIT))
        except BlockingIOError:
            return
        except OSError as exc:  # ENOBUFS: changes were lost, every followed destination is asked again
            self.on_error("route events lost" if exc.errno == errno.ENOBUFS else "route events unreadable")
            self.tables_changed = True
            return
        for msg in messages:
            news = neighbour_news(msg)
            if news is not None:
                self.pending[news[0]] = news[1]  # the last state within the tick wins
            elif msg.get("event") in ("RTM_NEWROUTE", "RTM_DELROUTE", "RTM_NEWLINK"):
                self.tables_changed = True

    def _requests(self) -> None:
        while True:
            try:
                request = self.requests.get_nowait()
            except queue.Empty:
                return
            request()

    def _answer(self, addresses: tuple[str, ...], reply: Callable[[dict[str, Answer]], None], solicit: bool) -> None:
        """Every question answered, a strange failure as a failed lookup (never no answer: the
        loop waits for it); each unresolved next hop solicited as it is found (the entry it
        depends on, before a long question pushes it out of what is followed)."""
        answers: dict[str, Answer] = {}
        solicited: set[Key] = set()
        try:
            for address in dict.fromkeys(addresses):
                answers[address] = self.followed.ask(address)
                key = self.followed.via.get(address)
                if solicit and answers[address] == R_UNRESOLVED and key is not None and key not in solicited:
                    solicited.add(key)
                    self._solicit(key)
        except Exception:
            self.on_error("route follower")
            LOG.exception("the route follower failed a question: its destinations answered as lookups that failed")
            answers = {address: answers.get(address, R_LOOKUP_FAILED) for address in addresses}
        reply(answers)

    def _solicit(self, key: Key) -> None:
        from pyroute2.netlink.exceptions import NetlinkError
        try:
            self.hops.solicit(key)
        except (NetlinkError, OSError) as exc:  # counted; the pair waits, then goes back
            self.on_error("neighbour not solicited")
            LOG.warning("could not make the kernel resolve %s on interface %d: %s", key[1], key[0], exc)

    def _flush(self) -> None:
        news: dict[str, Answer] = {}
        if self.tables_changed:
            self.tables_changed = False
            news.update(self.followed.routes())
        pending, self.pending = self.pending, {}
        for key, mac in pending.items():
            news.update(self.followed.neighbour(key, mac))
        if news:
            self.on_news(news)
