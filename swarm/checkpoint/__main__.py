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

from swarm.checkpoint.manifest import ManifestRejected, SignedManifest, verify_lineage, verify_manifest
from swarm.checkpoint.store import CheckpointStore, ShardRejected


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m swarm.checkpoint", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("list", "sealed checkpoints in the store, oldest first"),
                            ("show", "one manifest as JSON"),
                            ("verify", "digests, signatures, quorum and lineage"),
                            ("export", "write the model parameters as one safetensors file")):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--dir", required=True, type=Path, help="checkpoint store folder")
        if name != "list":
            cmd.add_argument("--manifest", default=None, help="manifest digest (default: the newest)")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if not args.dir.is_dir():
        console.print(f"[bold red]error:[/] {args.dir} is not a checkpoint folder")
        return 2
    store = CheckpointStore(args.dir)
    digests = store.list_manifests()
    if args.command == "list":
        table = Table(title=f"sealed checkpoints in {args.dir}")
        for column in ("digest", "run", "step", "participants", "signatures", "shards"):
            table.add_column(column)
        for digest in digests:
            signed = _load(store, digest)
            m = signed.manifest
            table.add_row(digest[:16], m.run_id, str(m.step), str(len(m.participants)), str(len(signed.signatures)),
                          str(len(m.shards)))
        console.print(table)
        return 0
    if not digests:
        console.print(f"[bold red]error:[/] no manifest in {args.dir}")
        return 1
    chosen = args.manifest or digests[-1]
    matches = [d for d in digests if d.startswith(chosen)]
    if len(matches) != 1:
        console.print(f"[bold red]error:[/] manifest {chosen!r} not found (or ambiguous)")
        return 2
    signed = _load(store, matches[0])
    if args.command == "show":
        print(json.dumps({"digest": matches[0], "manifest": signed.manifest.to_dict(),
                          "signatures": signed.signatures}, indent=2))
        return 0
    try:
        manifest = verify_manifest(signed, run_id=signed.manifest.run_id)
        linked = _walk_lineage(store, manifest, set(digests))
        state = store.load_state_dict(manifest)  # re-hashes every shard and checks names, dtypes, shapes
    except (ManifestRejected, ShardRejected, ValueError, FileNotFoundError) as e:
        console.print(f"[bold red]verification failed:[/] {e}")
        return 1
    if args.command == "verify":
        console.print(f"[green]ok[/]: {matches[0][:16]} run {manifest.run_id!r} step {manifest.step}, "
                      f"{len(signed.signatures)} valid signature(s) of {len(manifest.participants)} participant(s), "
                      f"{len(manifest.shards)} shard(s) re-hashed, lineage of {len(linked)} manifest(s) intact")
        return 0
    params = {name.split("/", 1)[1]: tensor for name, tensor in state.items() if name.startswith("param/")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(params, str(args.out))
    console.print(f"wrote {len(params)} tensors of step {manifest.step} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
