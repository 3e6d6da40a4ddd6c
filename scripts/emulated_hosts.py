"""Bring emulated hosts up, run commands on them, tear them down (needs root; Linux).

Usage::

    python scripts/emulated_hosts.py up 2                  # algo-1, algo-2 (10.77.0.11, .12)
    python scripts/emulated_hosts.py up 3 --names a,b,c
    python scripts/emulated_hosts.py run algo-1 -- tfsmp run --hosts algo-1:2,algo-2:2 train.py
    python scripts/emulated_hosts.py status
    python scripts/emulated_hosts.py down

`run` executes the command on that host as a user logged in there would, with this shell's
environment plus the host's TMPDIR and Open MPI's launch agent (the ssh stand-in), bounded by
`timeout -k 5 SECONDS`. The other hosts' processes start with a fresh login environment, as over
ssh. The machinery is `tests/multihost/netns.py`, shared with the pytest fixture.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.multihost import netns


def _up(args: argparse.Namespace) -> int:
    names = args.names.split(",") if args.names else [f"algo-{i + 1}" for i in range(args.n)]
    if len(names) != args.n:
        print(f"emulated_hosts: error: --names must name {args.n} hosts. Received: {names}",
              file=sys.stderr)
        return 2
    cluster = netns.up(names)
    for h in cluster.hosts:
        print(f"{h.name}\t{h.address}\tnetns {h.ns}\tTMPDIR {h.tmpdir}")
    print(f"launch agent: {cluster.agent}")
    return 0


def _run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("emulated_hosts: error: run needs a command. Received: none", file=sys.stderr)
        return 2
    res = netns.load().run(args.host, command, timeout=args.timeout)
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    return res.returncode


def _status(args: argparse.Namespace) -> int:
    names = netns.stale_namespaces()
    print("\n".join(names) if names else "no emulated hosts are up")
    return 0


def _down(args: argparse.Namespace) -> int:
    netns.down()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("up", help="bring up N hosts (removing any left by an earlier run)")
    p.add_argument("n", type=int)
    p.add_argument("--names", help="comma-separated host names (default algo-1..algo-N)")
    p.set_defaults(func=_up)
    p = sub.add_parser("run", help="run a command on one host")
    p.add_argument("--timeout", type=float, default=600, help="seconds, then SIGTERM (+5 s KILL)")
    p.add_argument("host")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run)
    sub.add_parser("status", help="list our namespaces").set_defaults(func=_status)
    sub.add_parser("down", help="kill every process on the hosts, remove them").set_defaults(
        func=_down)
    args = parser.parse_args(argv)
    if args.action in ("up", "run"):
        reason = netns.unavailable()
        if reason:
            print(f"emulated_hosts: cannot emulate hosts here: {reason}", file=sys.stderr)
            return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
