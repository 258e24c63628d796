"""The IDS API in a process of its own (ids_process): the real child process serving HTTP,
its calls answered by a fake backend in this process; restarts, stops, start-up errors, and
a controller that dies; the child as a privilege boundary (its user, capabilities and
seccomp filter, read from /proc; frames it might forge)."""
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from nfshunt.config.ids import IdsConfig, IdsTLS, MayShunt
from nfshunt.ids.backend import Submitted
from nfshunt.ids.calls import Reject
from nfshunt.ids.frames import MAX_REQUEST, Channel, FrameError
from nfshunt.ids.process import ApiProcess
from tests.idsfake import ADMIN, CONN, OTHER, TOKEN, FakeBackend, call, write_tokens


def config(token_file, **kw):
    return IdsConfig(listen_port=0, token_file=token_file, user="nobody",
                     may_shunt=MayShunt(prefixes=(ipaddress.ip_network("10.0.0.0/24"),)), **kw)


class Served:
    """An ApiProcess on a FakeBackend: what it counted, how often it restarted."""

    def __init__(self, cfg):
        self.backend = FakeBackend(cfg)
        self.counted = []
        self.restarts = 0
        self.api = ApiProcess(cfg, self.backend, self._submit, count=self.counted.append, restarted=self._restarted)

    def _submit(self, rule, timeout, reply):
        sub = Submitted(reply, time.monotonic() + timeout)
        try:
            sub.give(self.backend.submit(rule, timeout))
        except Exception as exc:
            sub.give(exc)
        return sub

    def _restarted(self):
        self.restarts += 1


@pytest.fixture
def served(tmp_path):
    s = Served(config(write_tokens(tmp_path)))
    s.api.start()
    yield s
    s.api.stop()


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for this purpose
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def until(check, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def add(api, rule_id="1", token=TOKEN):
    return call(api, "POST", "/v1/rules", {"id": rule_id, "action": "shunt", "connection": dict(CONN), "expire": 60},
                token=token)


def test_the_child_serves_and_the_controller_answers(served):
    assert served.api.pid != os.getpid() and alive(served.api.pid)
    status, body = add(served.api)
    # the fake's precedence keeps the rule pending (no policy decision for the connection)
    assert (status, body["result"]) == (202, "added") and body["pending"]
    status, body = call(served.api, "GET", "/v1/rules")
    assert status == 200 and [r["id"] for r in body["rules"]] == ["1"]
    status, body = call(served.api, "DELETE", "/v1/rules/1")
    assert (status, body["result"]) == (200, "removed")


def test_a_listing_crosses_in_pages_and_shows_a_client_its_own_rules(served):
    for i in range(5):
        add(served.api, f"z{i}")
    add(served.api, "s0", token=OTHER)
    status, first = call(served.api, "GET", "/v1/rules?limit=2")
    assert status == 200 and [r["id"] for r in first["rules"]] == ["z0", "z1"]
    _, rest = call(served.api, "GET", f"/v1/rules?after={first['next']}")
    assert [r["id"] for r in rest["rules"]] == ["z2", "z3", "z4"] and "next" not in rest
    _, everyone = call(served.api, "GET", "/v1/rules", token=ADMIN)
    assert [r["id"] for r in everyone["rules"]] == ["z0", "z1", "z2", "z3", "z4", "s0"]


def test_refusals_are_counted_in_the_controller(served):
    assert add(served.api, token="not-a-token-of-anyone")[0] == 401
    assert call(served.api, "POST", "/v1/rules", raw=b"{")[0] == 400
    assert until(lambda: served.counted == [Reject.UNAUTHENTICATED, Reject.MALFORMED], 5)


def test_backend_errors_answer_504_and_500(served, caplog):
    served.backend.fail = TimeoutError("slow")
    t0 = time.monotonic()
    status, body = add(served.api)
    assert (status, body["error"]) == (504, "unanswered")
    assert time.monotonic() - t0 < 2  # answered when the controller said so, not at the child's own limit
    served.backend.fail = KeyError("bug")
    with caplog.at_level(logging.ERROR, logger="nfshunt"):
        status, body = add(served.api)
    assert (status, body["error"]) == (500, "internal")
    assert any("IDS API call failed" in r.getMessage() for r in caplog.records)


def test_the_childs_log_records_are_logged_by_the_controller(tmp_path, caplog):
    tokens = write_tokens(tmp_path)
    os.chmod(tokens, 0o644)  # others may read it: the child refuses every request and logs why
    s = Served(config(tokens))
    with caplog.at_level(logging.ERROR, logger="nfshunt"):
        s.api.start()
        try:
            assert add(s.api)[0] == 401
            assert until(lambda: any("not a regular file of mode 0600" in r.getMessage() for r in caplog.records))
        finally:
            s.api.stop()


def test_a_child_that_dies_is_started_again_on_the_same_socket(served, caplog):
    address, first = served.api.address, served.api.pid
    with caplog.at_level(logging.ERROR, logger="nfshunt"):
        os.kill(first, signal.SIGKILL)
        # a client that connects meanwhile waits in the backlog, and is served by the next child
        assert add(served.api, "2")[0] == 202
    assert served.api.address == address and served.api.pid != first and alive(served.api.pid)
    assert served.restarts == 1
    assert any("the IDS API process ended (killed by SIGKILL)" in r.getMessage() for r in caplog.records)
    assert call(served.api, "GET", "/v1/rules/2")[0] == 200


def test_stop_ends_the_child_and_frees_the_port(tmp_path):
    s = Served(config(write_tokens(tmp_path)))
    s.api.start()
    pid, (host, port) = s.api.pid, s.api.address
    s.api.stop()
    assert not alive(pid)
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind((host, port))
    assert s.restarts == 0


def test_an_address_in_use_fails_the_start_and_starts_no_child(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        s = Served(IdsConfig(listen_port=taken.getsockname()[1], token_file=write_tokens(tmp_path)))
        with pytest.raises(OSError):
            s.api.start()
        assert s.api.pid is None


def test_a_child_that_cannot_serve_fails_the_start_with_its_reason(tmp_path):
    cfg = config(None, listen_address="127.0.0.1",
                 tls=IdsTLS(str(tmp_path / "missing.pem"), str(tmp_path / "missing.key"), None))
    s = Served(cfg)
    with pytest.raises(RuntimeError, match="the IDS API could not start: FileNotFoundError"):
        s.api.start()
    assert not alive(s.api.pid)


CONTROLLER = """
import sys, time
sys.path[:0] = [{root!r}]
from nfshunt.config.ids import IdsConfig
from nfshunt.ids.process import ApiProcess
from tests.idsfake import FakeBackend
cfg = IdsConfig(listen_port=0, token_file={tokens!r})
b = FakeBackend(cfg)
api = ApiProcess(cfg, b, None, count=lambda why: None)
api.start()
print(api.pid, flush=True)
time.sleep(60)
"""


def test_the_child_ends_when_the_controller_is_killed(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = CONTROLLER.format(root=root, tokens=write_tokens(tmp_path))
    controller = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(controller.stdout.readline())
        assert alive(child)
        controller.kill()
        controller.wait()
        assert until(lambda: not alive(child), 5), "the API's process outlived the controller"
    finally:
        controller.kill()
        controller.wait()


def test_channel_frames():
    a, b = socket.socketpair()
    ours, theirs = Channel(a, MAX_REQUEST), Channel(b, MAX_REQUEST)
    try:
        big = {"op": "log", "text": "x" * 60_000}
        threading.Thread(target=ours.send, args=(big,)).start()
        assert theirs.receive() == big
        ours.close()
        assert theirs.receive() is None
    finally:
        theirs.close()


@pytest.mark.parametrize("raw,problem", [
    (b"\x01" + (MAX_REQUEST + 1).to_bytes(4, "big"), "at most"),
    (b"\x02" + (2).to_bytes(4, "big") + b"{}", "version 2"),
    ((5).to_bytes(4, "big") + b"\x80\x04K\x01.", "version 0"),  # the old frames: a length and a pickle
    (b"\x01" + (5).to_bytes(4, "big") + b"\x80\x04K\x01.", "not a JSON frame"),
    (b"\x01" + (3).to_bytes(4, "big") + b"[1]", "not an object"),
    (b"\x01" + (7).to_bytes(4, "big") + b'{"x":1}', "not an object with an op"),
    (b"\x01" + (60000).to_bytes(4, "big") + b"[" * 30000 + b"]" * 30000, "not a JSON frame"),
    (b"\x01" + (9).to_bytes(4, "big") + b'{"op":[1]', "not a JSON frame"),
    (b"\x01" + (5006).to_bytes(4, "big") + b'{"op":' + b"9" * 5000, "not a JSON frame"),
])
def test_what_is_not_a_frame_is_refused(raw, problem):
    a, b = socket.socketpair()
    theirs = Channel(b, MAX_REQUEST)
    try:
        a.sendall(raw)
        with pytest.raises(FrameError, match=problem):
            theirs.receive()
    finally:
        a.close()
        theirs.close()


# --- the child as a privilege boundary ------------------------------------------------------------


def status_of(pid):
    with open(f"/proc/{pid}/status") as fh:
        return dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)


@pytest.mark.skipif(os.geteuid() != 0, reason="a controller that is not root has no user to give up")
def test_the_child_runs_as_an_unprivileged_user_with_no_capability_and_a_seccomp_filter(served):
    """Issue 36, 11: the API's process parses what anyone sends; it holds nothing worth taking."""
    import pwd
    nobody = pwd.getpwnam("nobody")
    st = status_of(served.api.pid)
    assert st["Uid"].split() == [str(nobody.pw_uid)] * 4 and st["Gid"].split() == [str(nobody.pw_gid)] * 4
    assert st["Groups"].strip() == ""
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(st[caps], 16) == 0, (caps, st[caps])
    assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"  # 2: a filter
    assert int(status_of(os.getpid())["CapEff"], 16) != 0  # (the controller's own are kept)
    status, body = add(served.api)  # and it serves
    assert status == 202


CONFINED = """
import ctypes, os, socket, sys
sys.path[:0] = [{root!r}]
from nfshunt.ids.confine import confine
confine("nobody")
libc = ctypes.CDLL(None, use_errno=True)


def unshare():
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "unshare")
for name, call in [("exec", lambda: os.execv("/bin/true", ["true"])),
                   ("packet socket", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW)),
                   ("conntrack netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)),
                   ("setuid", lambda: os.setuid(0)), ("unshare", unshare),
                   ("read /etc/shadow", lambda: open("/etc/shadow").read())]:
    try:
        call()
        print(name, "allowed")
    except OSError as exc:
        print(name, "refused", exc.errno)
socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4).close()
socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
print("sock_diag and inet allowed")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a controller that is not root has no user to give up")
def test_the_seccomp_filter_refuses_what_the_api_never_does():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", CONFINED.format(root=root)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == ["exec refused 1", "packet socket refused 97", "conntrack netlink refused 93", "setuid refused 1",
                     "unshare refused 1", "read /etc/shadow refused 13", "sock_diag and inet allowed"], out.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a root-only token file")
def test_the_child_as_nobody_takes_tokens_from_the_controller_and_a_rotated_one_at_once(tmp_path):
    """The token file is root's (0600): the controller reads it for the child. A folder the
    child may search lets it see a change by stat, before the next request; one it may not
    search (pytest's own are 0700) is asked after once a second."""
    import pathlib
    import tempfile
    searchable = pathlib.Path(tempfile.mkdtemp(prefix="nfshunt-tokens-"))
    searchable.chmod(0o711)
    try:
        _rotate_through_the_child(searchable, at_once=True)
        _rotate_through_the_child(tmp_path, at_once=False)
    finally:
        shutil.rmtree(searchable)


def _rotate_through_the_child(where, at_once):
    tokens = write_tokens(where)
    s = Served(config(tokens, rate_limit_unauthenticated=1000))  # (the polling below fails 50 a second)
    s.api.start()
    try:
        assert add(s.api)[0] == 202
        new = "zeek-rotated-token-0123456789"
        replacement = f"{tokens}.new"
        with open(os.open(replacement, os.O_WRONLY | os.O_CREAT, 0o600), "w") as fh:
            fh.write(f"zeek {new} admin\n")
        os.replace(replacement, tokens)
        if at_once:  # from the next request on
            assert add(s.api, "2")[0] == 401
            assert add(s.api, "3", token=new)[0] == 202
        else:
            assert until(lambda: add(s.api, "2", token=new)[0] == 202, 3)
        assert add(s.api, "4")[0] == 401
    finally:
        s.api.stop()


def _serve_one(backend, cfg, frame, answered=False, wall=time.time):
    """A BackendServer on the real backend given one frame by a forging child: what it counted
    as bad, what it counted as refusals, and its answer (a request's) if `answered`."""
    from nfshunt.ids.frames import MAX_ANSWER
    from nfshunt.ids.process import BackendServer
    ours, theirs = socket.socketpair()
    bad, counted = [], []
    server = BackendServer(Channel(ours, MAX_REQUEST), cfg, backend, counted.append,
                           backend.submit_async, bad.append, workers=2, wall=wall)
    child = Channel(theirs, MAX_ANSWER)
    served = threading.Thread(target=server.serve, args=(lambda error: None,))
    served.start()
    try:
        if isinstance(frame, bytes):
            child.sock.sendall(frame)
        else:
            child.send(frame)
        if not answered:
            served.join(5)  # a frame that is not a request ends the serving
            assert not served.is_alive()
            return bad, counted, None
        child.sock.settimeout(5)
        return bad, counted, child.receive()
    finally:
        child.close()
        served.join(5)


def test_a_forged_frame_changes_nothing_and_is_counted():
    """Issue 36, 11: what the API's process says is a request, never the firewall's
    decision: a frame carrying a conntrack entry (the one the old protocol trusted: an
    entry, accepted and left alone by the policy, of a connection the kernel does not
    hold) or any other frame that is not a request is counted, ends the child, and leaves
    no rule, pin or pair; a well-formed add of that connection is judged on the kernel's
    entry (none here): kept pending, nothing on the switch."""
    from tests.test_ids_backend import ORIG, WALL, setup
    rig, backend, entries, _ = setup()
    cfg = backend.cfg
    rule = {"source": "ids:zeek", "id": "f1", "kind": "shunt", "priority": 0, "expire": 60, "created": WALL,
            "connection": {"protocol": "tcp", "src": ORIG.src, "sport": ORIG.sport, "dst": ORIG.dst,
                           "dport": ORIG.dport}}
    entry = {"kind": "update", "ct_id": 7, "mark": 0x10120000, "tcp_state": 3}  # decided: ignore, ports 1 and 2
    forged = [
        ({"op": "submit", "seq": 1, "timeout": 1.0, "rule": rule, "entry": entry}, "unknown field 'entry'"),
        ({"op": "submit", "seq": 1, "timeout": 1.0, "rule": {**rule, "source": "operator"}}, "not a requester"),
        ({"op": "submit", "seq": 1, "timeout": 1.0, "rule": {**rule, "server": {"address": ORIG.src, "port": 1}}},
         "server"),
        ({"op": "submit", "seq": 1, "timeout": 1e9, "rule": rule}, "timeout"),
        ({"op": "submit", "seq": "1", "timeout": 1.0, "rule": rule}, "seq"),
        ({"op": "submit", "seq": 1, "timeout": 1.0, "rule": {**rule, "kind": "pin"}}, "rule"),
        ({"op": "install", "seq": 1, "conn": rule}, "unknown op"),
        ({"op": "count", "reason": "installed"}, "not a refusal"),
        ({"op": "log", "name": "root", "level": 40, "message": "x", "exc": None}, "not one of nfshunt's"),
        (b"\x00\x00\x00\x10" + b"\x80\x04\x95" + b"\x00" * 13, "version 0"),  # a pickle, as the old frames were
    ]
    for frame, problem in forged:
        bad, counted, answer = _serve_one(backend, cfg, frame)
        assert len(bad) == 1 and problem in bad[0] and answer is None and not counted, (frame, bad)
        assert not backend.store.rules and not rig.core.shared.pins and rig.core.find(tuple_=ORIG) is None
    # The same add, well formed, as a request: the controller's own look finds no entry.
    bad, _, answer = _serve_one(backend, cfg, {"op": "submit", "seq": 2, "timeout": 1.0,
                                               "rule": {**rule, "created": WALL + 86400 * 30}}, True, lambda: WALL)
    assert not bad and answer["seq"] == 2 and answer["value"]["result"] == "added" and answer["value"]["pending"]
    assert rig.core.find(tuple_=ORIG) is None
    assert backend.store.get("ids:zeek", "f1").created == WALL  # its time the controller's, not the child's


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("openssl") is None, reason="needs root and openssl")
def test_the_child_serves_tls_with_a_key_only_root_may_read(tmp_path):
    """The key is root's (0600): read by the child before it takes its user; it serves TLS as nobody."""
    import http.client
    import ssl
    d = str(tmp_path)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
                    "server.pem", "-days", "1", "-subj", "/CN=127.0.0.1"], cwd=d, check=True, capture_output=True)
    os.chmod(f"{d}/server.key", 0o600)
    s = Served(config(write_tokens(tmp_path), tls=IdsTLS(f"{d}/server.pem", f"{d}/server.key", None)))
    s.api.start()
    try:
        assert status_of(s.api.pid)["Uid"].split()[0] != "0"
        ctx = ssl.create_default_context(cafile=f"{d}/server.pem")
        ctx.check_hostname = False
        conn = http.client.HTTPSConnection(*s.api.address, context=ctx, timeout=5)
        conn.request("GET", "/v1/rules", headers={"Authorization": f"Bearer {TOKEN}"})
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        s.api.stop()


def test_the_childs_log_records_are_rate_limited_by_logger_and_level(caplog, monkeypatch):
    """Review s56, 4: every record the API's process sent was logged, however many (a 500's
    traceback for each request of a client, say, or a compromised child's flood). Now a
    logger and level's records are logged a burst at a time every 10 s, the first after
    it saying how many were held back; another logger's or level's are not held by them."""
    from nfshunt.ids.frames import MAX_ANSWER
    from nfshunt.ids.process import BackendServer
    from nfshunt.observe import logs
    clock = [1000.0]
    monkeypatch.setattr(logs, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    cfg = config(None)
    ours, theirs = socket.socketpair()
    bad = []
    server = BackendServer(Channel(ours, MAX_REQUEST), cfg, FakeBackend(cfg), lambda why: None, lambda *a: None,
                           bad.append, workers=1)
    child = Channel(theirs, MAX_ANSWER)
    served = threading.Thread(target=server.serve, args=(lambda error: None,))
    served.start()

    def log(level, text, name="nfshunt"):
        child.send({"op": "log", "name": name, "level": level, "message": text, "exc": None})

    def seen(text):
        return [r.getMessage() for r in caplog.records if text in r.getMessage()]
    try:
        with caplog.at_level(logging.DEBUG, logger="nfshunt"):
            for i in range(1000):
                log(logging.ERROR, f"flood {i}")
            log(logging.WARNING, "another level")
            log(logging.ERROR, "another logger", "nfshunt.other")
            assert until(lambda: seen("another logger"), 10)
            flood = seen("flood")
            assert seen("another level") and 0 < len(flood) < 1000 and "flood 0" in flood[0]
            clock[0] += 10
            log(logging.ERROR, "flood again")
            assert until(lambda: seen("flood again"), 10)
            assert f"({1000 - len(flood)} more like this since the last report)" in seen("flood again")[0]
        assert not bad
    finally:
        child.close()
        served.join(5)


def test_calls_past_one_a_connection_are_answered_busy_not_queued_without_end():
    """Review s56: each of the child's threads waits for its call, so a child (compromised)
    that sends calls faster than they are served grew the controller's queue of them without
    end. Past max_connections + CALLS_SPARE outstanding, a call is answered busy at once; the
    others are served once the backend is free."""
    from nfshunt.ids.frames import MAX_ANSWER
    from nfshunt.ids.process import CALLS_SPARE, TIMEOUT, BackendServer
    cfg = config(None, max_connections=2, max_connections_per_client=2)
    backend = FakeBackend(cfg)
    free = threading.Event()
    listed = backend.rules
    backend.rules = lambda *args: free.wait(10) and listed(*args)
    ours, theirs = socket.socketpair()
    theirs.settimeout(10)  # (a failure is an error, not a hang)
    bad, busy = [], []
    server = BackendServer(Channel(ours, MAX_REQUEST), cfg, backend, lambda why: None, lambda *a: None,
                           bad.append, workers=2, busy=busy.append)
    child = Channel(theirs, MAX_ANSWER)
    served = threading.Thread(target=server.serve, args=(lambda error: None,))
    served.start()
    limit, extra = cfg.max_connections + CALLS_SPARE, 3
    try:
        for seq in range(1, limit + extra + 1):
            child.send({"op": "rules", "seq": seq, "source": "ids:zeek", "kind": None, "address": None,
                        "after": 0, "limit": 10})
        answered = [child.receive() for _ in range(extra)]  # at once: nothing else can be answered yet
        assert [(a["seq"], a["done"]) for a in answered] == [(limit + 1 + i, TIMEOUT) for i in range(extra)]
        assert busy == ["rules"] * extra  # counted, by call
        free.set()
        served_ = sorted(child.receive()["seq"] for _ in range(limit))
        assert served_ == list(range(1, limit + 1)) and not bad
    finally:
        free.set()
        child.close()
        served.join(10)
    assert not served.is_alive()


def test_a_submit_the_loop_has_no_room_for_is_answered_busy_at_once_and_the_reader_goes_on():
    """Review s57: a submit waited on the frame reader for room in the event loop's queue of
    calls (loop.QUEUED), up to its own timeout, and the child's frames behind it (counts,
    logs, tokens, removals) waited too: a token rotation seen late, a flood of submits
    holding the reader. With the loop not turning, QUEUED submits are queued; the next is
    answered busy at once (TIMEOUT: the API's 504), counted, and the count frame behind it
    is taken at once."""
    from nfshunt.ids.frames import MAX_ANSWER
    from nfshunt.ids.loop import QUEUED
    from nfshunt.ids.process import TIMEOUT, BackendServer
    from tests.test_ids_backend import ORIG, WALL, setup
    rig, backend, _, _ = setup()
    post, posted = backend.host.post, []
    backend.host.post = posted.append  # the event loop takes nothing: its queue of calls fills
    ours, theirs = socket.socketpair()
    theirs.settimeout(10)  # (a failure is an error, not a hang)
    bad, counted, busy = [], [], []
    server = BackendServer(Channel(ours, MAX_REQUEST), backend.cfg, backend, counted.append, backend.submit_async,
                           bad.append, workers=2, busy=busy.append)
    child = Channel(theirs, MAX_ANSWER)
    served = threading.Thread(target=server.serve, args=(lambda error: None,))
    served.start()
    try:
        start = time.monotonic()
        for seq in range(1, QUEUED + 2):
            rule = {"source": "ids:zeek", "id": str(seq), "kind": "shunt", "priority": 0, "expire": 60,
                    "created": WALL, "connection": {"protocol": "tcp", "src": ORIG.src, "sport": 30000 + seq,
                                                    "dst": ORIG.dst, "dport": ORIG.dport}}
            child.send({"op": "submit", "seq": seq, "timeout": 10.0, "rule": rule})
        child.send({"op": "count", "reason": "rate_limited"})
        assert until(lambda: counted == [Reject.RATE_LIMITED], 2.0), "the count waited behind the submit"
        answer = child.receive()
        assert time.monotonic() - start < 2.0  # at once, not at the submit's 10 s
        assert (answer["seq"], answer["done"]) == (QUEUED + 1, TIMEOUT) and "busy" in answer["value"]
        assert busy == ["submit"] and not bad
        post(posted.pop())  # the loop turns: the queued adds are judged (no entry yet: pending) and answered
        answered = sorted((a["seq"], a["value"]["result"], bool(a["value"]["pending"]))
                          for a in (child.receive() for _ in range(QUEUED)))
        assert answered == [(seq, "added", True) for seq in range(1, QUEUED + 1)]
    finally:
        child.close()
        served.join(15)
    assert not served.is_alive()
