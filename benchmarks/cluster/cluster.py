"""An emulated two-node cluster on one machine: DDP, FSDP2 and parts over a rate-limited link.

    sudo python benchmarks/cluster/cluster.py                  # 1 Gbit/s, 5 steps per system
    sudo python benchmarks/cluster/cluster.py --rate 10gbit --steps 7

Needs root (it creates network namespaces, a veth pair and tc qdiscs); without root, or without
``ip``/``tc``, it says so and exits 2. Two namespaces (``parts-node0``, ``parts-node1``) are
joined by one veth pair whose ends carry 198.18.0.1 and 198.18.0.2 (the benchmarking range,
198.18.0.0/24) and egress a ``tc tbf`` limited to ``--rate`` (optional ``--delay``: netem;
``--rate none``: no limit, the step's floor). Each namespace runs one torchrun launcher with 2
ranks (``--nnodes 2``, static rendezvous at 198.18.0.1: torchrun's c10d rendezvous cannot tell
which namespace hosts its store), gloo bound to the veth (``GLOO_SOCKET_IFNAME``). No traffic
goes anywhere else: the namespaces have no other interface but their loopback. The namespaces
are deleted at the end, whatever happened.

For each system (DDP, FSDP2 full shard, FSDP2 HSDP 2 x 2, parts full shard, parts full shard
with two-hop collectives (``ranks_per_node``), each of those two with node-local backward
gathers (``attach(secondary_group=node)``, ZeRO++ hpZ), parts hybrid 2 x 2 at ``attach``'s
defaults (``parts_hybrid``), with the mean at the optimizer step (``_step``), with bench_zero3's
``persistence_threshold=0`` (``_p0``) and with node-local gathers on top (``_hpz``), and FSDP2 HSDP
and parts hybrid keeping params gathered from forward to backward: ``_keep``) on the 25M GPT of
bench_zero3.py (fp32, AdamW, the same batches): the median step
time and its phases, CPU seconds per step and rank, peak RSS, the final loss, the bytes that
crossed the link (the veth's own counters in node 0, each direction: per step over the steps
after the first, and for the whole run, setup included), for parts the bytes its ledger counted
per group, and how busy other processes kept the machine meanwhile (their CPU seconds per
second: the machine has few cores and may be shared). ``--rounds N`` runs the systems N times
interleaved and keeps each one's median-step run. Results go to
``benchmarks/results/bench_cluster.jsonl`` (1 Gbit/s, no delay; another link to
``bench_cluster_<rate><delay>.jsonl``, e.g. ``bench_cluster_10gbit.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from record import record  # noqa: E402

NODES = ("parts-node0", "parts-node1")
VETH = ("parts-veth0", "parts-veth1")
ADDRS = ("198.18.0.1", "198.18.0.2")
SYSTEMS = ("ddp", "fsdp2", "fsdp2_hsdp", "fsdp2_hsdp_keep", "parts", "parts_topo", "parts_hpz", "parts_topo_hpz",
           "parts_hybrid", "parts_hybrid_keep", "parts_hybrid_hpz")


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
        if rate == "none":  # no limit: the link is as fast as the veth copies (the compute floor)
            continue
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


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy (not idle nor waiting on IO) since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) of the processes this one started and waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_system(system: str, args: argparse.Namespace, port: int, out: Path) -> dict:
    """One system on both nodes; its rank-0 row plus the bytes over the link and how busy the
    machine was with other processes meanwhile (their CPU seconds per second of the run)."""
    before, busy, ours, started = link_bytes(), busy_cpu_seconds(), children_cpu_seconds(), time.monotonic()
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
    others = (busy_cpu_seconds() - busy) - (children_cpu_seconds() - ours)
    row = json.loads(out.read_text())
    row.update(link_tx=after[0] - before[0], link_rx=after[1] - before[1],
               others_cores=max(others, 0.0) / (time.monotonic() - started))
    return row


def _median_run(rows: list[dict]) -> dict:
    """The run of median step time (the lower middle one of an even count), with every run's step."""
    ordered = sorted(rows, key=lambda r: r["step"])
    return dict(ordered[(len(ordered) - 1) // 2], steps=[r["step"] for r in rows])


def _print(results: dict, args: argparse.Namespace) -> None:
    print(f"\n25M GPT, fp32, 2 nodes x 2 ranks, link {args.rate}{' +' + args.delay if args.delay else ''}, "
          f"{args.steps} steps; link MB per step after the first, GB for the whole run (setup included); "
          "others: CPU seconds per second other processes used")
    print(f"{'system':<17} {'step s':>6} {'fwd':>5} {'bwd':>5} {'opt':>5} {'CPU s':>5} {'loss':>7} "
          f"{'MB tx':>6} {'MB rx':>6} {'GB tx':>6} {'GB rx':>6} {'RSS MiB':>7} {'others':>6}")
    for name, r in results.items():
        ph, per_step = r["phases"], r["link_per_step"]
        print(f"{name:<17} {r['step']:>6.2f} {ph['forward']:>5.2f} {ph['backward']:>5.2f} {ph['optimizer']:>5.2f} "
              f"{r['cpu_per_step']:>5.2f} {r['loss']:>7.4f} {per_step[0] / 1e6:>6.1f} {per_step[1] / 1e6:>6.1f} "
              f"{r['link_tx'] / 1e9:>6.3f} {r['link_rx'] / 1e9:>6.3f} {r['peak_rss'] / 2**20:>7.0f} "
              f"{r['others_cores']:>6.2f}")


def main() -> None:
    """Build the cluster, run every system, record, tear down."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate of each direction ('none': no limit)")
    ap.add_argument("--delay", default="", help="netem delay on each end (e.g. 1ms); none by default")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--record-as", default="", help="a suffix of the results file: a run of some systems apart")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the systems this many times, interleaved; each system's median-step run is kept")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per system")
    ap.add_argument("--no-record", action="store_true", help="print the table only (nothing appended)")
    args = ap.parse_args()
    why = can_run()
    if why:
        print(f"benchmarks/cluster/cluster.py {why}", file=sys.stderr)
        raise SystemExit(2)
    runs: dict[str, list[dict]] = {}
    try:
        build(args.rate, args.delay)
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(args.rounds):
                for k, system in enumerate(args.systems.split(",")):
                    row = run_system(system, args, 29500 + k, Path(tmp) / f"{system}.json")
                    runs.setdefault(system, []).append(row)
                    print(f"round {round_ + 1}: {system}: {row['step']:.2f} s/step", flush=True)
    finally:
        teardown()
    results = {name: _median_run(rows) for name, rows in runs.items()}
    _print(results, args)
    rows = [{"system": name, "step_s": round(r["step"], 2), "rounds_step_s": [round(x, 2) for x in r["steps"]],
             **{f"{k}_s": round(v, 2) for k, v in r["phases"].items()},
             "cpu_per_rank_s": round(r["cpu_per_step"], 2), "final_loss": round(r["loss"], 4),
             "step_link_tx_MB": round(r["link_per_step"][0] / 1e6, 1),
             "step_link_rx_MB": round(r["link_per_step"][1] / 1e6, 1),
             "link_tx_GB": round(r["link_tx"] / 1e9, 3), "link_rx_GB": round(r["link_rx"] / 1e9, 3),
             "peak_rss_MiB": round(r["peak_rss"] / 2**20), "others_cores": round(r["others_cores"], 2)}
            for name, r in results.items()]
    if args.no_record:
        return
    bench = "bench_cluster" if (args.rate, args.delay) == ("1gbit", "") else f"bench_cluster_{args.rate}{args.delay}"
    bench += f"_{args.record_as}" if args.record_as else ""
    record(bench, {"rows": rows, "summary": {"rate": args.rate, "delay": args.delay or "none", "steps": args.steps,
                                            "rounds": args.rounds},
                   "ledgers": {name: r["ledger"] for name, r in results.items()}})


if __name__ == "__main__":
    main()
