"""NextHops' questions to the kernel (kernel/routes.py), against a fake rtnetlink socket: which
answer each of the kernel's replies and errors gives (the real kernel: test_route_follower_netns.py)."""
import errno

import pytest
from pyroute2.netlink.exceptions import NetlinkError

from nfshunt.kernel.routes import NextHops
from nfshunt.records.model import NextHop
from nfshunt.records.routed import R_LOOKUP_FAILED, R_UNRESOLVED

ENTRY = {"state": 0x04, "NDA_LLADDR": "02:00:00:00:00:07"}  # STALE: the kernel uses it


class Msg(dict):
    def get(self, key, default=None):  # (pyroute2's messages answer attributes by name too)
        return super().get(key, default)


class FakeRtnl:
    """Answers a route to 10.0.2.1 on link 4; neighbour questions as the test says."""

    def __init__(self, neigh_error: int | None = None, dumped: list | None = None):
        self.neigh_error, self.dumped, self.asked = neigh_error, dumped or [], []

    def route(self, command, dst):
        return [Msg(type=1, RTA_OIF=4)]

    def get_links(self, index):
        return [Msg(IFLA_IFNAME="fw-eth1", IFLA_ADDRESS="02:00:00:00:fe:01")]

    def neigh(self, command, dst, ifindex):
        self.asked.append(("get", dst, ifindex))
        if self.neigh_error is not None:
            raise NetlinkError(self.neigh_error)
        return [Msg(ENTRY)]

    def get_neighbours(self, dst, ifindex):
        self.asked.append(("dump", dst, ifindex))
        return [Msg(e) for e in self.dumped]

    def close(self):
        pass


def hops_with(rtnl: FakeRtnl) -> NextHops:
    hops = NextHops()
    hops._ipr = rtnl
    return hops


def test_the_next_hop_s_one_entry_is_asked_for_not_the_whole_cache():
    rtnl = FakeRtnl()
    assert hops_with(rtnl).resolve("10.0.2.1") == NextHop("fw-eth1", "02:00:00:00:fe:01", "02:00:00:00:00:07",
                                                         "10.0.2.1")
    assert rtnl.asked == [("get", "10.0.2.1", 4)]


@pytest.mark.parametrize("error,dumped,answer", [
    (errno.ENOENT, [], R_UNRESOLVED),  # no entry yet
    (errno.EOPNOTSUPP, [ENTRY], "02:00:00:00:00:07"),  # a kernel before 4.20: the dump, filtered
    (errno.EOPNOTSUPP, [], R_UNRESOLVED),
    (errno.EPERM, [], R_LOOKUP_FAILED),
])
def test_what_each_neighbour_reply_answers(error, dumped, answer):
    rtnl = FakeRtnl(neigh_error=error, dumped=dumped)
    got = hops_with(rtnl).resolve("10.0.2.1")
    assert (got.eth_dst if isinstance(got, NextHop) else got) == answer
    assert [a[0] for a in rtnl.asked] == (["get", "dump"] if error == errno.EOPNOTSUPP else ["get"])
