"""What another router's load message costs a router: ``ClusterState.on_router_load`` per
message, for W workers and R other routers, each message carrying its router's counts on
every worker (as under load) with ~5% of them changed since its last one.

Beside it, in the same run, the reference way: every worker in the message refreshed by
summing every router's counts (what the state did before it kept running sums). Each router
reads ~200 such messages a second from every other router while they are busy
(``services/router/load_share.py``), so at 1,000 workers this is what sizes a namespace's
router count (docs/deploy.md, "Scaling out").

    python -m bench.load_share_cost
    python -m bench.load_share_cost --workers 1000 --routers 2,10,30 --runs 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from services.common.schemas import WorkerCapacity, WorkerHeartbeat
from services.core.cluster import ClusterState


class ReferenceState(ClusterState):
    """Every worker a message names, refreshed over every router's last counts."""

    def on_router_load(self, router_id, inflight, prefill, now) -> None:  # type: ignore[override]
        old = self._remote.get(router_id)
        self._remote[router_id] = (now, dict(inflight), dict(prefill))
        for wid in set(inflight) | (set(old[1]) if old else set()):
            self._refresh_load(wid)

    def _refresh_load(self, wid: str) -> None:
        s = self.states.get(wid)
        if s is None:
            return
        loc = self._local.get(wid)
        inflight = loc.inflight if loc else 0
        prefill = loc.prefill if loc else 0
        for _seen, rin, rpre in self._remote.values():
            inflight += rin.get(wid, 0)
            prefill += rpre.get(wid, 0)
        if s.inflight != inflight or s.pending_prefill_tokens != prefill:
            s.inflight = inflight
            s.pending_prefill_tokens = prefill
            self._notify(wid)


def messages(workers: int, routers: int, n: int, seed: int) -> list[tuple[str, dict, dict]]:
    rng = random.Random(seed)
    wids = [f"w{i:05d}" for i in range(workers)]
    counts = {
        r: ({w: rng.randint(1, 8) for w in wids}, {w: rng.randint(0, 4000) for w in wids})
        for r in range(routers)
    }
    out = []
    for i in range(n):
        r = i % routers
        inflight, prefill = counts[r]
        for w in rng.sample(wids, max(1, workers // 20)):
            inflight[w] = rng.randint(1, 8)
            prefill[w] = rng.randint(0, 4000)
        out.append((f"r{r}", dict(inflight), dict(prefill)))
    return out


def per_message_us(cls: type[ClusterState], workers: int, msgs: list, routers: int) -> float:
    cs = cls()
    cap = WorkerCapacity(block_size=16, num_gpu_blocks=27_000, max_num_seqs=256, max_model_len=8192)
    for i in range(workers):
        hb = WorkerHeartbeat(
            worker_id=f"w{i:05d}", instance_id="i", url="http://w", model="m", capacity=cap
        )
        cs.on_heartbeat(hb, 0.0)
    for rid, inflight, prefill in msgs[:routers]:  # every router heard once
        cs.on_router_load(rid, inflight, prefill, 0.0)
    t = time.perf_counter()
    for rid, inflight, prefill in msgs[routers:]:
        cs.on_router_load(rid, inflight, prefill, 0.0)
    return (time.perf_counter() - t) / (len(msgs) - routers) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.load_share_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--workers", default="100,1000", help="comma-separated worker counts")
    ap.add_argument("--routers", default="2,10", help="comma-separated counts of other routers")
    ap.add_argument("--messages", type=int, default=1000, help="messages per run")
    ap.add_argument("--runs", type=int, default=3, help="runs (seeds), interleaved")
    a = ap.parse_args(argv)
    print(
        f"{'workers':>8s} {'routers':>8s} {'kvgate µs/msg':>14s} {'reference':>10s} {'ratio':>6s}"
    )
    for w in (int(x) for x in a.workers.split(",")):
        for r in (int(x) for x in a.routers.split(",")):
            ours, ref = [], []
            for seed in range(a.runs):
                msgs = messages(w, r, a.messages + r, seed)
                ours.append(per_message_us(ClusterState, w, msgs, r))
                ref.append(per_message_us(ReferenceState, w, msgs, r))
            mo, mr = statistics.median(ours), statistics.median(ref)
            print(f"{w:8d} {r:8d} {mo:14.1f} {mr:10.1f} {mo / mr:5.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
