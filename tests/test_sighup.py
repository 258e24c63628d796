"""SIGHUP to a running controller (a namespace of its own, no switch): each is acted on at
once, its reload done within milliseconds. The main thread looked for it every 0.5 s: a
reload came 0.25 s after its SIGHUP on average, up to 0.5 s (and phase-locked, as here, about
0.45 s each). Then SIGTERM still stops it cleanly."""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

from nfshunt.app.control import ControlError, request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUPS = 7


def _reloads(sock: str) -> int | None:
    try:
        st = request(sock, {"cmd": "status", "connections": False}, timeout=2)
    except ControlError:
        return None
    return st.get("counters", {}).get("operator_reload", 0) if "counters" in st else None


def test_each_sighup_is_acted_on_at_once_and_sigterm_still_stops(netns, tmp_path):
    sock = str(tmp_path / "ctl" / "nfshunt.sock")
    cfg = {"ports": [{"fast": 1, "slow": 2, "physdevin": 1}, {"fast": 3, "slow": 4, "physdevin": 2}],
           "mark_actions": {"0": "ignore", "1": "shunt", "2": "block"}, "listen_address": "127.0.0.1",
           "listen_port": 16654, "control_socket": sock, "state_dir": str(tmp_path / "state")}
    path = tmp_path / "nfshunt.json"
    path.write_text(json.dumps(cfg))
    log = tmp_path / "controller.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["ip", "netns", "exec", netns.name, sys.executable, "-m", "nfshunt", "run", "--config",
                                 str(path)], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=dict(os.environ, PYTHONPATH=REPO))
    try:
        deadline = time.monotonic() + 20
        while _reloads(sock) is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        latencies = []
        for _ in range(HUPS):
            before = _reloads(sock)
            assert before is not None
            t0 = time.monotonic()
            proc.send_signal(signal.SIGHUP)
            while (now := _reloads(sock)) is None or now <= before:
                assert time.monotonic() - t0 < 5, f"no reload 5 s after SIGHUP:\n{log.read_text()[-3000:]}"
                time.sleep(0.002)
            latencies.append(time.monotonic() - t0)
            time.sleep(0.1)
        # Median of 7: one HUP that meets a busy moment of this shared 2-core VM does not
        # decide it; the old 0.5 s poll gave a median near 0.25 s (0.45 s phase-locked).
        print(f"SIGHUP -> reload done: {[round(x * 1000, 1) for x in latencies]} ms")
        assert statistics.median(latencies) < 0.1, latencies
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert text.count("reload (SIGHUP): changed nothing") == HUPS, text[-3000:]
    assert "received SIGTERM, shutting down" in text and " ERROR " not in text, text[-3000:]
