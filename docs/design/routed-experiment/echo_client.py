# ruff: noqa: E501, E701, E702, B007  (throw-away experiment scripts of docs/design/routed.md, kept as run)
# echo_client.py DST SECONDS: one TCP connection from port 41000, a line every 0.1 s; reports the longest gap and how it ended
import socket
import sys
import time

dst, secs = sys.argv[1], float(sys.argv[2]); cport = int(sys.argv[3]) if len(sys.argv) > 3 else 41000
fam = socket.AF_INET6 if ":" in dst else socket.AF_INET
s = socket.socket(fam, socket.SOCK_STREAM); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::" if fam == socket.AF_INET6 else "0.0.0.0", cport)); s.connect((dst, 7000)); s.settimeout(15)
end = time.monotonic() + secs; n = 0; last = time.monotonic(); gap = 0.0
try:
    while time.monotonic() < end:
        msg = f"line {n}\n".encode(); s.sendall(msg); got = b""
        while len(got) < len(msg):
            d = s.recv(4096)
            if not d: raise EOFError("peer closed")
            got += d
        now = time.monotonic(); gap = max(gap, now - last); last = now; n += 1; time.sleep(0.1)
    print(f"OK lines={n} longest_gap={gap:.2f}s", flush=True)
except Exception as e:
    print(f"FAILED after lines={n}: {type(e).__name__}: {e}", flush=True)
