# A poor man's sampling profiler for the controller process only (bench profiling, not committed).
import os
import sys
import threading
import time
import json
from collections import Counter


def _is_controller():
    try:
        with open("/proc/self/cmdline", "rb") as fh:
            return b"nfshunt\x00run" in fh.read()
    except OSError:
        return False


WAITS = {"wait", "select", "poll", "accept", "recv", "recv_into", "sleep", "get", "_wait_for_tstate_lock",
         "readinto", "acquire", "join", "serve_forever", "recvfrom", "epoll", "readline"}


def _run(out):
    leaf = Counter()
    incl = Counter()
    per_thread = Counter()
    own = threading.get_ident()
    last = time.time()
    with open(out, "a") as fh:
        while True:
            time.sleep(0.05)
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == own:
                    continue
                tname = names.get(ident, str(ident))
                code = frame.f_code
                top = f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"
                if code.co_name in WAITS:
                    per_thread[(tname, "idle")] += 1
                    continue
                per_thread[(tname, "busy")] += 1
                leaf[f"{tname} | {top}"] += 1
                seen = set()
                f = frame
                while f is not None:
                    key = f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)})"
                    if key not in seen:
                        incl[key] += 1
                        seen.add(key)
                    f = f.f_back
            if time.time() - last >= 1.0:
                last = time.time()
                cpu = Counter()
                for t in threading.enumerate():
                    try:
                        with open(f"/proc/self/task/{t.native_id}/stat") as sf:
                            fields = sf.read().rsplit(")", 1)[1].split()
                        cpu[t.name.split("(")[-1].rstrip(")")] += int(fields[11]) + int(fields[12])
                    except (OSError, TypeError):
                        pass
                with open("/proc/self/stat") as sf:
                    fields = sf.read().rsplit(")", 1)[1].split()
                cpu["PROCESS"] = int(fields[11]) + int(fields[12])
                fh.write(json.dumps({"t": last, "cpu": dict(cpu), "threads": {f"{a}/{b}": v for (a, b), v in per_thread.items()},
                                     "leaf": dict(leaf.most_common(400)), "incl": dict(incl.most_common(600))}) + "\n")
                fh.flush()


if _is_controller() and os.environ.get("NFSHUNT_SAMPLE"):
    threading.Thread(target=_run, args=(f"{os.environ['NFSHUNT_SAMPLE']}.{os.getpid()}.jsonl",), daemon=True,
                     name="sampler").start()
