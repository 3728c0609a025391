"""An emulated two-node cluster on one machine: DDP, FSDP2 and parts over a rate-limited link.

    sudo python benchmarks/cluster/cluster.py                  # 1 Gbit/s, 5 steps per system
    sudo python benchmarks/cluster/cluster.py --rate 10gbit --steps 7

Needs root (it creates network namespaces, a veth pair and tc qdiscs); without root, or
without ``ip``/``tc``, it says so and exits 2. Two namespaces (``parts-node0``,
``parts-node1``) are joined by one veth pair whose ends carry 198.18.0.1 and 198.18.0.2 (the
benchmarking range, 198.18.0.0/24) and egress a ``tc tbf`` limited to ``--rate`` (optional
``--delay``: netem). Each namespace runs one torchrun launcher with 2 ranks (``--nnodes 2``,
static rendezvous at 198.18.0.1: torchrun's c10d rendezvous cannot tell which namespace hosts
its store), gloo bound to the veth (``GLOO_SOCKET_IFNAME``). No traffic goes anywhere else:
the namespaces have no other interface but their loopback. The namespaces are deleted at
the end, whatever happened.

For each system (DDP, FSDP2 full shard, FSDP2 HSDP 2 x 2, parts full shard, parts full shard
with two-hop all-gathers (``ranks_per_node``), parts hybrid 2 x 2) on the 25M GPT of
bench_zero3.py (fp32, AdamW, the same batches): the median step
time, peak RSS, the final loss, the bytes that crossed the link (the veth's own counters in
node 0, each direction, for the whole run: setup and steps) and, for parts, the bytes its
ledger counted per group. Results go to ``benchmarks/results/bench_cluster.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from record import record  # noqa: E402

NODES = ("parts-node0", "parts-node1")
VETH = ("parts-veth0", "parts-veth1")
ADDRS = ("198.18.0.1", "198.18.0.2")
SYSTEMS = ("ddp", "fsdp2", "fsdp2_hsdp", "parts", "parts_topo", "parts_hybrid")


def _sh(*cmd: str, ns: str = "") -> str:
    """Run ``cmd`` (inside namespace ``ns`` if given); its stdout; raise naming it on failure."""
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    done = subprocess.run(full, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(full)} failed: {done.stderr.strip()}")
    return done.stdout


def can_run() -> str:
    """Why this machine cannot run the cluster ('' if it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, a veth pair and tc qdiscs): run it as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2: apt-get install iproute2)"
    return ""


def build(rate: str, delay: str) -> None:
    """The two namespaces, the veth pair between them, addresses and the rate limit."""
    teardown()
    for ns in NODES:
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, dev, addr in zip(NODES, VETH, ADDRS):
        _sh("ip", "link", "set", dev, "netns", ns)
        _sh("ip", "addr", "add", f"{addr}/24", "dev", dev, ns=ns)
        _sh("ip", "link", "set", dev, "up", ns=ns)
        _sh("ip", "link", "set", "lo", "up", ns=ns)
        if delay:
            _sh("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay, ns=ns)
            _sh("tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", "tbf", "rate", rate,
                "burst", "256kb", "latency", "100ms", ns=ns)
        else:
            _sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                "latency", "100ms", ns=ns)


def teardown() -> None:
    """Delete the namespaces (their veth ends go with them); quiet if they are not there."""
    for ns in NODES:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def link_bytes() -> tuple[int, int]:
    """Bytes node 0's veth end sent and received so far."""
    stats = f"/sys/class/net/{VETH[0]}/statistics"
    return tuple(int(_sh("cat", f"{stats}/{kind}_bytes", ns=NODES[0])) for kind in ("tx", "rx"))


def run_system(system: str, args: argparse.Namespace, port: int, out: Path) -> dict:
    """One system on both nodes; its rank-0 row plus the bytes over the link."""
    before = link_bytes()
    procs = []
    for rank, (ns, dev) in enumerate(zip(NODES, VETH)):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=dev, OMP_NUM_THREADS="1")
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(rank), "--nproc-per-node", "2", "--master-addr", ADDRS[0],
               "--master-port", str(port), str(HERE / "worker.py"), "--system", system,
               "--steps", str(args.steps), "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{system} failed:\n" + "\n".join(log[-3000:] for log in logs))
    after = link_bytes()
    row = json.loads(out.read_text())
    row.update(link_tx=after[0] - before[0], link_rx=after[1] - before[1])
    return row


def _print(results: dict, args: argparse.Namespace) -> None:
    print(f"\n25M GPT, fp32, 2 nodes x 2 ranks, link {args.rate}{' +' + args.delay if args.delay else ''}, "
          f"{args.steps} steps (bytes: the whole run, setup included)")
    print(f"{'system':<14} {'step (s)':>9} {'loss':>9} {'link tx GB':>11} {'link rx GB':>11} {'peak RSS MiB':>13}")
    for name, r in results.items():
        print(f"{name:<14} {r['step']:>9.2f} {r['loss']:>9.4f} {r['link_tx'] / 1e9:>11.3f} "
              f"{r['link_rx'] / 1e9:>11.3f} {r['peak_rss'] / 2**20:>13.0f}")


def main() -> None:
    """Build the cluster, run every system, record, tear down."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate of each direction")
    ap.add_argument("--delay", default="", help="netem delay on each end (e.g. 1ms); none by default")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per system")
    args = ap.parse_args()
    why = can_run()
    if why:
        print(f"benchmarks/cluster/cluster.py {why}", file=sys.stderr)
        raise SystemExit(2)
    results = {}
    try:
        build(args.rate, args.delay)
        with tempfile.TemporaryDirectory() as tmp:
            for k, system in enumerate(args.systems.split(",")):
                results[system] = run_system(system, args, 29500 + k, Path(tmp) / f"{system}.json")
                print(f"{system}: {results[system]['step']:.2f} s/step", flush=True)
    finally:
        teardown()
    _print(results, args)
    rows = [{"system": name, "step_s": round(r["step"], 2), "final_loss": round(r["loss"], 4),
             "link_tx_GB": round(r["link_tx"] / 1e9, 3), "link_rx_GB": round(r["link_rx"] / 1e9, 3),
             "peak_rss_MiB": round(r["peak_rss"] / 2**20)} for name, r in results.items()]
    record("bench_cluster", {"rows": rows, "summary": {"rate": args.rate, "delay": args.delay or "none",
                                                      "steps": args.steps},
                             "ledgers": {name: r["ledger"] for name, r in results.items()}})


if __name__ == "__main__":
    main()
