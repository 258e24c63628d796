# ruff: noqa: E501, E701, E702, B007  (throw-away experiment scripts of docs/design/routed.md, kept as run)
import socket
import sys
import threading

fam = socket.AF_INET6 if len(sys.argv) > 1 and sys.argv[1] == "6" else socket.AF_INET
s = socket.socket(fam, socket.SOCK_STREAM); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::" if fam == socket.AF_INET6 else "0.0.0.0", int(sys.argv[2]) if len(sys.argv) > 2 else 7000)); s.listen(5)
def serve(c):
    while True:
        d = c.recv(65536)
        if not d: break
        c.sendall(d)
while True:
    c, a = s.accept(); print("accepted", a, flush=True); threading.Thread(target=serve, args=(c,), daemon=True).start()
