"""The memory bandwidth a card's maker quotes, for a second roofline beside the measured copy.

The measured device copy (gpu_decode.copy_bandwidth) is what this machine reaches today; the
spec figure is what the card is sold at. A result against both says how far a step is from
each: a copy that itself runs well under spec (a throttled or shared card) shows up as the gap
between the two percentages, instead of flattering the measured one.
"""

from __future__ import annotations

# (substring of torch.cuda.get_device_name, bytes/s as quoted by NVIDIA), most specific first.
# "NVIDIA H100 80GB HBM3" is the SXM card's name; the PCIe and NVL cards have their own figures.
SPEC_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),  # H200 SXM and NVL: 141 GB HBM3e
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100 80GB HBM3", 3.35e12),  # H100 SXM
    ("H100 SXM", 3.35e12),
)


def spec_bandwidth(device_name: str | None) -> float | None:
    """Bytes/s the card is specified for, None for a card not in the table (or a CPU)."""
    if not device_name:
        return None
    return next((bw for key, bw in SPEC_BANDWIDTH if key in device_name), None)
