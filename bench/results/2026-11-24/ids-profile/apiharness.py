"""In-process harness: the IDS API with a backend that answers at once (after the real
conntrack lookup), driven by bench/idsload.py at a high rate; cProfile in every handler thread."""
import cProfile, os, pstats, subprocess, sys, tempfile, threading, time, ipaddress, resource
sys.path.insert(0, "/work/wt-idsbench")
from nfshunt.config import IdsConfig, MayShunt
from nfshunt import conntrack
from nfshunt.ids_api import IdsApi, Outcome, Result, _Handler

PROFILE = "--profile" in sys.argv
d = tempfile.mkdtemp()
tok = os.path.join(d, "tokens")
with open(os.open(tok, os.O_WRONLY | os.O_CREAT, 0o600), "w") as fh:
    fh.write("bench " + "x" * 32 + "\n")

class Backend:
    def submit(self, rule, timeout):
        conntrack.lookup(rule.connection)
        return Outcome(Result.ADDED)

profs = []
if PROFILE:
    orig = _Handler.handle
    def handle(self):
        p = cProfile.Profile(); profs.append(p); p.enable()
        try: orig(self)
        finally: p.disable()
    _Handler.handle = handle

cfg = IdsConfig(listen_port=0, token_file=tok, rate_limit=100000, max_rules=100000,
                may_shunt=MayShunt(prefixes=(ipaddress.ip_network("10.65.0.1/32"),), ports=((5201, 5201),)))
api = IdsApi(cfg, Backend()); api.start()
r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.time()
out = subprocess.run([sys.executable, "/work/wt-idsbench/bench/idsload.py", "--port", str(api.address[1]), "--token-file", tok,
                      "--rate", sys.argv[1], "--count", sys.argv[2], "--connections", "16", "--timeout", "10"],
                     capture_output=True, text=True)
r1 = resource.getrusage(resource.RUSAGE_SELF); t1 = time.time()
print(out.stdout.strip(), out.stderr[-500:])
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
n = int(sys.argv[2])
print(f"wall {t1-t0:.1f} s, server CPU {cpu:.2f} s = {cpu/n*1e6:.0f} us a request")
api.stop()
if PROFILE:
    st = pstats.Stats(profs[0])
    for p in profs[1:]: st.add(p)
    st.sort_stats("tottime").print_stats(30)
