"""A node lost on the emulated two-node cluster: its ranks killed and its snapshots gone; the
relaunched job continues from the copies the other node holds (over the network).

    sudo python benchmarks/cluster/node_loss.py                      # 1 Gbit/s link, K=10, 30 steps
    sudo python benchmarks/cluster/node_loss.py --hybrid             # a replica per node

Needs root (cluster.py's namespaces ``parts-node0`` and ``parts-node1``, 198.18.0.1 and
198.18.0.2 on one rate-limited veth pair; deleted at the end). Each namespace runs one torchrun
launcher with 2 ranks of the main recipe (``recipes/train_gpt.py --dtype fp32 --heartbeat
--snapshot-every K``), world 4. Both namespaces share the machine's ``/dev/shm``, so each node's
host memory is a root of its own (``--snapshot-root /dev/shm/parts-node-loss-<run>/node<g>``):
no node sees the other's, and the buddy copies travel over the link.

- **reference**: the uninterrupted run at world 4, and the same without snapshots: the link bytes
  the snapshots add (the veth's counters, node 0's end, both directions) against the bytes the
  ranks counted sending (``Snapshots.sent_bytes``).
- **4 -> 4**: rank 2 (node 1) SIGKILLs itself after step ``--fail-step``; at that moment the
  benchmark kills node 1's launcher and its workers and removes node 1's snapshot root and the
  disk checkpoint folder (``--out``); node 0's ranks fail and exit. The job is relaunched on
  both nodes with the same command line: node 1's ranks receive the files their load reads
  from node 0 (``Restored.fetched_bytes``), and the final weights and optimizer state must equal
  the reference's, bitwise.
- **4 -> 2**: the same failure; the job is relaunched on node 0 alone (2 ranks): node 0's
  folder holds its own files and node 1's buddy copies, resharded onto the 2 ranks. Its final
  weights differ from the world-4 run's by construction (another world's data order), so only
  its finish, restored step and bytes are reported.

With ``--hybrid`` the recipe shards within each node and replicates across the two: each
node's snapshot is a whole checkpoint and only each rank's own values cross the link at a save.
Results go to ``benchmarks/results/bench_node_loss.jsonl`` (``bench_node_loss_hybrid.jsonl``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import cluster  # noqa: E402
from bench_kill import equal, events, weights  # noqa: E402
from record import record  # noqa: E402

SHM = Path("/dev/shm")


def launch(args: argparse.Namespace, work: Path, name: str, nodes: int, env: dict,
           snapshots: bool = True) -> list[subprocess.Popen]:
    """The recipe on ``nodes`` namespaces, 2 ranks each, each in a session of its own (a port
    of its own per launch: the last launch's store may still hold its port)."""
    procs, port = [], args.port
    args.port += 1
    for node in range(nodes):
        flags = ["--steps", str(args.steps), "--dtype", "fp32", "--plot", "", "--sample-chars", "5",
                 "--eval-interval", "100000", "--eval-batches", "1", "--heartbeat", "--out", str(work / name)]
        flags += ["--hybrid"] if args.hybrid else []
        flags += ["--snapshot-every", str(args.every), "--snapshot-job", name,
                  "--snapshot-root", str(SHM / f"parts-node-loss-{args.run}" / f"node{node}")] if snapshots else []
        command = ["ip", "netns", "exec", cluster.NODES[node], sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", str(nodes), "--node-rank", str(node), "--nproc-per-node", "2",
                   "--master-addr", cluster.ADDRS[0], "--master-port", str(port), "--max-restarts", "0",
                   "--monitor-interval", "0.1", str(ROOT / "recipes" / "train_gpt.py"), *flags]
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                    "GLOO_SOCKET_IFNAME": cluster.VETH[node], **env}
        log = open(work / f"{name}-node{node}.log", "a")
        procs.append(subprocess.Popen(command, env=full_env, cwd=work, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for each launcher; one still running after ``timeout`` is killed with its workers."""
    codes, deadline = [], time.monotonic() + timeout
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            codes.append(proc.wait())
    return codes


def tail(work: Path, name: str) -> str:
    return "\n".join(p.read_text()[-2500:] for p in sorted(work.glob(f"{name}-node*.log")))


def uninterrupted(args: argparse.Namespace, work: Path, snapshots: bool) -> dict:
    """A run without a failure: its link bytes, and with snapshots the bytes the ranks sent."""
    name = "reference" if snapshots else "no-snapshots"
    log = work / f"{name}.jsonl"
    before = cluster.link_bytes()
    codes = finish(launch(args, work, name, 2, {"PARTS_RECIPE_EVENTS": str(log)}, snapshots), args.timeout)
    after = cluster.link_bytes()
    if any(codes):
        raise SystemExit(f"the {name} run failed: {codes}\n{tail(work, name)}")
    noted = [e for e in events(log) if e["event"] == "snapshots"]
    return {"link": sum(after) - sum(before), "sent": sum(e["sent_bytes"] for e in noted),
            "saves": max((e["saves"] for e in noted), default=0), "network": all(e["network"] for e in noted)}


def fail_node_1(args: argparse.Namespace, work: Path, name: str) -> float:
    """The run that loses node 1 after ``--fail-step``: the time of the failure."""
    log = work / f"{name}.jsonl"
    procs = launch(args, work, name, 2, {"PARTS_RECIPE_FAIL": f"kill:2:{args.fail_step}",
                                         "PARTS_RECIPE_EVENTS": str(log)})
    deadline = time.monotonic() + args.timeout
    while not any(e["event"] == "fail" for e in events(log)):
        if time.monotonic() > deadline or procs[1].poll() is not None:
            finish(procs, 1)
            raise SystemExit(f"{name}: no failure was noted\n{tail(work, name)}")
        time.sleep(0.05)
    os.killpg(procs[1].pid, signal.SIGKILL)  # node 1's launcher and its workers
    shutil.rmtree(SHM / f"parts-node-loss-{args.run}" / "node1", ignore_errors=True)
    shutil.rmtree(work / name, ignore_errors=True)  # the disk checkpoint folder: not read
    finish(procs, 120)
    return next(e["time"] for e in events(log) if e["event"] == "fail")


def node_loss(args: argparse.Namespace, work: Path, nodes: int, reference: dict) -> dict:
    """Lose node 1, relaunch on ``nodes`` nodes; what the recovery cost and whether it is exact."""
    name = f"loss-{4}-to-{2 * nodes}"
    failed_at = fail_node_1(args, work, name)
    log, before, began = work / f"{name}.jsonl", cluster.link_bytes(), time.time()
    codes = finish(launch(args, work, name, nodes, {"PARTS_RECIPE_EVENTS": str(log)}), args.timeout)
    after = cluster.link_bytes()
    restored = [e for e in events(log) if e["event"] == "restored" and e["time"] >= began]
    firsts = [e for e in events(log) if e["event"] == "first step" and e["time"] >= began]
    row = {"case": f"4 -> {2 * nodes}", "finished": not any(codes) and len(restored) == 2 * nodes}
    if not row["finished"]:
        raise SystemExit(f"{name}: the relaunch failed: {codes}\n{tail(work, name)}")
    row.update(restored_step=restored[0]["step"], steps_lost=args.fail_step - restored[0]["step"],
               network=all(e["network"] for e in restored),
               restore_s=round(max(e["seconds"] for e in restored), 3),
               launch_to_step_s=round(max(e["time"] for e in firsts) - began, 2),
               fetched_MB=round(sum(e["fetched_bytes"] for e in restored) / 1e6, 3),
               relaunch_link_MB=round((sum(after) - sum(before)) / 1e6, 2),
               disk_bytes=sum(e["disk_bytes"] for e in restored),
               equal=equal(weights(work / name), reference) if nodes == 2 else "n/a (world 2)",
               failed_to_relaunch_s=round(began - failed_at, 2))
    return row


def main() -> None:
    """Build the cluster, run the reference and both losses, record, tear down."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate of each direction")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10, help="K: a snapshot every K steps")
    ap.add_argument("--fail-step", type=int, default=25)
    ap.add_argument("--port", type=int, default=29620)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    ap.add_argument("--hybrid", action="store_true",
                    help="the recipe's --hybrid (a replica per node): recorded as bench_node_loss_hybrid")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    why = cluster.can_run()
    if why:
        print(f"benchmarks/cluster/node_loss.py {why}", file=sys.stderr)
        raise SystemExit(2)
    args.run = uuid.uuid4().hex[:8]
    try:
        cluster.build(args.rate, "")
        with tempfile.TemporaryDirectory(prefix="node-loss-") as tmp:
            work = Path(tmp)
            with_snaps, without = uninterrupted(args, work, True), uninterrupted(args, work, False)
            reference = weights(work / "reference")
            rows = [node_loss(args, work, 2, reference), node_loss(args, work, 1, reference)]
    finally:
        cluster.teardown()
        shutil.rmtree(SHM / f"parts-node-loss-{args.run}", ignore_errors=True)
    summary = {"link": args.rate, "hybrid": args.hybrid, "steps": args.steps, "K": args.every,
               "fail_step": args.fail_step,
               "snapshots_network": with_snaps["network"], "saves": with_snaps["saves"],
               "buddy_sent_MB": round(with_snaps["sent"] / 1e6, 3),
               "link_MB_with_snapshots": round(with_snaps["link"] / 1e6, 2),
               "link_MB_without": round(without["link"] / 1e6, 2),
               "link_MB_snapshots_add": round((with_snaps["link"] - without["link"]) / 1e6, 2)}
    for row in rows:
        print(row, flush=True)
    print(summary)
    if not args.no_record:
        record("bench_node_loss_hybrid" if args.hybrid else "bench_node_loss", {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
