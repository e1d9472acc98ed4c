"""Join a Swarm run from your own training loop.

    python examples/train_charlm.py --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/Qm... --run demo

It trains the built-in charlm model on its own shard and averages with every other peer of the run,
including peers started with `python -m swarm.peer --run demo --task charlm`.
"""

import argparse

import torch

import swarm
from swarm.recipe import autocast_dtype
from swarm.tasks import get_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--run", default="demo")
    parser.add_argument("--task-preset", default="tiny", help="must match the run's peers")
    parser.add_argument("--shard-index", type=int, default=0)
    parser.add_argument("--num-shards", type=int, default=16)
    parser.add_argument("--sync-every", type=int, default=15)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--host-maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/0"])
    parser.add_argument("--identity-key", default=None, help="this peer's key file: the same peer after a restart")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    task = get_task("charlm", preset=args.task_preset)
    model = task.build_model(seed=0).to(device)  # every peer of a run starts from the same seed
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # bf16 where the GPU computes it natively, fp16 with a loss scaler on a V100 or a T4, fp32 on a CPU
    dtype = autocast_dtype("auto", device)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    # task_info tells the run which model this is, so peers building another model are refused
    trainer = swarm.Trainer(
        model,
        optimizer if scaler is None else swarm.ScaledStep(optimizer, scaler),  # steps through the scaler
        run=args.run,
        initial_peers=args.initial_peers,
        sync_every=args.sync_every,
        host_maddrs=args.host_maddrs,
        identity_key=args.identity_key,
        task_info=swarm.TaskInfo.of(task, args.task_preset),
    )
    try:
        batches = task.train_batches(shard_index=args.shard_index, num_shards=args.num_shards)
        for _ in range(args.max_steps):
            x, y = (t.to(device) for t in next(batches))
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = task.loss(model, (x, y))
            (loss if scaler is None else scaler.scale(loss)).backward()
            result = trainer.step(num_samples=len(x), loss=loss.item())  # a round every sync_every steps
            if result is not None:
                print(
                    f"round {result.round}: group of {result.group_size}, "
                    f"val loss {task.evaluate(model, max_batches=4):.3f}",
                    flush=True,
                )
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    main()
