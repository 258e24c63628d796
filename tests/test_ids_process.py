"""The IDS API in a process of its own (ids_process): the real child process serving HTTP,
its calls answered by a fake backend in this process; restarts, stops, start-up errors, and
a controller that dies."""
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from nfshunt.config.settings import IdsConfig, IdsTLS, MayShunt
from nfshunt.ids.backend import Submitted
from nfshunt.ids.calls import Reject
from nfshunt.ids.process import MAX_FRAME, ApiProcess, Channel
from tests.idsfake import CONN, TOKEN, FakeBackend, call, write_tokens


def config(token_file, **kw):
    return IdsConfig(listen_port=0, token_file=token_file,
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
from nfshunt.config.settings import IdsConfig
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
    ours, theirs = Channel(a), Channel(b)
    try:
        big = ("x" * 3_000_000,)
        threading.Thread(target=ours.send, args=(big,)).start()
        assert theirs.receive() == big
        a.sendall((MAX_FRAME + 1).to_bytes(4, "big"))
        with pytest.raises(ValueError, match="at most"):
            theirs.receive()
        ours.close()
        assert theirs.receive() is None
    finally:
        theirs.close()
