"""The mutation score of the last `mutmut run` (make mutants), per module: mutants killed
by the unit tests out of all made, and those that survived, had no test, or timed out.
Reads mutmut's own records (mutants/**/*.py.meta); `mutmut results` lists the survivors
and `mutmut show NAME` shows one."""
from __future__ import annotations

import collections
import json
import pathlib
import sys

# mutmut 3's exit codes (mutmut/stats.py): a test run that failed killed the mutant.
KILLED = {1, 3, 37}
SURVIVED = {0}
NO_TESTS = {5, 33}
TIMEOUT = {24, -24, 36, 152, 255}


def scores(root: pathlib.Path) -> dict[str, collections.Counter[str]]:
    out: dict[str, collections.Counter[str]] = {}
    for meta in sorted(root.glob("mutants/nfshunt/**/*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"].values()
        if not codes:
            continue
        module = str(meta.relative_to(root / "mutants")).removesuffix(".meta")
        count: collections.Counter[str] = collections.Counter()
        for code in codes:
            count["total"] += 1
            count["killed" if code in KILLED else "survived" if code in SURVIVED else "no tests"
                  if code in NO_TESTS else "timeout" if code in TIMEOUT else "not checked" if code is None
                  else "other"] += 1
        out[module] = count
    return out


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    table = scores(root)
    if not table:
        print("no mutmut results under", root / "mutants", "(run `make mutants`)")
        return 1
    print(f"{'module':40} {'killed/total':>13} {'score':>6} {'survived':>9} {'no tests':>9} {'timeout':>8}")
    total: collections.Counter[str] = collections.Counter()
    for module, c in table.items():
        total.update(c)
        print(f"{module:40} {c['killed']:>6}/{c['total']:<6} {c['killed'] / c['total']:>6.1%} {c['survived']:>9} "
              f"{c['no tests']:>9} {c['timeout']:>8}")
    print(f"{'all':40} {total['killed']:>6}/{total['total']:<6} {total['killed'] / total['total']:>6.1%} "
          f"{total['survived']:>9} {total['no tests']:>9} {total['timeout']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
