"""What this machine can do: accelerator, memory, CPU, software versions and reachability.

Everything here is read from the machine (torch.cuda, /proc/cpuinfo, psutil), not declared.
Throughput and bandwidth are measured elsewhere (the trainer's own steps; :mod:`peers.bandwidth`).
"""

from __future__ import annotations

import ipaddress
import os
import platform
from collections.abc import Sequence
from functools import cache

import psutil
import torch

from bootstrap.records import Hardware, Software


@cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()[:128]
    except OSError:
        pass
    return (platform.processor() or platform.machine() or "unknown")[:128]


def probe_hardware(device: torch.device | str = "cpu") -> Hardware:
    """The accelerator behind ``device`` (or the CPU), with memory measured now."""
    device = torch.device(device)
    memory = psutil.virtual_memory()
    cores = os.cpu_count() or 1
    common = dict(
        cpu_model=cpu_model(),
        cpu_cores=cores,
        ram_total_bytes=int(memory.total),
        ram_available_bytes=int(memory.available),
    )
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        major, _ = torch.cuda.get_device_capability(index)
        return Hardware(
            accelerator="cuda",
            name=torch.cuda.get_device_name(index)[:128],
            count=torch.cuda.device_count(),
            memory_total_bytes=int(total),
            memory_free_bytes=int(free),
            bf16=bool(torch.cuda.is_bf16_supported(including_emulation=False)),  # natively (emulated: slower than fp32)
            fp16=major >= 6,
            **common,
        )
    return Hardware(
        accelerator="cpu",
        name=cpu_model(),
        count=1,
        memory_total_bytes=int(memory.total),
        memory_free_bytes=int(memory.available),
        bf16=True,
        fp16=False,
        **common,
    )


@cache
def probe_software() -> Software:
    import hivemind

    from bootstrap.version import SWARM_VERSION

    return Software(
        python=platform.python_version(),
        torch=torch.__version__.split("+")[0],
        cuda=torch.version.cuda or "none",
        hivemind=hivemind.__version__,
        swarm=SWARM_VERSION,
    )


def reachability(maddrs: Sequence[str], *, client_mode: bool = False) -> str:
    """public, private, relayed or client-only, from the addresses a peer listens on or announces.

    A peer is public when it has a global IP address (NAT traversal or port forwarding then make it
    dialable), relayed when it is reachable only through a /p2p-circuit relay address.
    """
    if client_mode:
        return "client-only"
    if maddrs and all("/p2p-circuit" in m for m in maddrs):
        return "relayed"
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            try:
                address = ipaddress.ip_address(parts[2])
            except ValueError:
                continue
            if address.is_global:
                return "public"
        elif len(parts) > 2 and parts[1] in ("dns", "dns4", "dns6"):
            return "public"
    return "private"
