#!/usr/bin/env python3
"""An OpenFlow proxy that makes Open vSwitch answer like a hardware switch.

Open vSwitch forwards on a flow the moment it answers the barrier behind it. Hardware does
not: the Pica8 P-3290's data plane trails the barrier reply by up to 400 ms and may apply
rules out of order (Kuzniar et al., Computer Networks 136, 2018). Between the switch and
the controller, this proxy answers every barrier request at once and hands each flow-mod
to the switch `--lag` ms later (with `--reorder`, each after a random share of the lag
between half and all of it, so later ones may overtake). Every other message passes
through in order. The testbed starts it for `Testbed(switch_lag_ms=...)`.

With `--late-barriers` it lags the other way: flow-mods reach the switch at once and the
switch's barrier replies reach the controller `--lag` ms late (a loaded switch or control
channel): the flows forward while the controller still waits for their confirmation, so a
pair stays PENDING that long with its flows in use (`Testbed(late_barriers=True)`).

  oflag.py LISTEN_HOST LISTEN_PORT CONTROLLER_HOST CONTROLLER_PORT --lag MS [--reorder | --late-barriers]

Prints "listening" once it accepts connections; runs until SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import signal
import struct
import sys

HDR = struct.Struct("!BBHI")  # version, type, length, xid
OFPT_FLOW_MOD = 14
BARRIER = {1: (18, 19), 4: (20, 21)}  # version -> (request type, reply type)


async def read_message(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readexactly(HDR.size)
    length = HDR.unpack(head)[2]
    if length < HDR.size:
        raise ValueError(f"OpenFlow message length {length}")
    return head + await reader.readexactly(length - HDR.size)


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Switch to controller: everything, unchanged."""
    while True:
        data = await reader.read(65536)
        if not data:
            return
        writer.write(data)
        await writer.drain()


async def late_barrier_replies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lag: float) -> None:
    """Switch to controller: every barrier reply `lag` seconds late, the rest at once."""
    loop = asyncio.get_running_loop()
    while True:
        msg = await read_message(reader)
        version, mtype, _, _ = HDR.unpack_from(msg)
        barrier = BARRIER.get(version)
        if barrier is not None and mtype == barrier[1]:
            loop.call_later(lag, _write, writer, msg)
            continue
        writer.write(msg)
        await writer.drain()


async def controller_to_switch(reader: asyncio.StreamReader, to_switch: asyncio.StreamWriter,
                               to_controller: asyncio.StreamWriter, lag: float, reorder: bool) -> None:
    loop = asyncio.get_running_loop()
    while True:
        msg = await read_message(reader)
        version, mtype, _, xid = HDR.unpack_from(msg)
        barrier = BARRIER.get(version)
        if barrier is not None and mtype == barrier[0]:
            to_controller.write(HDR.pack(version, barrier[1], HDR.size, xid))  # "done", at once
            continue
        if mtype == OFPT_FLOW_MOD and lag > 0:
            delay = lag * (random.uniform(0.5, 1.0) if reorder else 1.0)
            loop.call_later(delay, _write, to_switch, msg)
            continue
        to_switch.write(msg)


def _write(writer: asyncio.StreamWriter, msg: bytes) -> None:
    if not writer.is_closing():
        writer.write(msg)


async def serve(args: argparse.Namespace) -> None:
    lag = args.lag / 1000.0

    async def session(sw_reader: asyncio.StreamReader, sw_writer: asyncio.StreamWriter) -> None:
        try:
            ct_reader, ct_writer = await asyncio.open_connection(args.controller_host, args.controller_port)
        except OSError:
            sw_writer.close()
            return
        if args.late_barriers:
            tasks = [asyncio.create_task(late_barrier_replies(sw_reader, ct_writer, lag)),
                     asyncio.create_task(pipe(ct_reader, sw_writer))]
        else:
            tasks = [asyncio.create_task(pipe(sw_reader, ct_writer)),
                     asyncio.create_task(controller_to_switch(ct_reader, sw_writer, ct_writer, lag, args.reorder))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            sw_writer.close()
            ct_writer.close()

    server = await asyncio.start_server(session, args.listen_host, args.listen_port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print("listening", flush=True)
    async with server:
        await stop.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("listen_host")
    ap.add_argument("listen_port", type=int)
    ap.add_argument("controller_host")
    ap.add_argument("controller_port", type=int)
    ap.add_argument("--lag", type=float, required=True, help="ms between a barrier's reply and its flow-mods")
    ap.add_argument("--reorder", action="store_true", help="apply flow-mods out of order")
    ap.add_argument("--late-barriers", action="store_true",
                    help="flow-mods at once, the switch's barrier replies --lag ms late")
    asyncio.run(serve(ap.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
