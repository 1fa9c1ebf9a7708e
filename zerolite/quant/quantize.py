"""Weight quantization at convert time: which tensors are quantized, and how.

    scheme = WeightScheme.parse("int4", group_size=64)      # None: the layout's dtype, as before
    targets = quantizable_linears(meta_model, "model.layers")   # {module path: LinearShape}
    targets = scheme.fitting(targets)                       # less those whose widths the scheme cannot store
    tensors = scheme.quantize_block(tensors, targets)       # P.weight -> P.weight + its companion

Every Linear inside the decoder layers (and transformers' Conv1D, GPT-2's Linear with its weight
stored transposed) is quantized, but for one whose weight the model's code multiplies by itself and
(int4) one of an output width the kernel cannot pack; embeddings, norms, biases and the head keep
the layout's dtype. The quantized weight is always stored [out, in], whatever the module stored, so one module per
scheme (zerolite.quant.linear) runs them all.

- int8: symmetric per output channel, weight = q * scale with q in [-127, 127]; the companion
  P.weight_scale holds one scale per output row.
- int4: asymmetric per group of input columns, weight = (q - 8) * scale + zero with q in [0, 15],
  the form torch's CPU int4 kernel computes. P.weight holds the nibbles in that kernel's packed
  order (zerolite.quant.int4_packing, recorded in the manifest); the companion P.weight_scale_zero is
  [groups, out, 2], the kernel's scales-and-zeros tensor. A width that is no multiple of the group
  (SmolLM2's 576 at group 128) ends in a partial group: it is stored padded to a whole one, its
  scale and zero taken from its real columns alone, and the module pads its input with zeros, so the
  padding adds exactly nothing. A group whose values already sit on a
  grid of 16 evenly spaced levels (a GGUF Q4_0 or Q4_1 source at group 32) keeps that grid, so its
  values come back as they were instead of being rounded a second time.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from zerolite.errors import ZeroliteError
from zerolite.layout.manifest import DTYPES
from zerolite.memory_model import quantized_bytes_per_weight
from zerolite.quant.bf16_linear import Bf16KernelLinear
from zerolite.quant.int4_packing import (
    ROW_MULTIPLE,
    Int4Packing,
    cpu_packing,
    pack_int4,
)

SCALE_SUFFIX = "_scale"             # int8: P.weight's scales are stored as P.weight_scale
SCALE_ZERO_SUFFIX = "_scale_zero"   # int4: P.weight's scales and zero points as P.weight_scale_zero
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
LEVELS = 15  # int4's steps between a group's lowest and highest level
GRID_TOLERANCE = 1e-3  # of a step: how far from a level a value on an existing grid may lie
# output rows quantized at once: fewer than a whole weight's fp32 work in memory, and faster (docs/design-figures.md)
QUANTIZE_ROWS = 256
GRID_PROBE = 8  # values of each group that must lie near a grid's level before the whole group is checked
GRID_BINS = 4096  # of a group's spread, for that check's table


@dataclass(frozen=True)
class LinearShape:
    out_features: int
    in_features: int
    transposed: bool   # the module stores its weight [in, out] (Conv1D)


@dataclass(frozen=True)
class WeightScheme:
    name: str                               # "int8" or "int4"
    group_size: int | None = None           # int4: input columns per scale and zero point
    packing: Int4Packing | None = None      # int4: the order of the stored nibbles
    packed_by: str | None = None            # int4: the torch version that packing was taken from

    @classmethod
    def parse(cls, weights: str | None, group_size: int | None = None) -> WeightScheme | None:
        if weights is None:
            if group_size is not None:
                raise ZeroliteError("`group_size` is for int4 weights: give `weights` int4 too")
            return None
        if weights == "int8":
            if group_size is not None:
                raise ZeroliteError("`group_size` is for int4's groups: int8 has one scale per output channel")
            return cls("int8")
        if weights == "int4":
            group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
            if group_size not in GROUP_SIZES:
                raise ZeroliteError(f"`group_size` {group_size} is not one int4 takes: choose 32, 64 or 128")
            return cls("int4", group_size, cpu_packing(), torch.__version__)
        raise ZeroliteError(f"unknown `weights` {weights!r}: "
                            "choose int8 or int4 (or leave it out for the layout's dtype)")

    @classmethod
    def from_manifest(cls, record: dict) -> WeightScheme:
        if record["weights"] == "int4":
            return cls("int4", int(record["group_size"]), Int4Packing.from_manifest(record["packing"]),
                       str(record["packing"]["torch"]))
        return cls(record["weights"])

    def to_manifest(self) -> dict:
        if self.name == "int8":
            return {"weights": "int8", "scale": "symmetric, per output channel"}
        return {"weights": "int4", "group_size": self.group_size,
                "zero_point": "asymmetric, per group: weight = (q - 8) * scale + zero",
                "packing": {"torch": self.packed_by, **self.packing.to_manifest()}}

    @property
    def companion(self) -> str:
        """The suffix of the tensor stored beside each quantized P.weight."""
        return SCALE_SUFFIX if self.name == "int8" else SCALE_ZERO_SUFFIX

    def fitting(self, targets: dict[str, LinearShape]) -> dict[str, LinearShape]:
        """The targets this scheme can store. int4's kernel packs output rows in blocks of
        ROW_MULTIPLE, so a layer of another output width (a router's gate of 1 or 8 rows, as
        Qwen2-MoE's shared_expert_gate and JetMoe's router; a tiny mamba's x_proj) keeps the layout's
        dtype: it weighs next to nothing, and refusing int4 for it refused the whole model."""
        if self.name != "int4":
            return targets
        return {path: shape for path, shape in targets.items() if shape.out_features % ROW_MULTIPLE == 0}

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """{suffix: tensor}: "" for the quantized weight, the companion for its scales. A few
        output rows at a time (each row's groups stand alone): the fp32 work of a whole 13824 x
        5120 weight took over a gigabyte, the larger part of convert's peak memory."""
        stored = self.stored_shapes(LinearShape(*weight.shape, False), weight.dtype)
        (q_shape, q_dtype), (companion_shape, _) = stored.values()
        if self.name == "int4":
            q_shape = (q_shape[0], q_shape[1] * 2)  # a value a byte until packed
        q, companion = torch.empty(q_shape, dtype=q_dtype), torch.empty(companion_shape, dtype=weight.dtype)
        for start in range(0, weight.shape[0], QUANTIZE_ROWS):
            rows = slice(start, start + QUANTIZE_ROWS)
            if self.name == "int8":
                q[rows], companion[rows] = quantize_int8(weight[rows])
            else:
                q[rows], companion[:, rows] = quantize_int4(weight[rows], self.group_size)
        if self.name == "int8":
            return {"": q, SCALE_SUFFIX: companion}
        return {"": pack_int4(q, self.packing), SCALE_ZERO_SUFFIX: companion}

    def stored_shapes(self, shape: LinearShape, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What quantize makes of a weight of this shape, without making it."""
        out, inp = shape.out_features, shape.in_features
        if self.name == "int8":
            return {"": ((out, inp), torch.int8), SCALE_SUFFIX: ((out,), dtype)}
        padded = whole_groups(inp, self.group_size)
        return {"": ((out, padded // 2), torch.uint8), SCALE_ZERO_SUFFIX: ((padded // self.group_size, out, 2), dtype)}

    def quantize_block(self, tensors: dict[str, torch.Tensor],
                       targets: dict[str, LinearShape]) -> dict[str, torch.Tensor]:
        """The block's tensors with each target module's weight quantized (others unchanged),
        taken out of tensors one by one: a weight's memory goes as soon as it is quantized."""
        out = {}
        for name in list(tensors):
            tensor = tensors.pop(name)
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module in targets:
                weight = tensor.t() if targets[module].transposed else tensor
                out.update({name + suffix: stored for suffix, stored in self.quantize(weight).items()})
            else:
                out[name] = tensor
        return out

    def meta_tensors(self, tensors: dict[str, torch.Tensor],
                     targets: dict[str, LinearShape]) -> dict[str, torch.Tensor]:
        """What quantize_block makes, as meta tensors: the shapes a layout is planned from."""
        out = {}
        for name, tensor in tensors.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module in targets:
                for suffix, (shape, dtype) in self.stored_shapes(targets[module], tensor.dtype).items():
                    out[name + suffix] = torch.empty(shape, dtype=dtype, device="meta")
            else:
                out[name] = tensor
        return out


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) with weight ~ q * scale[:, None]: rounding to nearest, in fp32, per output row."""
    rows = weight.float()
    scale = rows.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(weight.dtype)


def whole_groups(in_features: int, group_size: int) -> int:
    """The stored width of an int4 weight: in_features rounded up to whole groups."""
    return -(-in_features // group_size) * group_size


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_zero): q uint8 [out, padded in] in 0..15 and scale_zero [groups, out, 2] in
    weight's dtype, with weight ~ (q - 8) * scale + zero per group: rounding to nearest, in fp32.
    A partial last group is filled with copies of its last column, which leave its lowest and
    highest values, and the grid its values lie on, as they were."""
    out_features, in_features = weight.shape
    padding = whole_groups(in_features, group_size) - in_features
    weight = torch.cat([weight, weight[:, -1:].expand(-1, padding)], dim=1) if padding else weight
    groups = weight.to(torch.float32, copy=True).reshape(out_features, -1, group_size)  # worked on in place below
    low = groups.amin(dim=-1, keepdim=True)
    spread = groups.amax(dim=-1, keepdim=True) - low
    scale = spread / grid_steps(groups, low, spread)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 0 at its value
    q = groups.sub_(low).div_(scale).round_().clamp_(0, LEVELS).to(torch.uint8)  # in place: one fp32 copy, not four
    zero = low + 8 * scale
    scale_zero = torch.stack([scale, zero], dim=-1).reshape(out_features, -1, 2).transpose(0, 1)
    return q.reshape(out_features, -1), scale_zero.to(weight.dtype).contiguous()


def grid_steps(groups: torch.Tensor, low: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """Per group, the number of steps between its lowest and highest value: LEVELS, unless the
    group's values already lie on fewer evenly spaced levels (a 4-bit source whose extremes did not
    both land on its grid's ends), whose spacing is then kept."""
    steps = torch.full_like(low, LEVELS)
    candidates = may_lie_on_a_grid(groups, low, spread) & (spread > 0)
    if not candidates.any():
        return steps
    # Only a group of at most LEVELS + 1 distinct values keeps a grid: values merely near one keep
    # the finest, as rounding them would.
    rows = candidates.squeeze(-1).clone()  # a mask apart from the one written through it
    distinct = 1 + (groups[rows].sort(dim=-1).values.diff(dim=-1) > 0).sum(dim=-1)
    candidates[rows] = (distinct <= LEVELS + 1)[:, None]
    if not candidates.any():
        return steps
    values, lows, spreads = groups[candidates.squeeze(-1)], low[candidates], spread[candidates]
    found = torch.zeros_like(lows, dtype=torch.bool)
    chosen = torch.full_like(lows, LEVELS)
    for count in range(LEVELS, 0, -1):  # the finest grid the values fit, as rounding to nearest would pick
        position = (values - lows[:, None]) / (spreads / count)[:, None]
        fits = ((position - position.round()).abs() <= GRID_TOLERANCE).all(dim=-1) & ~found
        chosen = torch.where(fits, torch.full_like(chosen, count), chosen)
        found |= fits
    steps[candidates] = chosen
    return steps


def may_lie_on_a_grid(groups: torch.Tensor, low: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """Per group, whether its first GRID_PROBE values each lie near a level of some grid of 1 to
    LEVELS steps between its lowest and highest value (a fraction k / count of the spread, looked
    up in near_a_level): a group whose values all lie on one grid passes, and of a model's own
    weights almost none does, so only the few that pass are sorted and checked whole. (Sorting the
    first LEVELS + 2 values of every group, as before, took half of quantizing.) A value that is
    not a number (a damaged weight) is looked up as position 0 and left to the whole check."""
    # The probed values lead (dim 0), so that "all of them" reduces across whole rows of groups.
    probed = groups[..., :GRID_PROBE].movedim(-1, 0)
    position = (probed - low.squeeze(-1)) / torch.where(spread > 0, spread, torch.ones_like(spread)).squeeze(-1)
    bins = position.nan_to_num_(0.0).mul_(GRID_BINS).clamp_(0, GRID_BINS).to(torch.int64)
    return near_a_level()[bins].all(dim=0).unsqueeze(-1)


@functools.cache
def near_a_level() -> torch.Tensor:
    """For each of GRID_BINS + 1 bins of a value's position in its group's spread, whether some
    level k / count (count 1 to LEVELS) lies within GRID_TOLERANCE of it: a superset of the values
    grid_steps can find on a grid (it allows GRID_TOLERANCE / count), the position's fp32 rounding
    (about 1e-7) included."""
    table = torch.zeros(GRID_BINS + 1, dtype=torch.bool)
    reach = GRID_TOLERANCE + 1e-5
    for count in range(1, LEVELS + 1):
        for k in range(count + 1):
            first = max(int((k / count - reach) * GRID_BINS), 0)
            last = min(int((k / count + reach) * GRID_BINS), GRID_BINS)
            table[first:last + 1] = True
    return table


def quantizable_linears(model: nn.Module, layers_path: str) -> dict[str, LinearShape]:
    """The Linear and Conv1D modules inside the decoder layers, by module path, less those whose
    weight the model's own code multiplies by (mamba's dt_proj: `self.dt_proj.weight @ x`), which
    an int8 or int4 weight cannot be: they keep the layout's dtype."""
    layers = model.get_submodule(layers_path)
    found = {}
    for path, module in layers.named_modules():
        if (shape := linear_shape(module)) is None:
            continue
        parent, _, leaf = path.rpartition(".")
        if leaf not in weights_multiplied_directly(type(layers.get_submodule(parent))):
            found[f"{layers_path}.{path}"] = shape
    return found


# `self.NAME.weight @ ...`, `... @ self.NAME.weight`, or the weight passed to a matmul: a module's
# weight used as a matrix by its owner's code rather than through the module's forward.
DIRECT_MATMUL = re.compile(r"self\.(\w+)\.weight\s*@|@\s*self\.(\w+)\.weight\b"
                           r"|(?:matmul|linear|mm)\([^()]*self\.(\w+)\.weight\b")


@functools.cache
def weights_multiplied_directly(owner: type) -> frozenset[str]:
    """The names of owner's submodules whose weight owner's source multiplies by itself (read from
    the source of its class and its bases; none where that source cannot be read)."""
    names = set()
    for cls in owner.__mro__:
        if cls.__module__.startswith("torch."):
            break
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        names.update(name for match in DIRECT_MATMUL.findall(source) for name in match if name)
    return frozenset(names)


def linear_shape(module: nn.Module) -> LinearShape | None:
    """A Linear's or Conv1D's widths; None for any other module, and for a Linear whose class
    computes more than the product (Llama 4's router, an nn.Linear whose forward also takes the
    top-k), which a quantized linear in its place would drop. (A CPU run's Bf16KernelLinear computes
    the product alone.)"""
    if isinstance(module, nn.Linear) and type(module).forward in (nn.Linear.forward, Bf16KernelLinear.forward):
        return LinearShape(module.out_features, module.in_features, transposed=False)
    if isinstance(module, Conv1D):
        return LinearShape(module.nf, module.weight.shape[0], transposed=True)
    return None


def fewer_bytes(dtype: str, weights: str | None) -> str | None:
    """What moves fewer bytes per step than a layout of dtype and weights (profile's advice): 4- or
    8-bit weights, and for a 32-bit layout a 16-bit one too (never what the layout is already)."""
    if weights == "int4":
        return None
    size = DTYPES[dtype].itemsize
    int8, int4 = (quantized_bytes_per_weight(w, DTYPES[dtype], DEFAULT_GROUP_SIZE) for w in ("int8", "int4"))
    now = int8 if weights else size  # bytes a weight of this layout
    smaller = f"int4 weights (zerolite convert MODEL --weights int4) read about {int4 / now:.2f}x"
    if weights == "int8":
        return f"move fewer bytes: {smaller} of this int8 layout's"
    advice = f"move fewer bytes: {smaller} of this {dtype} layout's, int8 weights (--weights int8) {int8 / size:.2f}x"
    if size > 2:
        advice += "; a bf16 layout (zerolite convert MODEL --dtype bf16) reads 0.5x"
    return advice
