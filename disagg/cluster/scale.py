"""`disagg scale --address RAY --role decode --count N`: grow or shrink one role of a cluster
that `disagg up --backend ray` started, without dropping a request.

Growing starts actors like the role's first one (same command, resources and cluster token);
each registers with the router and takes work once healthy. Shrinking drains the newest
instances first: SIGTERM, after which an instance takes no new work, finishes every request it
holds and releases every KV block a peer may still read, deregisters, and exits; only then is
its actor removed. Processes started by hand scale by starting or stopping `disagg serve
--router` (SIGTERM drains the same way). Never imports Ray elsewhere.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", required=True, help="the Ray cluster (HEAD:6379, or auto)")
    parser.add_argument(
        "--role", required=True, choices=["prefill", "decode", "both"], help="which pool"
    )
    parser.add_argument("--count", type=int, required=True, help="instances wanted (>= 1)")
    parser.add_argument(
        "--timeout-s", type=float, default=300.0,
        help="how long a new instance may take to start, or an old one to drain",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.count < 1:
        print(
            "disagg scale: --count must be >= 1 (stop the cluster to remove a role)",
            file=sys.stderr,
        )
        return 2
    from disagg.cluster.ray_backend import INSTANCE_NAME, NAMESPACE, import_ray, start_actor

    ray = import_ray()
    ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        indices = sorted(
            int(m.group(2))
            for name in ray.util.list_named_actors()
            if (m := INSTANCE_NAME.match(name)) and m.group(1) == args.role
        )
        if not indices:
            print(f"disagg scale: no {args.role} instance in this Ray cluster", file=sys.stderr)
            return 2
        actors = {i: ray.get_actor(f"{args.role}-{i}") for i in indices}
        if args.count > len(indices):
            argv, env, options, log_dir = ray.get(actors[indices[0]].spec.remote())
            # Detached: this command's driver exits now; `disagg up` stops them at teardown.
            detached = {**options, "lifetime": "detached"}
            names = [
                f"{args.role}-{indices[-1] + k}" for k in range(1, args.count - len(indices) + 1)
            ]
            new = [start_actor(ray, n, argv, env, detached, Path(log_dir)) for n in names]
            ray.get([actor.url.remote(args.timeout_s) for actor in new])
        for index in indices[args.count :][::-1]:  # the newest drain first
            ray.get(actors[index].stop.remote(args.timeout_s))
            ray.kill(actors[index], no_restart=True)
        print(f"disagg scale: {args.role} instances {len(indices)} -> {args.count}")
        return 0
    finally:
        ray.shutdown()
