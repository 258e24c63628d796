"""`nfshunt top`: a live terminal view over one control request (`top`, app/top.py),
asked every second: the busiest connections on both paths, the shunt and take-down
rates, the budget and the slow path's share. `q` quits. Fits 80x24 (wider terminals get
a wider tuple column); a smaller one is told so. Curses from the standard library; the
frame itself (`frame`) is plain text, which `--once` prints."""
from __future__ import annotations

import argparse
import curses
import os
import sys
import time
from typing import Any, Callable

from nfshunt.app.control import ControlError, request

MIN_WIDTH, MIN_HEIGHT = 80, 24
HEAD = 8  # rows above the table's rows (title, switches, pairs, rates, traffic, a note, blank, header)
FIXED = 5 + 7 + 12 + 10 + 8  # the table's columns but the tuple's
EXIT_BAD_INPUT = 2


def _bits(bytes_per_s: float | None) -> str:
    if bytes_per_s is None:
        return "-"
    n = bytes_per_s * 8
    for prefix in ("", "k", "M", "G", "T"):
        if n < 1000 or prefix == "T":
            return f"{n:.0f}b/s" if prefix == "" else f"{n:.1f}{prefix}b/s"
        n /= 1000
    return "-"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for prefix in ("", "K", "M", "G", "T"):
        if value < 1000 or prefix == "T":
            return f"{value:.0f}B" if prefix == "" else f"{value:.1f}{prefix}B"
        value /= 1000
    return "-"


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "~"


def _summary(reply: dict[str, Any]) -> list[str]:
    sws = reply["switches"]
    up = sum(1 for s in sws if s["connected"])
    switches = (f"switch {sws[0]['datapath_id']}: {'connected' if up else 'AWAY (not connected)'}" if len(sws) == 1
                else f"switches: {up} of {len(sws)} connected")
    budget = reply["budget"]
    used = reply["shunts"] + reply["blocks"]
    room = f"budget {used} of {budget} ({100 * used / budget:.0f}%)" if budget else f"{used} pairs, no budget set"
    per = reply["interval"]
    rates = (f"rates: {reply['shunts_per_s']:.1f} shunts/s, {reply['takedowns_per_s']:.1f} take-downs/s over "
             f"{per:.1f} s" if per and reply["shunts_per_s"] is not None and reply["takedowns_per_s"] is not None
             else "rates: from the next refresh on")
    share = reply["slow_share"]
    traffic = (f"traffic: fast path {_bits(reply['fast_bytes_per_s'])}, slow path {_bits(reply['slow_bytes_per_s'])}"
               + (f", slow path's share {100 * share:.1f}%" if share is not None else ""))
    note = ("note: conntrack counts no bytes: sysctl net.netfilter.nf_conntrack_acct=1"
            if reply["accounting"] is False else reply.get("conntrack_error") or
            f"slow path: {reply['slow_entries']} conntrack entries of bridged traffic")
    return [switches, f"pairs: {reply['shunts']} shunts, {reply['blocks']} blocks, {room}, "
            f"{reply['waiting']} waiting", rates, traffic, note]


def frame(reply: dict[str, Any] | None, error: str | None, width: int, height: int, clock: str,
          interval: float = 1.0) -> list[str]:
    """The screen's lines (each shorter than `width`)."""
    if width < MIN_WIDTH or height < MIN_HEIGHT:
        return [_fit(line, width - 1) for line in (f"terminal too small ({width}x{height}):",
                                                   f"nfshunt top needs {MIN_WIDTH}x{MIN_HEIGHT}", "q quits")]
    lines = [f"nfshunt top  {clock}  every {interval:g} s  q quits"]
    if reply is None:
        return [_fit(line, width - 1) for line in (*lines, f"no answer: {error}" if error else "asking ...")]
    lines += _summary(reply)
    if error:
        lines[-1] = f"last refresh failed: {error}"
    tuple_width = width - 1 - FIXED
    lines += ["", f"{'PATH':<5}{'ACTION':<7}{'STATE':<12}{'TUPLE':<{tuple_width}}{'RATE':>10}{'TOTAL':>8}"]
    for row in reply["top"][:height - HEAD]:
        lines.append(f"{row['path']:<5}{row['action'] or '-':<7}{_fit(str(row['state']), 11):<12}"
                     f"{_fit(row['tuple'], tuple_width - 1):<{tuple_width}}{_bits(row['bytes_per_s']):>10}"
                     f"{_bytes(row['bytes']):>8}")
    return [_fit(line, width - 1) for line in lines[:height]]


def _ask(socket_path: str, limit: int) -> tuple[dict[str, Any] | None, str | None]:
    try:
        reply = request(socket_path, {"cmd": "top", "limit": limit}, timeout=5)
    except ControlError as exc:
        return None, str(exc)
    if "error" in reply:
        return None, str(reply["error"])
    return reply, None


def _size(screen: Any) -> tuple[int, int]:
    """The terminal's size as the kernel has it (a resize ncurses missed is caught up)."""
    try:
        cols, rows = os.get_terminal_size(sys.stdout.fileno())
    except (OSError, AttributeError, ValueError):
        return screen.getmaxyx()
    if (rows, cols) != screen.getmaxyx():
        curses.resizeterm(rows, cols)
    return rows, cols


def _loop(screen: Any, ask: Callable[[int], tuple[dict[str, Any] | None, str | None]], interval: float) -> None:
    try:
        curses.curs_set(0)
    except curses.error:
        pass
    screen.timeout(100)
    shown: dict[str, Any] | None = None
    error: str | None = None
    due = 0.0
    while True:
        height, width = _size(screen)
        if time.monotonic() >= due and width >= MIN_WIDTH and height >= MIN_HEIGHT:
            due = time.monotonic() + interval
            got, error = ask(max(1, height - HEAD))
            shown = got or shown
        screen.erase()
        for y, line in enumerate(frame(shown, error, width, height, time.strftime("%H:%M:%S"), interval)):
            try:
                screen.addstr(y, 0, line)
            except curses.error:  # the last cell of the screen
                pass
        screen.refresh()
        key = screen.getch()
        if key in (ord("q"), ord("Q")):
            return


def cmd_top(args: argparse.Namespace, socket_path: str) -> int:
    def ask(limit: int) -> tuple[dict[str, Any] | None, str | None]:
        return _ask(socket_path, limit)
    if args.once:
        reply, error = ask(MIN_HEIGHT - HEAD)
        print("\n".join(frame(reply, error, MIN_WIDTH, MIN_HEIGHT, time.strftime("%H:%M:%S"))))
        return 0 if reply is not None else 1
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("nfshunt top: needs a terminal (or --once for one frame as text)", file=sys.stderr)
        return EXIT_BAD_INPUT
    # ncurses takes LINES and COLUMNS from the environment over the terminal's own size: a
    # shell (or a test runner) that exported them once would make every frame the wrong size.
    os.environ.pop("LINES", None)
    os.environ.pop("COLUMNS", None)
    curses.wrapper(_loop, ask, args.interval)
    return 0
