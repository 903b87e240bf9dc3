"""`shardtrain lighthouse`: torchft's lighthouse, which forms each step's quorum of replica groups.

    shardtrain lighthouse --port 29510 --min_replicas 1      # then every group: fault_tolerance's lighthouse
                                                             # http://THIS_HOST:29510 (or launch --lighthouse)

It runs until stopped (Ctrl-C or SIGTERM: exit 0). The job's groups find it at the address it prints.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from shardtrain.config.fault_tolerance import TORCHFT_LOG_ENV


def run_lighthouse(args: argparse.Namespace) -> int:
    """Entry of `shardtrain lighthouse`: serve quorums until a signal."""
    try:
        from shardtrain.parallel.replicas import quiet_torchft

        quiet_torchft(os.environ.get(TORCHFT_LOG_ENV) or "warn")  # its INFO is a line per quorum request
        from torchft._torchft import LighthouseServer
    except ImportError:
        print("error: the lighthouse is torchft's; install it with pip install 'shardtrain[ft]' (torchft)",
              file=sys.stderr)
        return 2
    if args.min_replicas < 1:
        print(f"error: --min_replicas {args.min_replicas}: it must be at least 1", file=sys.stderr)
        return 2
    try:
        server = LighthouseServer(bind=f"[::]:{args.port}", min_replicas=args.min_replicas,
                                  join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=100,
                                  heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except Exception as err:  # the port taken, most often
        print(f"error: cannot start the lighthouse on port {args.port} ({err}); choose a free --port",
              file=sys.stderr)
        return 2
    print(f"lighthouse at {server.address()} (min_replicas {args.min_replicas})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


def add_lighthouse_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `lighthouse`."""
    p = subparsers.add_parser(
        "lighthouse", help="run torchft's lighthouse for replica groups (fault_tolerance)", allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run torchft's lighthouse: the server every replica group asks for a quorum before each step.\n"
                    "Start it once per job, before or with the groups, on a host they all reach.",
        epilog="example:\n"
               "  shardtrain lighthouse --port 29510 --min_replicas 1 &\n"
               "  shardtrain launch --num_processes 8 --replica_group_id 0 --num_replica_groups 2 \\\n"
               "      --lighthouse http://LIGHTHOUSE_HOST:29510 train.py     # and group 1 on another machine")
    p.add_argument("--port", type=int, default=29510, help="the port to serve on (default 29510)")
    p.add_argument("--min_replicas", type=int, default=1, help="the fewest groups that form a quorum (default 1)")
    p.add_argument("--join_timeout_ms", type=int, default=60000,
                   help="how long a quorum waits for groups that are up (heartbeating) but have not asked yet; keep "
                        "it above the longest pause of a step (an evaluation, a checkpoint save), or a group that "
                        "restarts could form a quorum without them (default 60000)")
    p.add_argument("--heartbeat_timeout_ms", type=int, default=5000,
                   help="after how long without a heartbeat a group counts as gone (default 5000)")
    p.set_defaults(func=run_lighthouse)
