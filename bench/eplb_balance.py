"""EPLB balance benchmark: balancedness, run time and expert moves on synthetic skewed loads.

Loads per layer: a Zipf-like popularity over a random expert order times log-normal
noise (seeded), scaled to ``--tokens`` token-expert assignments.  Reports, per scenario,
the mean/min balancedness over layers (mean/max of per-rank load, 1.0 = perfect), the
policy's run time and, where a previous placement exists, how many expert weights move
with and without ``old_phy2log``.

    python bench/eplb_balance.py                # 8 layers, 256 experts, 288 slots, 32 ranks
    python bench/eplb_balance.py --layers 61 --threads 1
"""

import argparse
import time

import torch

from moe_comm.eplb.policy import balancedness, count_moved_experts, rebalance_experts


def make_loads(layers, experts, zipf, sigma, tokens, gen):
    """``[layers, experts]`` float64 token counts, skewed and different in every layer."""
    base = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** zipf
    rows = []
    for _ in range(layers):
        pop = base[torch.randperm(experts, generator=gen)]
        pop = pop * torch.exp(sigma * torch.randn(experts, generator=gen, dtype=torch.float64))
        rows.append(tokens * pop / pop.sum())
    return torch.stack(rows)


def drift(w, amount, gen):
    """The same loads a little later: every expert's load scaled by exp(amount * N(0, 1))."""
    return w * torch.exp(amount * torch.randn(w.shape, generator=gen, dtype=w.dtype))


def timed(fn, repeat):
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--slots", type=int, default=288, help="physical expert slots per layer")
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=0.8, help="popularity exponent")
    ap.add_argument("--sigma", type=float, default=0.5, help="log-normal noise on popularity")
    ap.add_argument("--drift", type=float, default=0.1, help="load change between rebalances")
    ap.add_argument("--tokens", type=float, default=8 * 4096.0, help="token-expert pairs per layer")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs (best is reported)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(a.seed)
    L, P, R = a.experts, a.slots, a.ranks
    w = make_loads(a.layers, L, a.zipf, a.sigma, a.tokens, gen)
    print(f"{a.layers} layers x {L} experts -> {P} slots on {R} ranks, {a.nodes} nodes, "
          f"{a.groups} groups, {a.threads} thread(s)")
    print(f"{'scenario':<34}{'bal mean':>9}{'bal min':>9}{'ms':>8}{'moved':>8}"
          f"{'moved w/o old':>15}")

    def report(name, p2l, secs=None, active=None, old=None, fresh=None):
        bal = balancedness(w_now, p2l, R, active)
        ms = f"{secs * 1e3:8.1f}" if secs is not None else f"{'':>8}"
        moved = f"{int(count_moved_experts(old, p2l).sum()):8d}" if old is not None else f"{'':>8}"
        base = f"{int(count_moved_experts(old, fresh).sum()):15d}" if fresh is not None else ""
        print(f"{name:<34}{bal.mean():9.4f}{bal.min():9.4f}{ms}{moved}{base}")

    w_now = w
    # Baseline: no replication, expert e on rank e * R // L, the first L slots' worth.
    no_rep = torch.full((a.layers, P), -1, dtype=torch.int64)
    slot = (torch.arange(L) * R // L) * (P // R) + torch.arange(L) % max(1, L // R)
    no_rep[:, slot] = torch.arange(L)
    report("no replication (contiguous)", no_rep)

    def run(weights, **kw):
        return timed(lambda: rebalance_experts(weights, P, a.groups, a.nodes, R, **kw)[0], a.repeat)

    placed, secs = run(w)
    report("rebalanced", placed, secs)
    p_global, secs = timed(lambda: rebalance_experts(w, P, 1, 1, R)[0], a.repeat)
    report("rebalanced, global policy", p_global, secs)

    w_now = drift(w, a.drift, gen)
    fresh, _ = run(w_now)
    sticky, secs = run(w_now, old_phy2log=placed)
    report(f"loads drift {a.drift:g}, old_phy2log", sticky, secs, None, placed, fresh)

    w_now = w
    for failed in ([5], [3, 12, 21, 30], list(range(R - R // a.nodes, R))):
        if max(failed) >= R:
            continue
        active = torch.ones(R, dtype=torch.int64)
        active[failed] = 0
        label = "fail last node" if len(failed) > 4 else f"fail {len(failed)} rank(s)"
        try:
            fresh, _ = run(w, active_ranks=active)
            kept, secs = run(w, active_ranks=active, old_phy2log=placed)
        except ValueError as err:  # too few healthy slots: say how many slots would do
            need = -(-L // (R - len(failed))) * R
            print(f"{label}: {err} (needs --slots >= {need})")
            continue
        report(f"{label}, old_phy2log", kept, secs, active, placed, fresh)


if __name__ == "__main__":
    main()
