"""A DeepEP client, written as DeepEP's own tests are (tests/test_intranode.py there): it
imports ``deep_ep`` and knows nothing of moe_comm. tests/test_deep_ep_alias.py runs it
unchanged with moe_comm's alias on PYTHONPATH, on CPU tensors and a gloo group.

    python intranode.py --num-processes 2

Every rank draws its tokens and routing from a seed of its rank, so each can rebuild what the
others send and check what it receives; it prints ``rank R: passed`` at the end.
"""
import argparse
import os

import torch
import torch.distributed as dist

import deep_ep


def init_dist(local_rank: int, num_local_ranks: int):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                            world_size=num_local_ranks, rank=local_rank)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks)))


def make_inputs(rank: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int):
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(-8, 8, (num_tokens, hidden), generator=gen).to(torch.bfloat16)
    x[:, 0] = rank                                 # where a received row came from
    x[:, 1] = torch.arange(num_tokens)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    topk_idx = torch.topk(scores, num_topk, dim=-1, sorted=False).indices.to(deep_ep.topk_idx_t)
    topk_idx[torch.rand(num_tokens, num_topk, generator=gen) < 0.1] = -1   # unused slots
    topk_weights = torch.rand(num_tokens, num_topk, generator=gen)
    return x, topk_idx, topk_weights


def test_main(args, rank: int, num_ranks: int, buffer: deep_ep.Buffer):
    num_tokens, hidden, num_experts, num_topk = args.num_tokens, args.hidden, 8 * num_ranks, 4
    experts_per_rank = num_experts // num_ranks
    x, topk_idx, topk_weights = make_inputs(rank, num_tokens, hidden, num_experts, num_topk)

    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    rank_of_slot = torch.where(topk_idx >= 0, topk_idx // experts_per_rank, -1)
    ref_in_rank = torch.stack([(rank_of_slot == r).any(1) for r in range(num_ranks)], 1)
    assert torch.equal(is_token_in_rank, ref_in_rank)
    assert torch.equal(num_tokens_per_rank, ref_in_rank.sum(0).to(num_tokens_per_rank.dtype))

    config = deep_ep.Buffer.get_dispatch_config(num_ranks)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \
        buffer.dispatch(x=x, num_tokens_per_rank=num_tokens_per_rank,
                        is_token_in_rank=is_token_in_rank,
                        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                        topk_weights=topk_weights, config=config, async_finish=True)
    event.current_stream_wait()

    # what every source rank sent here, rebuilt from its seed
    expected, per_expert = {}, torch.zeros(experts_per_rank, dtype=torch.long)
    lo = rank * experts_per_rank
    for src in range(num_ranks):
        sx, sidx, sw = make_inputs(src, num_tokens, hidden, num_experts, num_topk)
        mine = (sidx >= lo) & (sidx < lo + experts_per_rank)
        for t in torch.nonzero(mine.any(1)).flatten().tolist():
            expected[(src, t)] = (sx[t], torch.where(mine[t], sidx[t] - lo, -1), sw[t], mine[t])
            per_expert += torch.bincount(sidx[t][mine[t]] - lo, minlength=experts_per_rank)
    assert recv_x.size(0) == len(expected), (recv_x.size(0), len(expected))
    assert num_recv_tokens_per_expert_list == per_expert.tolist()
    seen = set()
    for i in range(recv_x.size(0)):
        key = (int(recv_x[i, 0]), int(recv_x[i, 1]))
        row, local_idx, weights, valid = expected[key]
        seen.add(key)
        assert torch.equal(recv_x[i], row)
        assert torch.equal(recv_topk_idx[i], local_idx.to(recv_topk_idx.dtype))
        assert torch.equal(recv_topk_weights[i][valid], weights[valid])
    assert seen == set(expected)

    # identity experts: combine sums, per token, one copy from every rank it went to
    combined_x, _, event = buffer.combine(x=recv_x, handle=handle, config=config,
                                          async_finish=True)
    event.current_stream_wait()
    copies = is_token_in_rank.sum(1, keepdim=True).float()
    assert torch.equal(combined_x.float(), x.float() * copies)

    # the cached handle repeats the layout without topk and without a count exchange
    recv_x2, _, _, _, _, _ = buffer.dispatch(x=x, handle=handle, config=config)
    assert torch.equal(recv_x2, recv_x)


def test_loop(local_rank: int, num_local_ranks: int, args):
    rank, num_ranks, group = init_dist(local_rank, num_local_ranks)
    buffer = deep_ep.Buffer(group, int(256e6), 0, low_latency_mode=False,
                            explicitly_destroy=True)
    test_main(args, rank, num_ranks, buffer)
    print(f"rank {rank}: passed ({type(buffer).__module__}.{type(buffer).__name__})",
          flush=True)
    buffer.destroy()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Test intranode EP kernels")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--num-tokens", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.multiprocessing.spawn(test_loop, args=(args.num_processes, args),
                                nprocs=args.num_processes)
