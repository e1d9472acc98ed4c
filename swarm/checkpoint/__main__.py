"""`python -m swarm.checkpoint list|show|verify|export --dir DIR`: inspect a peer's sealed checkpoints.

DIR is a checkpoint store, e.g. ``~/.swarm/checkpoints/RUN/PEER_ID`` (``--checkpoint-dir`` of swarm.peer
holds one per run and peer). ``verify`` re-hashes every shard, checks the signatures, the quorum and
the lineage back to the oldest manifest kept, and exits 1 with the reason when anything fails.
``export --out model.safetensors`` writes the model parameters for use outside the swarm.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

from bootstrap.cli import command_parser
from bootstrap.dhtcalls import latest_within
from swarm.checkpoint.manifest import ManifestRejected, SignedManifest, default_quorum, verify_lineage, verify_manifest
from swarm.checkpoint.store import CheckpointStore, ShardRejected

_COMMANDS = {
    "list": "sealed checkpoints in the store, oldest first",
    "show": "one manifest as JSON",
    "verify": "digests, signatures, quorum and lineage",
    "export": "write the model parameters as one safetensors file",
}
"""The subcommands and their help."""


def build_parser() -> argparse.ArgumentParser:
    parser, commands = command_parser("python -m swarm.checkpoint", __doc__, _COMMANDS)
    for name, cmd in commands.items():
        if name == "verify":
            where = cmd.add_mutually_exclusive_group(required=True)
            where.add_argument("--dir", type=Path, help="checkpoint store folder")
            where.add_argument(
                "--initial-peers",
                nargs="+",
                metavar="MADDR",
                help="verify the newest sealed manifest of --run announced in the swarm instead",
            )
            cmd.add_argument("--run", default=None, help="run name (with --initial-peers)")
        else:
            cmd.add_argument("--dir", required=True, type=Path, help="checkpoint store folder")
        if name != "list":
            cmd.add_argument(
                "--manifest",
                default=None,
                help="manifest digest (default: the newest one whose shards are all in the store)",
            )
        if name == "export":
            cmd.add_argument("--out", required=True, type=Path, help="output .safetensors file")
    return parser


def _load(store: CheckpointStore, digest: str) -> SignedManifest:
    return SignedManifest.from_bytes(store.get_manifest(digest))


def _walk_lineage(store: CheckpointStore, manifest, kept: set[str]) -> list:
    """Follow parent digests back through the manifests kept here (older ones may be pruned)."""
    chain = [manifest]
    while chain[0].parent and chain[0].parent in kept:
        parent = verify_manifest(_load(store, chain[0].parent), run_id=manifest.run_id)
        chain.insert(0, parent)
    verify_lineage(chain, root_parent=chain[0].parent)
    return chain


def verify_in_swarm(initial_peers: list[str], run: str, console: Console) -> int:
    """Verify the newest sealed manifest announced in the run's DHT index: signatures, quorum of
    signers holding live records in the run. Exit 0, or 1 with the reason."""
    from bootstrap import parse_initial_peers, stop_dht
    from bootstrap.identity import Identity
    from bootstrap.network import start_swarm_dht
    from peers.graph import ResourceGraph
    from swarm.checkpoint.gossip import index_key

    dht = start_swarm_dht(
        Identity.generate(),
        initial_peers=parse_initial_peers(initial_peers),
        client_mode=True,
        host_maddrs=("/ip4/127.0.0.1/tcp/0",),
    )
    try:
        known = {r.peer_id for r in ResourceGraph(dht).records(run=run)}
        try:
            found = latest_within(dht, index_key(run), timeout_s=30)
        except Exception as e:  # timed out, or the DHT process died: reported as "no valid manifest"
            found, reasons_of_read = None, [f"reading the run's index failed: {e!r}"]
        else:
            reasons_of_read = []
        entries = found.value.values() if found is not None and isinstance(found.value, dict) else []
        best, reasons = None, reasons_of_read
        for item in entries:
            value = getattr(item, "value", None)
            data = value.get("manifest") if isinstance(value, dict) else None
            try:
                manifest = verify_manifest(data if isinstance(data, bytes) else b"", run_id=run)
                signers = SignedManifest.from_bytes(data).signatures
                live = sum(1 for peer in signers if peer in known)
                if live < default_quorum(len(manifest.participants)):
                    raise ValueError(f"only {live} signer(s) hold live records in the run")
            except (ManifestRejected, ValueError) as e:
                reasons.append(str(e))
                continue
            if best is None or manifest.step > best.step:
                best = manifest
    finally:
        stop_dht(dht)
    if best is None:
        console.print(
            f"[bold red]verification failed:[/] no valid sealed manifest of run {run!r} in the swarm"
            + (f" ({'; '.join(reasons[:3])})" if reasons else "")
        )
        return 1
    console.print(
        f"[green]ok[/]: newest sealed manifest of run {run!r}: {best.digest()[:16]} at step {best.step}, "
        f"{len(best.participants)} participant(s), {len(best.shards)} shard(s)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if args.command == "verify" and args.initial_peers:
        if not args.run:
            console.print("[bold red]error:[/] --initial-peers needs --run NAME")
            return 2
        return verify_in_swarm(args.initial_peers, args.run, console)
    if not args.dir.is_dir():
        console.print(f"[bold red]error:[/] {args.dir} is not a checkpoint folder")
        return 2
    store = CheckpointStore(args.dir)
    digests = store.list_manifests()
    if args.command == "list" and not digests:
        console.print(
            f"[bold red]error:[/] no sealed checkpoint in {args.dir} (a store holds manifests/ and shards/; "
            f"swarm.peer keeps one per run under its --checkpoint-dir)",
            highlight=False,
        )
        return 1
    if args.command == "list":
        table = Table(title=f"sealed checkpoints in {args.dir}")
        for column in ("digest", "run", "step", "participants", "signatures", "shards"):
            table.add_column(column)
        for digest in digests:
            signed = _load(store, digest)
            m = signed.manifest
            table.add_row(
                digest[:16],
                m.run_id,
                str(m.step),
                str(len(m.participants)),
                str(len(signed.signatures)),
                str(len(m.shards)),
            )
        console.print(table)
        return 0
    if not digests:
        console.print(f"[bold red]error:[/] no manifest in {args.dir}")
        return 1
    # a store also keeps manifests learned by gossip whose shards it never fetched: by default take the
    # newest one it holds whole
    held = [d for d in digests if not store.missing_shards(_load(store, d).manifest)]
    chosen = args.manifest or (held or digests)[-1]
    matches = [d for d in digests if d.startswith(chosen)]
    if len(matches) != 1:
        console.print(f"[bold red]error:[/] manifest {chosen!r} not found (or ambiguous)")
        return 2
    signed = _load(store, matches[0])
    if args.command == "show":
        print(
            json.dumps(
                {"digest": matches[0], "manifest": signed.manifest.to_dict(), "signatures": signed.signatures}, indent=2
            )
        )
        return 0
    try:
        manifest = verify_manifest(signed, run_id=signed.manifest.run_id)
        linked = _walk_lineage(store, manifest, set(digests))
        state = store.load_state_dict(manifest)  # re-hashes every shard and checks names, dtypes, shapes
    except (ManifestRejected, ShardRejected, ValueError, FileNotFoundError) as e:
        console.print(f"[bold red]verification failed:[/] {e}")
        return 1
    if args.command == "verify":
        console.print(
            f"[green]ok[/]: {matches[0][:16]} run {manifest.run_id!r} step {manifest.step}, "
            f"{len(signed.signatures)} valid signature(s) of {len(manifest.participants)} participant(s), "
            f"{len(manifest.shards)} shard(s) re-hashed, lineage of {len(linked)} manifest(s) intact"
        )
        return 0
    params = {name.split("/", 1)[1]: tensor for name, tensor in state.items() if name.startswith("param/")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(params, str(args.out))
    console.print(f"wrote {len(params)} tensors of step {manifest.step} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
