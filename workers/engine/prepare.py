"""Model preparation, once per loaded model (gpt-fast's `convert_for_runtime` step), and the
KV pools each engine allocates from it.

The speed swaps of `swaps.py` change a loaded model in place, and a swap cannot be undone. When
the engine applied them in its constructor, a second engine over the same loaded model (tests and
benchmarks build several) swapped an already swapped model: int8 after MKL packing quantized
nothing (packed projections are no longer `nn.Linear`) while that engine believed it ran int8
weights; and every engine hung its KV pools on the one model, so two live engines wrote each
other's blocks.

`prepare_model(loaded, Preparation(...)) -> PreparedModel` runs the swaps in their one valid
order (fused q/k/v and gate/up -> int8 weights -> the LM head's screen -> probed packing)
and keeps the record on the model (a plain attribute of the `Transformer`). Preparing the same
model again:
- with the same swaps returns that record: nothing is fused, quantized or packed twice;
- with other model-changing swaps (`fuse_projections`, `quantize`, `pack_weights`) raises
  `PreparationMismatch` naming each field that differs, before anything is touched: load the
  model again (`load_model`) for another preparation.
The LM-head screen is not a change of the model (a separate cheaper copy of the head, which the
model keeps), so engines may differ in it: the first engine that asks builds it onto the
record, the others share it or ignore it.

KV pools: their layout depends on the model (layer kinds, KV heads, head dim, the model's dtype
and device; CPU pools on huge pages, `hugepages.py`), their size on the engine (blocks, block
size). `PreparedModel.allocate_kv_pools` gives each engine fresh pools, never shared. The model's
attention layers read K/V from their `k_cache`/`v_cache` slots, so an engine binds its pools
before each forward, under the record's lock (`PreparedModel.bound`): a no-op when its pools are
bound already (one engine: every step), a pointer swap per layer when another engine ran last.
Engines over one model thus take turns step by step, each on its own pools, whatever threads
they run on. The pools bound last stay referenced by the model until another engine binds its
own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, cast

import torch
from torch import Tensor

from workers.engine import hugepages, linear_backends
from workers.engine.loader import LoadedModel
from workers.engine.model import Attention, Block, Transformer
from workers.engine.swaps import (
    HeadScreen,
    WeightOnlyInt4Linear,
    WeightOnlyInt8Linear,
    convert_for_runtime,
    fuse_gate_up,
    fuse_qkv,
    pack_linears,
    screen_lm_head,
)

log = logging.getLogger(__name__)

QUANTIZATIONS = (None, "int8", "int4")
_RECORD_ATTR = "_tolk_prepared"  # the PreparedModel, a plain attribute of the Transformer
_PREPARING = threading.Lock()  # one preparation at a time (engines built on several threads)


class PreparationMismatch(ValueError):
    """An engine asks for other model-changing swaps than its loaded model went through."""


@dataclass(frozen=True, slots=True)
class Preparation:
    """Which swaps `prepare_model` runs (the fields mirror `EngineConfig`'s)."""

    fuse_projections: bool = True  # one q/k/v and one gate/up projection, bit-identical
    # None, "int8" or "int4": weight-only projections and LM head (workers/engine/swaps.py)
    quantize: str | None = None
    pack_weights: bool = True  # CPU float32: projections through the probed fastest GEMM
    # CPU: a screen of the LM head for greedy rows, an int8 copy of a float32 head or an int4
    # copy of an int8 head (the model is unchanged)
    screen_lm_head: bool = True

    # the swaps that rewrite the model's modules: engines over one model must agree on them
    MODEL_CHANGING: ClassVar[tuple[str, ...]] = ("fuse_projections", "quantize", "pack_weights")

    def __post_init__(self) -> None:
        if self.quantize not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantize!r} (supported: int8, int4)")

    def differences(self, asked: Preparation) -> list[str]:
        """`field: prepared X, asked Y` for each model-changing swap on which `asked` differs."""
        return [
            f"{name}: prepared {getattr(self, name)!r}, asked {getattr(asked, name)!r}"
            for name in self.MODEL_CHANGING
            if getattr(self, name) != getattr(asked, name)
        ]


@dataclass(eq=False, slots=True)
class KVPools:
    """One engine's paged KV cache: per layer K and V `[num_blocks[group], block_size, KVH, D]`
    (block 0 of each pool is the null block, never written by a request)."""

    num_blocks: dict[str, int]  # blocks per KV group ("full", "sliding"), null block included
    block_size: int  # tokens per block
    attentions: list[Attention]  # the model's attention layers, in order
    k: list[Tensor]  # per layer, like `attentions`
    v: list[Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def is_bound(self) -> bool:
        # the layers are only ever rebound together (here, or allocate/free_kv_cache)
        return self.attentions[0].k_cache is self.k[0]

    def bind(self) -> None:
        """Point every attention layer's `k_cache`/`v_cache` at these pools (if not already)."""
        if self.is_bound():
            return
        for attn, k, v in zip(self.attentions, self.k, self.v, strict=True):
            attn.k_cache = k
            attn.v_cache = v


@dataclass(eq=False)
class PreparedModel:
    """The record of one loaded model's preparation: the swaps asked for, how many modules
    each swapped, the shared LM-head screen, and the lock under which
    engines take turns running the model."""

    loaded: LoadedModel
    preparation: Preparation  # screen_lm_head: whether any engine asked for the screen so far
    fused_attentions: int  # attention layers given one q/k/v projection
    fused_mlps: int  # MLPs given one gate/up projection
    int8_linears: int  # WeightOnlyInt8Linear modules
    int4_linears: int  # WeightOnlyInt4Linear modules
    packed_linears: int  # projections `pack_linears` swapped for pre-packed ones
    lm_screen: HeadScreen | None  # None unless asked for and one applies (swaps.screen_lm_head)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def model(self) -> Transformer:
        return self.loaded.model

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV pools' dtype: the model's activations' (int8 weights keep float norms and
        embeddings, so this is the dtype the model was loaded in)."""
        return self.model.embed.weight.dtype

    def check(self, asked: Preparation) -> None:
        """Raise `PreparationMismatch` if `asked` needs other model-changing swaps."""
        differences = self.preparation.differences(asked)
        if differences:
            raise PreparationMismatch(
                f"model {self.loaded.name!r} was already prepared with other swaps than this "
                f"engine asks for ({'; '.join(differences)}); swaps cannot be undone: build the "
                "engine with the same swaps, or load the model again for another preparation"
            )

    def allocate_kv_pools(self, num_blocks: Mapping[str, int], block_size: int) -> KVPools:
        """Fresh zeroed pools for one engine (CPU: on huge pages), not yet bound to the model."""
        cfg = self.model.config
        attentions, ks, vs = [], [], []
        for layer in self.model.layers:
            block = cast(Block, layer)
            shape = (num_blocks[block.layer_type], block_size, cfg.num_kv_heads, cfg.head_dim)
            attentions.append(block.attn)
            ks.append(hugepages.zeros(shape, dtype=self.kv_dtype, device=self.device))
            vs.append(hugepages.zeros(shape, dtype=self.kv_dtype, device=self.device))
        return KVPools(dict(num_blocks), block_size, attentions, ks, vs)

    def bind(self, pools: KVPools) -> None:
        """Bind `pools` to the model now (they stay bound until another engine binds its own)."""
        with self.lock:
            pools.bind()

    @contextmanager
    def bound(self, pools: KVPools) -> Iterator[Transformer]:
        """The model with `pools` bound, for one forward (or a compiled graph's warm-up); other
        engines over this model wait meanwhile."""
        with self.lock:
            pools.bind()
            yield self.model


def prepared_record(model: Transformer) -> PreparedModel | None:
    """The record `prepare_model` left on this model, if it prepared it."""
    return cast(PreparedModel | None, model.__dict__.get(_RECORD_ATTR))


def prepare_model(loaded: LoadedModel, preparation: Preparation | None = None) -> PreparedModel:
    """Run the swaps of `preparation` on `loaded.model` once and record them (see the module
    docstring); a model prepared already gets its record back, or `PreparationMismatch`."""
    asked = preparation if preparation is not None else Preparation()
    model = loaded.model
    with _PREPARING:
        record = prepared_record(model)
        if record is not None:
            record.check(asked)  # before touching anything
            if asked.screen_lm_head and not record.preparation.screen_lm_head:
                record.lm_screen = screen_lm_head(model)  # an add-on: the model is unchanged
                record.preparation = dataclasses.replace(record.preparation, screen_lm_head=True)
            return record
        # fused first: int8 and packing then swap the fused projection
        fused = fuse_qkv(model) if asked.fuse_projections else 0
        fused_mlps = fuse_gate_up(model) if asked.fuse_projections else 0
        convert_for_runtime(model, asked.quantize)
        # before packing, which leaves the LM head's float32 weight in place anyway
        screen = screen_lm_head(model) if asked.screen_lm_head else None
        # no-op unless float32 nn.Linear on the CPU
        packed = pack_linears(model) if asked.pack_weights else 0
        if packed:
            log.info("projection backends per row bucket: %s", linear_backends.summary())
        record = PreparedModel(
            loaded=loaded,
            preparation=asked,
            fused_attentions=fused,
            fused_mlps=fused_mlps,
            int8_linears=sum(isinstance(m, WeightOnlyInt8Linear) for m in model.modules()),
            int4_linears=sum(isinstance(m, WeightOnlyInt4Linear) for m in model.modules()),
            packed_linears=packed,
            lm_screen=screen,
        )
        model.__dict__[_RECORD_ATTR] = record  # a plain attribute, not a submodule
        return record
