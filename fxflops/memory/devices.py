"""How much memory a device has: datasheet capacities for the GPUs and TPUs of the peaks table.

Capacities are the vendors' datasheet figures, read as GiB (HBM and GDDR come in binary sizes). What a
program can allocate is a little less (nvidia-smi shows 81,559 MiB on an H100 80GB; ECC and the driver
keep the rest): the allowance's context bytes are where to account for it. Parts sold with several
memory sizes under one name (V100) have none here: give the size.
"""

from __future__ import annotations

GiB = 1 << 30

CAPACITY_GIB = {
    "V100S PCIe": 32, "A100 80GB PCIe": 80, "A100 80GB SXM": 80, "A100 40GB": 40, "A10": 24,
    "H100 NVL": 94, "H100 PCIe": 80, "H100 SXM": 80, "H200 NVL": 141, "H200 SXM": 141,
    "L40S": 48, "L4": 24, "T4": 16, "RTX 4090": 24, "RTX 3090": 24,
    "MI250X": 128, "MI300X": 192, "MI325X": 256, "MI355X": 288,
    "TPU v4": 32, "TPU v5e": 16, "TPU v5p": 95, "TPU v6e Trillium": 32,
}


def device_capacity(name: str) -> tuple[str, int]:
    """(label, bytes) of the device `name` names (as --device takes it); one-line ValueError otherwise."""
    from fxflops.device.peaks import named

    label = named(name).label
    gib = CAPACITY_GIB.get(label)
    if gib is None:
        raise ValueError(f"device {label!r} has no memory size in fxflops' table (it is sold with several): "
                         f"give the size, e.g. MemoryOptions(device_bytes=32 * 2**30)")
    return label, gib * GiB
