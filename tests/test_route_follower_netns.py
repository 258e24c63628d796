"""The route follower (kernel/routes.py, docs/design/routed.md 5.3) on a real kernel's tables,
in a namespace of its own: it answers a question off the caller's thread, and tells only the
changes a routed shunt must follow (a new MAC, a failed or deleted neighbour, a newly resolved
one, a route gone or blackholed), a neighbour's bursts coalesced, its state churn not at all."""
import json
import os
import sys

# Both follower scripts' start: the checkout's code, and the router's end (rta) of a veth pair.
ROUTER = r"""
import json, os, subprocess, sys, threading, time
sys.path.insert(0, sys.argv[1])
from nfshunt.kernel.routes import TableFollower
from nfshunt.records.model import NextHop

def sh(*args):
    subprocess.run(args, check=True)

sh("ip", "link", "add", "name", "rta", "type", "veth", "peer", "name", "rtb")
sh("ip", "link", "set", "rta", "address", "02:00:00:00:fe:01", "up")
sh("ip", "addr", "add", "10.9.0.1/24", "dev", "rta")
"""
SCRIPT = ROUTER + r"""
sh("ip", "link", "set", "rtb", "up")
sh("ip", "neigh", "replace", "10.9.0.2", "lladdr", "02:00:00:00:00:01", "dev", "rta", "nud", "reachable")
news, lock = [], threading.Lock()
def heard(n):
    with lock:
        news.append({k: (v.eth_dst if isinstance(v, NextHop) else v) for k, v in n.items()})
def settle(seconds=0.5):
    time.sleep(seconds)  # (the follower's tick is 0.1 s: what it heard is out by then)
    with lock:
        out = list(news)
        news.clear()
    return out
follower = TableFollower(heard)
follower.start()
answers, got = [], threading.Event()
follower.ask(("10.9.0.2", "10.9.0.9"), lambda a: (answers.append((threading.current_thread().name, a)), got.set()))
got.wait(5)
thread, answer = answers[0]
report = {"thread": thread, "answer": {k: (v.ifname, v.eth_src, v.eth_dst, v.neighbour) if isinstance(v, NextHop)
                                       else v for k, v in answer.items()}}
for state in ("stale", "reachable", "delay", "probe", "stale") * 4:  # churn, one MAC
    sh("ip", "neigh", "change", "10.9.0.2", "lladdr", "02:00:00:00:00:01", "dev", "rta", "nud", state)
report["churn"] = settle()
sh("ip", "neigh", "replace", "10.9.0.2", "lladdr", "02:00:00:00:00:02", "dev", "rta", "nud", "stale")
report["moved"] = settle()
start = time.monotonic()
for i in range(300):  # a neighbour flapping as fast as ip(8) can make it
    sh("ip", "neigh", "replace", "10.9.0.2", "lladdr", f"02:00:00:00:01:{i % 2:02x}", "dev", "rta", "nud", "stale")
report["flap_seconds"] = time.monotonic() - start
report["flap"] = settle()
sh("ip", "neigh", "del", "10.9.0.2", "dev", "rta")
report["deleted"] = settle()
sh("ip", "neigh", "replace", "10.9.0.2", "lladdr", "02:00:00:00:00:03", "dev", "rta", "nud", "reachable")
report["resolved"] = settle()
sh("ip", "route", "add", "blackhole", "10.9.0.2/32")
report["blackhole"] = settle()
sh("ip", "route", "del", "blackhole", "10.9.0.2/32")
report["back"] = settle()
sh("ip", "addr", "del", "10.9.0.1/24", "dev", "rta")
report["no_route"] = settle()
follower.stop()
print(json.dumps(report))
"""
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_follower_answers_off_the_loop_and_tells_only_the_changes_a_shunt_follows(netns):
    report = json.loads(netns(sys.executable, "-c", SCRIPT, REPO).stdout)
    assert report["thread"] == "route-follower"
    assert report["answer"] == {"10.9.0.2": ["rta", "02:00:00:00:fe:01", "02:00:00:00:00:01", "10.9.0.2"],
                                "10.9.0.9": "routed: the next hop's MAC is not resolved"}
    assert report["churn"] == []  # STALE/DELAY/PROBE/REACHABLE with the MAC in use: nothing
    assert report["moved"] == [{"10.9.0.2": "02:00:00:00:00:02"}]
    # Hundreds of changes: each tick says the last state once, so the loop hears about ten a second.
    assert 1 <= len(report["flap"]) <= report["flap_seconds"] / 0.1 + 3, report
    assert report["deleted"] == [{"10.9.0.2": "routed: next hop failed"}]
    assert report["resolved"] == [{"10.9.0.2": "02:00:00:00:00:03"}]
    assert report["blackhole"] == [{"10.9.0.2": "routed: blackhole route to the destination"}]
    assert report["back"] == [{"10.9.0.2": "02:00:00:00:00:03"}]
    assert report["no_route"] and report["no_route"][-1]["10.9.0.2"] == "routed: no route to the destination"


# A router's large neighbour cache: NextHops asks the kernel for the next hop's one entry
# (RTM_GETNEIGH), where pyroute2's get_neighbours dumps the whole cache and filters it in Python.
# Both are asked here: the same entries, and each one's time (printed, not asserted).
BIG_CACHE = r"""
import json, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from pyroute2 import IPRoute
from nfshunt.kernel.routes import NextHops
from nfshunt.records.model import NextHop

def sh(*args, input=None):
    subprocess.run(args, check=True, input=input, text=True)

sh("ip", "link", "add", "name", "rta", "type", "veth", "peer", "name", "rtb")
sh("ip", "link", "set", "rta", "address", "02:00:00:00:fe:01", "up")
sh("ip", "link", "set", "rtb", "up")
sh("ip", "addr", "add", "10.8.0.1/16", "dev", "rta")
sh("ip", "addr", "add", "fd08::1/64", "dev", "rta", "nodad")
N = 4000
sh("ip", "-batch", "-", input="".join(
    f"neigh replace 10.8.{i // 250}.{i % 250 + 1} lladdr 02:00:00:08:{i // 256:02x}:{i % 256:02x} dev rta nud stale\n"
    for i in range(N)) + "neigh replace fd08::7 lladdr 02:00:00:00:06:07 dev rta nud reachable\n")
hops, ipr = NextHops(), IPRoute()
asked = ["10.8.3.9", "10.8.15.250", "10.8.200.1", "fd08::7", "fd08::8"]
report = {"answers": {}, "library": {}}
for address in asked:
    answer = hops.resolve(address)
    report["answers"][address] = answer.eth_dst if isinstance(answer, NextHop) else answer
    oif = ipr.route("get", dst=address)[0].get("RTA_OIF")
    entries = ipr.get_neighbours(dst=address, ifindex=oif)
    report["library"][address] = entries[0].get("NDA_LLADDR") if entries else None
start = time.perf_counter()
for _ in range(20):
    hops.resolve("10.8.3.9")
report["lookup_ms"] = (time.perf_counter() - start) / 20 * 1000
start = time.perf_counter()
for _ in range(5):
    ipr.get_neighbours(dst="10.8.3.9", ifindex=oif)
report["library_dump_ms"] = (time.perf_counter() - start) / 5 * 1000
hops.close()
ipr.close()
print(json.dumps(report))
"""


def test_a_next_hop_in_a_large_neighbour_cache_is_asked_for_alone_and_found_as_the_dump_finds_it(netns):
    report = json.loads(netns(sys.executable, "-c", BIG_CACHE, REPO).stdout)
    unresolved = "routed: the next hop's MAC is not resolved"
    assert report["answers"] == {"10.8.3.9": "02:00:00:08:02:f6", "10.8.15.250": "02:00:00:08:0f:9f",
                                 "10.8.200.1": unresolved, "fd08::7": "02:00:00:00:06:07", "fd08::8": unresolved}
    # The library's dump finds the same entries (and none where there is none).
    assert report["library"] == \
        {a: (m if m != unresolved else None) for a, m in report["answers"].items()}
    print(f"\n4,001 neighbours: a next hop's lookup {report['lookup_ms']:.2f} ms (route, link, its entry); "
          f"get_neighbours' dump alone {report['library_dump_ms']:.1f} ms")


# A next hop the kernel has never sent to (a routed pair's new master: its slow ports heard
# nothing while it stood by). Asked plainly, it stays unresolved; asked with `solicit`, the
# kernel resolves it (its own ARP request: NTF_USE writes no MAC) and the news tells the MAC;
# one nobody answers for is left to fail, told nothing (the adoption's wait hands it back).
# h2 is in a namespace of its own (unshare), its veth end moved there.
SOLICIT = ROUTER + r"""
sh("ip", "link", "set", "rtb", "address", "02:00:00:00:00:0b")
peer = subprocess.Popen(["unshare", "-n", "sleep", "60"])
deadline = time.monotonic() + 5
while os.readlink(f"/proc/{peer.pid}/ns/net") == os.readlink("/proc/self/ns/net") and time.monotonic() < deadline:
    time.sleep(0.01)
sh("ip", "link", "set", "rtb", "netns", str(peer.pid))
for args in (("addr", "add", "10.9.0.2/24", "dev", "rtb"), ("link", "set", "rtb", "up")):
    sh("nsenter", "-t", str(peer.pid), "-n", "ip", *args)
news, errors, lock = [], [], threading.Lock()
def heard(n):
    with lock:
        news.append({k: (v.eth_dst if isinstance(v, NextHop) else v) for k, v in n.items()})
def told(seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
        with lock:
            if news:
                return news.pop(0)
    return None
def ask(addresses, solicit):
    got = []
    follower.ask(addresses, got.append, solicit)
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    return got[0]
follower = TableFollower(heard, errors.append)
follower.start()
report = {"plain": ask(("10.9.0.2",), False), "plain_news": told(1.5)}
start = time.monotonic()
report["solicited"] = ask(("10.9.0.2", "10.9.0.7"), True)
report["news"] = told(3)
report["seconds"] = time.monotonic() - start
report["later"] = told(4)  # (10.9.0.7 FAILED meanwhile: nothing to tell)
report["errors"] = errors
report["entry"] = json.loads(subprocess.run(["ip", "-j", "neigh", "show", "10.9.0.7", "dev", "rta"],
                                            capture_output=True, text=True).stdout or "[]")
follower.stop()
peer.kill()
print(json.dumps(report))
"""


def test_a_next_hop_never_sent_to_is_resolved_by_the_kernel_only_when_solicited(netns):
    report = json.loads(netns(sys.executable, "-c", SOLICIT, REPO).stdout)
    unresolved = "routed: the next hop's MAC is not resolved"
    assert report["plain"] == {"10.9.0.2": unresolved} and report["plain_news"] is None
    assert report["solicited"] == {"10.9.0.2": unresolved, "10.9.0.7": unresolved}  # (asked before it resolves)
    assert report["news"] == {"10.9.0.2": "02:00:00:00:00:0b"}, report
    assert report["later"] is None and report["errors"] == []
    assert [e.get("state") for e in report["entry"]] in ([], [["FAILED"]], [["INCOMPLETE"]]), report["entry"]
    print(f"\nsolicited next hop resolved and told {report['seconds']:.2f} s after the question")
