"""Rehearse a multi-node launcher on this machine: a Ray cluster of NODES raylets, each declaring GPUS GPUs and the
CPUs their hosts ask for (ray.cluster_utils.Cluster, as tests/engine/test_rehearsal_two_nodes.py), then COMMAND with
RAY_ADDRESS pointing at it, so that a launcher's engine.ray_address=auto joins it as it would join `ray start`'s.

    python scripts/rehearse_cluster.py --nodes 2 --gpus 8 -- \\
        bash recipes/run_qwenimage_fast_ocr_2n16p_hybrid.sh tiny-qwenimage DATASET_DIR engine.rehearse=true max_steps=2

The command's hosts run on this machine's CPUs (engine.rehearse=true: gloo for NCCL, the model on the CPU); the
cluster stops when the command ends. Exit status: the command's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--nodes", type=int, default=2, help="raylets to start (default 2)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs each node declares (default 8)")
    p.add_argument("--cpus", type=int, default=0, help="CPUs each node declares (default: 4 per GPU, gerl's auto)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launcher command")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ray.cluster_utils import Cluster

    from gerl.engine.resources import own_ray_env

    own_ray_env()
    cpus = args.cpus or 4 * args.gpus
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "num_gpus": args.gpus})
    try:
        for _ in range(args.nodes - 1):
            cluster.add_node(num_cpus=cpus, num_gpus=args.gpus)
        cluster.wait_for_nodes()
        env = dict(os.environ, RAY_ADDRESS=cluster.address)
        print(f"rehearse_cluster: {args.nodes} nodes × {args.gpus} GPUs, {cpus} CPUs each, at {cluster.address}",
              file=sys.stderr)
        return subprocess.run(command, env=env).returncode
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
