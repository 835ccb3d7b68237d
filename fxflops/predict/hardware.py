"""The hardware a prediction runs on: a `DeviceModel` (one GPU) and a `Cluster` (GPUs, nodes, links).

Both are data: TOML files under `fxflops/predict/data/devices/` and `.../clusters/`, one per preset,
every constant with the published source it was read from (datasheets, vendor GEMM benchmarks,
NCCL-tests bus bandwidths, the FlashAttention papers' kernel measurements; never end-to-end training
times, which are what predictions are checked against). A device's peak FLOP/s and HBM bandwidth
come from `fxflops.device.peaks` unless its file sets them.

`device_model(name_or_path)` and `cluster(name_or_path)` take a preset's name (any case and spacing,
or one of its aliases) or the path of a TOML file. A user's file may name a preset as `base` and
set only the constants it changes; each constant then reads "from your file PATH", so `explain`
shows which numbers are the user's. A constant is written either as a bare value or as a table
`{value = ..., source = "..."}`.
"""

from __future__ import annotations

import bisect
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

PRESET = "preset"
PEAKS_TABLE = "fxflops/device/peaks.py"
CAPACITY_TABLE = "fxflops/memory/devices.py"


def _class_curve(x: str, kernels: str) -> tuple[str, str]:
    """The schema entry of one memory-bound kernel class's bandwidth curve."""
    return (f"[{x}, fraction]", f"fraction of hbm_bandwidth a {kernels} kernel reaches by {x}, interpolated in "
                                f"log({x}) ([]: sustained_bandwidth's)")


# The constants each kind of file holds: name -> (unit, what it is). A file may hold no others.
DEVICE_CONSTANTS: dict[str, tuple[str, str]] = {
    "peak_flops": ("FLOP/s", "dense tensor-core peak per dtype"),
    "vector_flops": ("FLOP/s", "peak of ops that do not run on tensor cores (elementwise, reductions)"),
    "hbm_bandwidth": ("B/s", "datasheet memory bandwidth"),
    "sustained_bandwidth": ("fraction", "share of hbm_bandwidth a large streaming kernel reaches"),
    "gemm_max_efficiency": ("fraction", "fraction of peak the best-shaped large GEMM reaches (the plateau)"),
    "gemm_tile": ("[M, N] elements", "output tile of one thread block: tile and wave quantization are counted in it"),
    "sm_count": ("SMs", "streaming multiprocessors (compute units) that run tiles at once: one wave"),
    "gemm_k_tile": ("B", "bytes of K (elements x element size) one k-iteration of a GEMM tile covers; a split-K "
                         "GEMM's parts keep at least 8 k-tiles each, and K splits only when the output's tiles fill "
                         "less than half of one wave (0: never split)"),
    "gemm_size_correction": ("[size, factor]", "factor on the GEMM model by size = (M*N*K)**(1/3), interpolated in "
                                               "log(size); what calibrate fits from measured GEMMs (1.0: none)"),
    "gemm_alignment": ("[bytes, factor]", "factor on GEMM efficiency by the alignment in bytes of the GEMM's "
                                          "contiguous dimensions (K, N): the largest row whose bytes divide both"),
    "grouped_gemm_efficiency": ("factor", "a grouped GEMM (MoE experts) relative to one dense GEMM of a group's shape"),
    "attention_forward": ("[seq, fraction]", "fraction of peak a fused attention forward reaches by sequence "
                                             "length, head dim 128, no mask"),
    "attention_forward_causal": ("[seq, fraction]", "the same with a causal mask (FLOPs of the kept pairs)"),
    "attention_backward": ("[seq, fraction]", "fraction of peak of the attention backward, head dim 128, no mask "
                                              "(with a mask: scaled by the forward's causal/no-mask ratio)"),
    "attention_head_dim": ("[head dim, factor]", "factor on the attention curves by head dimension"),
    "cudnn_attention_forward": ("[seq, fraction]", "fraction of peak cuDNN's fused attention forward reaches by "
                                                   "sequence length, head dim 128, no mask (Kernels('cudnn'))"),
    "cudnn_attention_forward_causal": ("[seq, fraction]", "the same with a causal mask (FLOPs of the kept pairs)"),
    "cudnn_attention_backward": ("[seq, fraction]", "fraction of peak of cuDNN's fused attention backward, head dim "
                                                    "128, no mask (with a mask: scaled as attention_backward is)"),
    "unfused_attention_forward": ("[seq, factor]", "measured over modelled time of unfused (math) attention's "
                                                   "forward kernels by query length (1.0: none)"),
    "unfused_attention_backward": ("[seq, factor]", "the same for the unfused attention's backward kernels"),
    "bandwidth_pointwise": _class_curve("bytes", "pointwise (elementwise arithmetic, activation, random draw, "
                                                 "fill, mask)"),
    "bandwidth_reduction": _class_curve("bytes", "reduction (sum, mean, max over a dim)"),
    "bandwidth_normalization": _class_curve("row length", "normalization forward (layer/RMS/group/batch norm)"),
    "bandwidth_normalization_backward": _class_curve("row length", "normalization backward"),
    "bandwidth_persistent_normalization": _class_curve("row length", "persistent fast layer norm forward (apex's "
                                                                     "FastLayerNorm, TE's LayerNorm; "
                                                                     "Kernels(persistent_norm=True); a file "
                                                                     "without it: bandwidth_normalization's)"),
    "bandwidth_persistent_normalization_backward": _class_curve("row length", "persistent fast layer norm backward "
                                                                              "(a file without it: "
                                                                              "bandwidth_normalization_backward's)"),
    "bandwidth_softmax": _class_curve("row length", "softmax or log-softmax forward"),
    "bandwidth_softmax_backward": _class_curve("row length", "softmax or log-softmax backward"),
    "bandwidth_gather": _class_curve("bytes", "gather or scatter (embedding and its backward, index, index_put, "
                                              "gather, nll_loss)"),
    "bandwidth_copy": _class_curve("bytes", "copy or layout change (copy_, clone, dtype cast, cat)"),
    "launch_overhead": ("s", "per-kernel launch and fixed overhead"),
    "memory_latency": ("s", "latency of one load from device memory: a kernel whose threads wait on each load before "
                            "the next (torch's channel-per-block batch norm) moves one load per thread per latency "
                            "(0: not modelled; those kernels take their class's bandwidth)"),
    "threads_per_sm": ("threads", "most threads one SM keeps resident (how many blocks of a grid run at once)"),
    "conv_layout_conversions": ("copies", "NCHW -> NHWC copies cuDNN launches per call of a bf16/fp16 convolution "
                                          "(forward, input or weight gradient) whose tensors are NCHW, to run its "
                                          "NHWC kernels (0: none)"),
    "memory_bytes": ("B", "device memory capacity"),
}
# The kernel classes of memory-bound ops (op_time.memory_class), each timed at its bandwidth_CLASS curve.
MEMORY_CLASSES = ("pointwise", "reduction", "normalization", "normalization_backward", "persistent_normalization",
                  "persistent_normalization_backward", "softmax", "softmax_backward", "gather", "copy")
CLUSTER_CONSTANTS: dict[str, tuple[str, str]] = {
    "gpus_per_node": ("GPUs", "GPUs that share the intra-node fabric (NVLink/NVSwitch, Infinity Fabric, ICI)"),
    "intra_bandwidth": ("B/s", "per-GPU bus bandwidth of the intra-node fabric (NCCL-tests busbw)"),
    "intra_latency": ("s", "per-step latency of a collective inside a node"),
    "inter_bandwidth": ("B/s", "bandwidth of one network adapter (InfiniBand/RoCE), one direction"),
    "nics_per_node": ("NICs", "compute-network adapters per node"),
    "inter_latency": ("s", "per-step latency of a collective across nodes"),
    # the training software's constants (defaults from data/software.toml, SOFTWARE_FILE)
    "ddp_bucket_cap": ("B", "torch DDP's gradient bucket size (bucket_cap_mb's default)"),
    "ddp_first_bucket": ("B", "torch DDP's first gradient bucket, with the default cap"),
    "megatron_bucket_elements": ("elements", "Megatron-LM DDP's smallest gradient bucket (with overlap_grad_reduce)"),
    "megatron_bucket_elements_per_dp": ("elements", "Megatron-LM DDP's bucket per data-parallel rank: a bucket is "
                                                    "max(megatron_bucket_elements, this x dp)"),
    "deepspeed_bucket_elements": ("elements", "DeepSpeed's gradient all-reduce bucket"),
    "tp_overlap_gemm_slowdown": ("factor", "a GEMM's time multiplier while a tensor-parallel collective overlaps it "
                                           "(SM sharing; 1: none), with tp_comm_overlap"),
}
SOFTWARE_FILE = "fxflops/predict/data/software.toml"
# CUTLASS's stream-K scheduler gives each part of a split GEMM at least this many k-tiles (min_iters_per_sk_unit_ of
# PersistentTileSchedulerSm90StreamKParams, include/cutlass/gemm/kernel/tile_scheduler_params.h): a library's
# constant, not a device's
SPLIT_K_MIN_K_TILES = 8


@dataclass(frozen=True)
class Constant:
    """One number of a device or cluster and where it comes from."""

    name: str
    value: Any
    unit: str
    source: str  # the publication or table it was read from
    origin: str  # "preset FILE" for the shipped data, "your file PATH" for a user's file

    @property
    def cited(self) -> str:
        """The source, prefixed with the user's file when the value is theirs."""
        return self.source if self.origin.startswith(PRESET) else f"from {self.origin}: {self.source}"


Curve = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class DeviceModel:
    """One accelerator as the time model sees it. Read the numbers through `constants()` for their sources."""

    name: str
    gpu: str  # the row of fxflops.device.peaks it stands for (its label), or "" when the file gives the peaks
    peak_flops: Mapping[str, float]  # dtype key ("bf16", "fp16", "tf32", "fp32", "fp8", "fp64") -> FLOP/s
    vector_flops: Mapping[str, float]
    hbm_bandwidth: float
    sustained_bandwidth: float
    gemm_max_efficiency: float
    gemm_tile: tuple[int, int]
    sm_count: int
    gemm_k_tile: int
    gemm_size_correction: Curve
    gemm_alignment: Curve
    grouped_gemm_efficiency: float
    attention_forward: Curve
    attention_forward_causal: Curve
    attention_backward: Curve
    attention_head_dim: Curve
    cudnn_attention_forward: Curve
    cudnn_attention_forward_causal: Curve
    cudnn_attention_backward: Curve
    unfused_attention_forward: Curve
    unfused_attention_backward: Curve
    bandwidth_pointwise: Curve
    bandwidth_reduction: Curve
    bandwidth_normalization: Curve
    bandwidth_normalization_backward: Curve
    bandwidth_persistent_normalization: Curve
    bandwidth_persistent_normalization_backward: Curve
    bandwidth_softmax: Curve
    bandwidth_softmax_backward: Curve
    bandwidth_gather: Curve
    bandwidth_copy: Curve
    launch_overhead: float
    memory_latency: float
    threads_per_sm: int
    conv_layout_conversions: int
    memory_bytes: int
    constants: Mapping[str, Constant] = field(compare=False, repr=False)
    origin: str = ""  # the file it was read from

    def peak(self, dtype_key: str) -> float:
        """Tensor-core peak FLOP/s for a dtype key; one-line error naming the keys the device has."""
        if dtype_key == "tf32" and "tf32" not in self.peak_flops and "fp32" in self.peak_flops:
            dtype_key = "fp32"
        try:
            return self.peak_flops[dtype_key]
        except KeyError:
            raise ValueError(f"device {self.name!r} has no {dtype_key} peak (it has "
                             f"{', '.join(self.peak_flops)}); pick one of those dtypes") from None

    def vector_peak(self, dtype_key: str) -> float:
        """FLOP/s of elementwise work: fp64 at the fp64 vector rate, everything else at fp32's."""
        key = "fp64" if dtype_key == "fp64" else "fp32"
        # a TPU publishes its MXU rate only: elementwise work is then bounded by memory, at that rate
        return self.vector_flops.get(key) or self.peak_flops.get(key) or self.peak(dtype_key)

    @property
    def sustained(self) -> float:
        """Bytes/s a memory-bound kernel moves."""
        return self.hbm_bandwidth * self.sustained_bandwidth

    def class_bandwidth(self, kind: str, size: float) -> float:
        """Bytes/s a memory-bound kernel of class `kind` (MEMORY_CLASSES) moves at `size` (bytes moved, or the
        row length for normalization and softmax: the bandwidth_KIND curve's x): that curve's fraction of
        hbm_bandwidth, or the sustained bandwidth where the device has none for the class."""
        curve = getattr(self, f"bandwidth_{kind}")
        return self.hbm_bandwidth * interpolate(curve, max(size, 1)) if curve else self.sustained

    def gemm_fraction(self, m: int, n: int, k: int, element_bytes: int, groups: int = 1,
                      splittable: bool = True) -> float:
        """Fraction of peak an (m x k) @ (k x n) GEMM reaches (`groups` of them in one kernel: a batched or
        grouped GEMM): the plateau, times tile quantization (the last row and column of tiles are partly
        empty), times wave quantization (the last wave of tiles leaves SMs idle; a split-K GEMM's wave holds
        each tile once per part, see `split_k`), times the alignment factor and the calibrated size correction.
        The reduction of a split GEMM's partial outputs is not in it: op_time adds it as memory traffic.
        `splittable`: False for a kernel that never splits K (a grouped GEMM's: CUTLASS's grouped scheduler)."""
        if min(m, n, k) <= 0:
            return self.gemm_max_efficiency
        tile_m, tile_n = self.gemm_tile
        rows, cols = math.ceil(m / tile_m), math.ceil(n / tile_n)
        # a split-K GEMM runs each output tile as `splits` tiles, each over a part of K: more tiles in the wave
        tiles = rows * cols * max(groups, 1) * (self.split_k(m, n, k, element_bytes, groups) if splittable else 1)
        tile_use = (m * n) / (rows * tile_m * cols * tile_n)
        wave_use = tiles / (math.ceil(tiles / self.sm_count) * self.sm_count)
        size = (float(m) * n * k) ** (1 / 3)
        return (self.gemm_max_efficiency * tile_use * wave_use * self.alignment_factor((k, n), element_bytes)
                * interpolate(self.gemm_size_correction, size))

    def split_k(self, m: int, n: int, k: int, element_bytes: int, groups: int = 1) -> int:
        """Into how many parts the library splits the reduction (K) of an (m x k) @ (k x n) GEMM (1: not split), as
        CUTLASS's stream-K scheduler decides it (tile_scheduler_params.h, `get_num_sk_tiles` and
        `get_num_sk_units`): only when the output's tiles make one wave that fills less than half of the SMs
        (CUTLASS also stream-Ks the last two waves of a GEMM of several waves whose last wave is under half full:
        not modelled, that GEMM keeps its idle last wave), into as many parts as fill the SMs, each keeping at
        least SPLIT_K_MIN_K_TILES k-tiles of `gemm_k_tile` bytes of K (a shallower part spends more on its
        prologue and the reduction than it gains; K of 8 k-tiles or fewer is never split)."""
        if min(m, n, k) <= 0 or self.gemm_k_tile <= 0:
            return 1
        tile_m, tile_n = self.gemm_tile
        tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n) * max(groups, 1)
        if 2 * tiles >= self.sm_count:
            return 1
        k_tiles = math.ceil(k * element_bytes / self.gemm_k_tile)  # a partly filled last k-tile is one more
        return max(1, min(self.sm_count // tiles, k_tiles // SPLIT_K_MIN_K_TILES))

    def alignment_factor(self, dims: tuple[int, ...], element_bytes: int) -> float:
        """The gemm_alignment factor of the largest alignment (bytes) dividing every dim's row in bytes."""
        for alignment, factor in sorted(self.gemm_alignment, reverse=True):
            if all((dim * element_bytes) % alignment == 0 for dim in dims):
                return factor
        return min(factor for _, factor in self.gemm_alignment)

    def attention_fraction(self, seq: int, head_dim: int, backward: bool = False, causal: bool = False,
                           kernel: str = "flash") -> float:
        """Fraction of peak a fused attention kernel reaches at this query length and head dimension
        (of the FLOPs it does: with a causal mask, those of the kept pairs). `kernel`: "flash" (the
        attention_* curves: FlashAttention's) or "cudnn" (the cudnn_attention_* curves: cuDNN's fused
        attention, which Transformer Engine runs on Hopper)."""
        seq = max(seq, 1)
        if kernel == "cudnn":
            plain, masked, back = (self.cudnn_attention_forward, self.cudnn_attention_forward_causal,
                                   self.cudnn_attention_backward)
        else:
            plain, masked, back = self.attention_forward, self.attention_forward_causal, self.attention_backward
        forward = interpolate(masked if causal else plain, seq)
        if backward:
            fraction = interpolate(back, seq)
            if causal:  # no published causal backward curve: the forward's causal / no-mask ratio
                fraction *= forward / interpolate(plain, seq)
        else:
            fraction = forward
        return fraction * interpolate(self.attention_head_dim, max(head_dim, 1), log=False)


@dataclass(frozen=True)
class Cluster:
    """GPUs in nodes: an intra-node fabric and a network between nodes, each an α-β link."""

    name: str
    gpu: str  # the DeviceModel's name (or a file path)
    gpus_per_node: int
    intra_bandwidth: float  # B/s per GPU
    intra_latency: float  # s
    inter_bandwidth: float  # B/s per NIC
    nics_per_node: int
    inter_latency: float  # s
    ddp_bucket_cap: int  # B
    ddp_first_bucket: int  # B
    megatron_bucket_elements: int
    megatron_bucket_elements_per_dp: int
    deepspeed_bucket_elements: int
    tp_overlap_gemm_slowdown: float
    constants: Mapping[str, Constant] = field(compare=False, repr=False)
    origin: str = ""
    device_override: DeviceModel | None = field(default=None, compare=False, repr=False)

    @property
    def device(self) -> DeviceModel:
        """The DeviceModel of its GPUs."""
        return self.device_override if self.device_override is not None else device_model(self.gpu)

    @property
    def inter_bandwidth_per_gpu(self) -> float:
        """A GPU's share of its node's network when every GPU of the node talks across nodes at once."""
        return self.inter_bandwidth * self.nics_per_node / self.gpus_per_node


def interpolate(curve: Curve, x: float, log: bool = True) -> float:
    """Piecewise-linear value of `curve` ((x, y) points, x ascending) at x, in log(x) when `log`; flat
    beyond its ends."""
    xs = [point[0] for point in curve]
    if x <= xs[0]:
        return curve[0][1]
    if x >= xs[-1]:
        return curve[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if log else (x - x0) / (x1 - x0)
    return y0 + t * (y1 - y0)


# --- loading ------------------------------------------------------------------------------------------


def device_model(name_or_path: str | Path | DeviceModel) -> DeviceModel:
    """A device preset by name ("H100 SXM", "A100 80GB SXM", "MI300X", ...) or a TOML file's path."""
    if isinstance(name_or_path, DeviceModel):
        return name_or_path
    if _is_path(str(name_or_path), "devices"):
        return _device(*_resolve("devices", name_or_path))
    return _device_preset(str(name_or_path))


def cluster(name_or_path: str | Path | Cluster) -> Cluster:
    """A cluster preset by name ("DGX A100 80GB", "DGX H100", "GB200 NVL72", "MI300X", "TPU v5p") or a TOML
    file's path."""
    if isinstance(name_or_path, Cluster):
        return name_or_path
    if _is_path(str(name_or_path), "clusters"):
        return _cluster(*_resolve("clusters", name_or_path))
    return _cluster_preset(str(name_or_path))


# Presets are read once per name (a plan search times thousands of ops); a user's file is read each time
# it is named, so an edit to it counts at once.
@cache
def _device_preset(name: str) -> DeviceModel:
    return _device(*_resolve("devices", name))


@cache
def _cluster_preset(name: str) -> Cluster:
    return _cluster(*_resolve("clusters", name))


def _is_path(text: str, kind: str) -> bool:
    """A file's path: it ends in .toml, or names no preset and an existing file."""
    if text.endswith(".toml"):
        return True
    return _squashed(text) not in _presets(kind) and Path(text).expanduser().is_file()


def preset_names(kind: str) -> list[str]:
    """The presets' names of one kind ("devices" or "clusters")."""
    return [data["name"] for data, _ in _presets(kind).values() if data.get("_primary")]


def _squashed(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name.lower())


@cache
def _presets(kind: str) -> dict[str, tuple[dict, str]]:
    """Squashed name or alias -> (parsed file, file name), for the shipped files of one kind."""
    folder = resources.files("fxflops.predict").joinpath("data").joinpath(kind)
    return _preset_index(kind, [(entry.name, entry.read_text(encoding="utf-8"))
                                for entry in sorted(folder.iterdir(), key=lambda item: item.name)
                                if entry.name.endswith(".toml")])


def _preset_index(kind: str, files: list[tuple[str, str]]) -> dict[str, tuple[dict, str]]:
    """Squashed name or alias -> (parsed file, file name) of (file name, text) pairs. Every preset needs a
    name (one starting from a `base` too), and no two may share a name or alias: the later file would
    silently take the earlier one's name."""
    found: dict[str, tuple[dict, str]] = {}
    for file_name, text in files:
        where = f"fxflops/predict/data/{kind}/{file_name}"
        data = _parse(text, where)
        if not isinstance(data.get("name"), str):
            raise ValueError(f"{where}: a shipped preset needs name = \"...\"")
        data["_primary"] = True
        for key, entry in ((data["name"], data), *((alias, {**data, "_primary": False})
                                                     for alias in data.get("aliases", ()))):
            taken = found.get(_squashed(key))
            if taken is not None:
                raise ValueError(f"{where}: {key!r} is already the name or an alias of {taken[1]}")
            found[_squashed(key)] = (entry, file_name)
    return found


def _parse(text: str, where: str) -> dict:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{where}: not valid TOML ({error})") from None
    if not isinstance(data.get("name"), str) and "base" not in data:
        raise ValueError(f"{where}: needs name = \"...\" (or base = \"a preset\" to start from)")
    return data


def _resolve(kind: str, name_or_path: str | Path, chain: tuple[str, ...] = ()
             ) -> tuple[dict[str, tuple[Any, str, str]], dict, str]:
    """(constant name -> (value, source, origin), the file's other keys, origin of the file). `chain`: the
    files whose `base` led here, so a cycle of bases (A's base B, B's base A) is refused, not recursed."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if _is_path(text, kind):
        if not path.is_file():
            raise ValueError(f"{kind[:-1]} file {text!r} does not exist")
        origin = f"your file {path}"
        data = _parse(path.read_text(encoding="utf-8"), str(path))
        values: dict[str, tuple[Any, str, str]] = {}
        meta: dict = {}
        if "base" in data:
            values, meta, _ = _resolve(kind, data["base"], _in_chain(chain, str(path.resolve()), str(path)))
        meta = {**meta, **{k: v for k, v in data.items() if k not in _schema(kind) and k != "base"}}
        meta.setdefault("name", str(path))
        meta["_dir"] = str(path.parent)
        values.update(_values(kind, data, origin, str(path)))
        return values, meta, origin
    presets = _presets(kind)
    found = presets.get(_squashed(text))
    if found is None:
        import difflib

        names = preset_names(kind)
        close = difflib.get_close_matches(text, names, n=3, cutoff=0.3)
        hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
        raise ValueError(f"no {kind[:-1]} named {text!r}; {hint}presets: {', '.join(names)}; or give a TOML file's path")
    data, file_name = found
    origin = f"{PRESET} fxflops/predict/data/{kind}/{file_name}"
    meta = {k: v for k, v in data.items() if k not in _schema(kind) and not k.startswith("_") and k != "base"}
    values = {}
    if "base" in data:  # a preset that starts from another (a calibrated file shipped beside its base)
        if _squashed(data["base"]) in (_squashed(data["name"]), *map(_squashed, data.get("aliases", ()))):
            raise ValueError(f"fxflops/predict/data/{kind}/{file_name}: base names the file itself")
        here = _in_chain(chain, file_name, f"fxflops/predict/data/{kind}/{file_name}")
        values, base_meta, _ = _resolve(kind, data["base"], here)
        meta = {**{k: v for k, v in base_meta.items() if k not in ("name", "aliases")}, **meta}
    values.update(_values(kind, data, origin, file_name))
    return values, meta, origin


def _in_chain(chain: tuple[str, ...], key: str, shown: str) -> tuple[str, ...]:
    """`chain` with one more file whose `base` is followed; a file already in it closes a cycle: refused."""
    if key in chain:
        raise ValueError(f"{shown}: its base leads back to itself ({' -> '.join((*chain, key))}); "
                         f"name a preset or a file that does not start from this one")
    return (*chain, key)


def _schema(kind: str) -> dict[str, tuple[str, str]]:
    return DEVICE_CONSTANTS if kind == "devices" else CLUSTER_CONSTANTS


def _values(kind: str, data: dict, origin: str, where: str) -> dict[str, tuple[Any, str, str]]:
    schema = _schema(kind)
    known_keys = {"name", "aliases", "gpu", "base", "description", "_primary"}
    values = {}
    for key, raw in data.items():
        if key in known_keys:
            continue
        if key not in schema:
            from fxflops.spelling import did_you_mean

            raise ValueError(f"{where}: unknown constant {key!r}{did_you_mean(key, schema)} "
                             f"(known: {', '.join(schema)})")
        if isinstance(raw, dict) and "value" in raw:
            value, source = raw["value"], raw.get("source", "no source given")
        else:
            value, source = raw, "no source given"
        values[key] = (value, str(source), origin)
    return values


def _device(values: dict[str, tuple[Any, str, str]], meta: dict, origin: str) -> DeviceModel:
    from fxflops.device import peaks

    name = meta["name"]
    gpu = meta.get("gpu", "")
    if gpu:
        row = peaks.named(gpu)
        table = f"{PRESET} {PEAKS_TABLE}"
        cited = f"{row.source} ({PEAKS_TABLE}, row {row.label})"
        values.setdefault("peak_flops", (dict(row.flops), cited, table))
        vector = {key: row.vector.get(key, row.flops[key]) for key in ("fp32", "fp64") if key in row.flops}
        values.setdefault("vector_flops", (vector, cited, table))
        values.setdefault("hbm_bandwidth", (row.bandwidth, cited, table))
        from fxflops.memory.devices import CAPACITY_GIB, GiB

        if row.label in CAPACITY_GIB:
            values.setdefault("memory_bytes", (CAPACITY_GIB[row.label] * GiB,
                                               f"{row.label} datasheet ({CAPACITY_TABLE})", f"{PRESET} {CAPACITY_TABLE}"))
        gpu = row.label
    for kernel in ("forward", "forward_causal", "backward"):
        # cuDNN's fused attention where no measurement of it on this device is published: the device's
        # FlashAttention curve, said so
        flash = values.get(f"attention_{kernel}")
        if flash is not None:
            values.setdefault(f"cudnn_attention_{kernel}", (
                flash[0], f"none: no published measurement of cuDNN's fused attention on this device; its "
                          f"attention_{kernel} (FlashAttention) curve", flash[2]))
    for kind in MEMORY_CLASSES:
        plain = kind.removeprefix("persistent_")
        if plain != kind:
            # the persistent layer norm where no measurement of it on this device is published: the device's
            # normalization curve (on the H100 QuACK's, the stated upper bound of every layer norm kernel there,
            # TE's among them), not the streaming rate above it; from wherever that curve came
            follows = values[f"bandwidth_{plain}"]
            values.setdefault(f"bandwidth_{kind}", (follows[0], f"none: no published measurement of {kind} "
                                                                f"kernels on this device; bandwidth_{plain}'s value",
                                                    follows[2]))
            continue
        # a class no measurement of this device covers: the sustained bandwidth (whatever value it ends with), from
        # wherever that came (a user's file that sets neither does not own it)
        sustained = values.get("sustained_bandwidth", (None, "", origin))
        values.setdefault(f"bandwidth_{kind}", ([], f"none: no published measurement of {kind} kernels on this "
                                                    f"device; sustained_bandwidth's value", sustained[2]))
    missing = [key for key in DEVICE_CONSTANTS if key not in values]
    if missing:
        raise ValueError(f"device {name!r} ({origin}) lacks {', '.join(missing)}: give them, or base = \"a preset\"")
    constants = MappingProxyType({key: Constant(key, _checked(key, values[key][0], origin), unit, values[key][1],
                                                values[key][2])
                                  for key, (unit, _) in DEVICE_CONSTANTS.items()})  # the schema's order
    v = {key: constant.value for key, constant in constants.items()}
    return DeviceModel(name=name, gpu=gpu, constants=constants, origin=origin, **_typed(DEVICE_CONSTANTS, v))


@cache
def _software() -> dict[str, tuple[Any, str, str]]:
    """The training software's constants every cluster takes unless its file sets them (SOFTWARE_FILE)."""
    text = resources.files("fxflops.predict").joinpath("data").joinpath("software.toml").read_text(encoding="utf-8")
    data = _parse(text, SOFTWARE_FILE)
    return _values("clusters", {k: v for k, v in data.items() if k != "name"}, f"{PRESET} {SOFTWARE_FILE}",
                   SOFTWARE_FILE)


def _cluster(values: dict[str, tuple[Any, str, str]], meta: dict, origin: str) -> Cluster:
    name = meta["name"]
    values = {**_software(), **values}
    missing = [key for key in CLUSTER_CONSTANTS if key not in values]
    if "gpu" not in meta:
        missing.insert(0, "gpu")
    if missing:
        raise ValueError(f"cluster {name!r} ({origin}) lacks {', '.join(missing)}: give them, or base = \"a preset\"")
    constants = MappingProxyType({key: Constant(key, _checked(key, values[key][0], origin), unit, values[key][1],
                                                values[key][2])
                                  for key, (unit, _) in CLUSTER_CONSTANTS.items()})
    v = {key: constant.value for key, constant in constants.items()}
    gpu = meta["gpu"]
    override = None
    if isinstance(gpu, str) and gpu.endswith(".toml"):  # a device file beside the cluster file
        path = Path(gpu) if Path(gpu).is_absolute() else Path(meta.get("_dir", ".")) / gpu
        override = device_model(path)
    else:
        device_model(gpu)  # an unknown GPU fails here, naming it, not at the first prediction
    return Cluster(name=name, gpu=gpu, constants=constants, origin=origin, device_override=override,
                   **_typed(CLUSTER_CONSTANTS, v))


def _typed(schema: dict[str, tuple[str, str]], values: dict[str, Any]) -> dict[str, Any]:
    """The constants as the dataclass fields hold them: counts as int, rates and fractions as float."""
    typed = {}
    for key, (unit, _) in schema.items():
        value = values[key]
        if unit in _COUNT_UNITS:
            value = int(value)
        elif unit == "FLOP/s":
            value = MappingProxyType(dict(value))
        elif not unit.startswith("["):
            value = float(value)
        typed[key] = value
    return typed


_ZERO_TURNS_OFF = ("gemm_k_tile", "memory_latency", "conv_layout_conversions")  # constants whose 0 means "the device never does this"
# constants held as int (_typed): whole numbers only
_COUNT_UNITS = ("SMs", "GPUs", "NICs", "B", "elements", "threads", "copies")


def _checked(key: str, value: Any, origin: str) -> Any:
    """The value in its stored form (curves as tuples of pairs), or a one-line error naming the constant."""
    unit = (DEVICE_CONSTANTS.get(key) or CLUSTER_CONSTANTS[key])[0]

    def fail(what: str) -> ValueError:
        return ValueError(f"{key} ({origin}) must be {what}, got {value!r}")

    if unit == "[M, N] elements":
        if not (isinstance(value, list) and len(value) == 2 and all(isinstance(x, int) and x > 0 for x in value)):
            raise fail("two positive integers [M, N]")
        return (value[0], value[1])
    if unit.startswith("["):
        try:
            curve = tuple((float(x), float(y)) for x, y in value)
        except (TypeError, ValueError):
            raise fail("a list of [x, y] pairs") from None
        empty_ok = key.startswith("bandwidth_")  # [] = the sustained bandwidth
        if (not curve and not empty_ok) or any(x <= 0 or y <= 0 for x, y in curve) or list(curve) != sorted(curve):
            raise fail(f"a {'' if empty_ok else 'non-empty '}list of positive [x, y] pairs, x ascending")
        if empty_ok and any(y > 1 for _, y in curve):
            raise fail("a list of [x, fraction] pairs, each fraction in (0, 1]")
        return curve
    if isinstance(value, Mapping):
        if (not value and key != "vector_flops") or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                for v in value.values()):
            raise fail("a table of positive numbers per dtype")
        return MappingProxyType({str(k): float(v) for k, v in value.items()})
    if key in _ZERO_TURNS_OFF and isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise fail("a positive number" + (" (or 0: never)" if key in _ZERO_TURNS_OFF else ""))
    if unit in _COUNT_UNITS and value != int(value):  # int() would truncate it (0.5 B of K: never split)
        raise fail("a whole number")
    if unit == "fraction" and value > 1:
        raise fail("a fraction in (0, 1]")
    if key == "tp_overlap_gemm_slowdown" and value < 1:  # sharing the SMs never speeds a GEMM up
        raise fail("a factor >= 1 (a GEMM overlapped with a collective runs no faster than alone)")
    return value


def with_device(the_cluster: Cluster | str, device: DeviceModel | str | Path | None) -> Cluster:
    """`the_cluster` with its GPUs replaced by `device` (a preset name, a device file such as `calibrate` writes,
    or a DeviceModel); the cluster unchanged when `device` is None."""
    found = cluster(the_cluster)
    if device is None:
        return found
    return replace(found, device_override=device_model(device))


def with_constant(thing: DeviceModel | Cluster, name: str, value: Any, source: str = "given") -> DeviceModel | Cluster:
    """A copy of a device or cluster with one constant changed (what-if questions in code, not files)."""
    constants = dict(thing.constants)
    if name not in constants:
        raise ValueError(f"{thing.name!r} has no constant {name!r} (it has {', '.join(constants)})")
    checked = _checked(name, value, "given")
    constants[name] = replace(constants[name], value=checked, source=source, origin="given in code")
    schema = DEVICE_CONSTANTS if isinstance(thing, DeviceModel) else CLUSTER_CONSTANTS
    return replace(thing, **_typed({name: schema[name]}, {name: checked}), constants=MappingProxyType(constants))


def constants(thing: DeviceModel | Cluster | str) -> list[tuple[str, Any, str, str]]:
    """Every constant as (name, value, unit, source); a cluster's list goes on with its GPU's ("gpu.NAME").
    A value from a user's file has "from your file PATH: " before its source."""
    if isinstance(thing, str):
        try:
            thing = cluster(thing)
        except ValueError:
            thing = device_model(thing)
    rows = [(c.name, c.value, c.unit, c.cited) for c in thing.constants.values()]
    if isinstance(thing, Cluster):
        rows += [(f"gpu.{name}", value, unit, source) for name, value, unit, source in constants(thing.device)]
    return rows


def constants_text(thing: DeviceModel | Cluster | str) -> str:
    """Every constant of a device or cluster with its unit and source, as `fxflops explain` prints it."""
    if isinstance(thing, str):
        try:
            thing = cluster(thing)
        except ValueError:
            thing = device_model(thing)
    kind = "cluster" if isinstance(thing, Cluster) else "device"
    lines = [f"{kind} {thing.name} ({thing.origin})"]
    if isinstance(thing, Cluster):
        lines[0] += f", GPU {thing.device.name} ({thing.device.origin})"
    lines.append("a prediction from these constants is a model with a stated error, not a measurement")
    for name, value, unit, source in constants(thing):
        lines.append(f"  {name} = {_shown(value)} {unit}")
        lines.append(f"      {source}")
    return "\n".join(lines) + "\n"


def _shown(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
