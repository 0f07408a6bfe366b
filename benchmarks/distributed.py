"""Sharded training side by side: bytes on the wire, peak memory and step time per rank.

Runs ``--world`` ranks (gloo on the CPU; NCCL with ``--device cuda``, one GPU per rank), each
training an HF LLaMA built from a small config (random weights, never downloaded) on the
same global batch, in these setups, one process group per setup:

- ``fsdp-fp32``: FSDP2 per decoder layer and the root, no policy, fp32 throughout;
- ``fsdp-bf16``: FSDP2's own ``MixedPrecisionPolicy(bf16, fp32)`` (torchtitan's);
- ``autocast``: FSDP2 without a policy, the forward under ``torch.autocast(bf16)``;
- ``ampgraph``: ``ampgraph.shard(model, mesh, "O2", "bf16")`` (bf16 gathers, fp32 reduce);
- ``ampgraph-fp32-gather``: the same with ``gather="fp32"`` (weights exact, twice the bytes).

Per step and rank it prints the bytes all-gathered and reduce-scattered by dtype
(:class:`ampgraph.parallel.CollectiveBytes`), the peak memory (CUDA: the allocator's peak;
CPU: the peak resident set of the rank's process, which includes torch itself, so compare
differences between setups) and the step time (median over ``--steps`` after one warm-up
step). Gloo on two cores is not a speed reference: on the CPU compare bytes, on GPUs time.

    python benchmarks/distributed.py                    # 2 gloo ranks
    python benchmarks/distributed.py --world 4 --json out.json
    python benchmarks/distributed.py --device cuda --world 1   # NCCL on one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

SETUPS = ("fsdp-fp32", "fsdp-bf16", "autocast", "ampgraph", "ampgraph-fp32-gather")


def make_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 128), vocab_size=args.vocab,
                         max_position_embeddings=args.seq)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def prepare(setup: str, model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import ampgraph

    if setup.startswith("ampgraph"):
        gather = "fp32" if setup.endswith("fp32-gather") else "low"
        return ampgraph.shard(model, mesh, "O2", "bf16", gather=gather)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if setup == "fsdp-bf16" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def rank_main(rank: int, args, setup: str, init_file: str, out_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from ampgraph.parallel import CollectiveBytes

    warnings.filterwarnings("ignore")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=args.world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (args.world,))
    model = prepare(setup, make_model(args).to(device), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.world * args.batch, args.seq), generator=g)
    ids = ids[rank * args.batch:(rank + 1) * args.batch].to(device)
    times, losses, traffic = [], [], None
    for i in range(args.steps + 1):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with CollectiveBytes() as counted, torch.autocast(device.type, torch.bfloat16,
                                                          enabled=setup == "autocast"):
            logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        with counted:
            loss.backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        if i:  # the first step captures and warms up
            times.append(time.perf_counter() - start)
            traffic = counted
        losses.append(loss.item())
    peak = (torch.cuda.max_memory_allocated(device) if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    result = {"setup": setup, "rank": rank, "step_ms": 1e3 * statistics.median(times),
              "peak_mib": peak / 2**20, "losses": losses,
              "all_gather": traffic.by_dtype("all_gather"),
              "reduce_scatter": traffic.by_dtype("reduce_scatter")}
    with open(out_file, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def spawn_rank(rank: int, args, setup: str, init_file: str, out_dir: str) -> None:
    rank_main(rank, args, setup, init_file, os.path.join(out_dir, f"{setup}-{rank}.json"))
    os._exit(0)  # gloo's threads may abort a finished process at interpreter exit


def run(args) -> list[dict]:
    import torch.multiprocessing as mp

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for setup in args.setups.split(","):
            init = os.path.join(tmp, f"init-{setup}")
            mp.spawn(spawn_rank, args=(args, setup, init, tmp), nprocs=args.world, join=True)
            for rank in range(args.world):
                with open(os.path.join(tmp, f"{setup}-{rank}.json")) as f:
                    rows.append(json.load(f))
    return rows


def mib(by_dtype: dict) -> str:
    return " + ".join(f"{n / 2**20:.2f} {d}" for d, n in by_dtype.items()) or "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = run(args)
    print(f"world {args.world} ({args.device}), LLaMA d={args.hidden} x{args.layers}, "
          f"{args.batch}x{args.seq} tokens per rank, per step and rank (rank 0 shown):")
    print(f"{'setup':<22} {'all-gather MiB':<22} {'reduce-scatter MiB':<22} "
          f"{'peak MiB':>9} {'step ms':>9}  losses")
    for r in rows:
        if r["rank"] == 0:
            losses = " ".join(f"{x:.4f}" for x in r["losses"][:3])
            print(f"{r['setup']:<22} {mib(r['all_gather']):<22} {mib(r['reduce_scatter']):<22} "
                  f"{r['peak_mib']:>9.0f} {r['step_ms']:>9.1f}  {losses}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
