"""The cache layer under the backends: slot, quantized and paged latent caches, and byte measurement.

Import order is one way: ``codecs`` (layout math) <- ``cache`` <- ``backends``. Nothing here imports a
backend.
"""

from mla_conformance.kv.caches.measure import poison, written_bytes, written_masks
from mla_conformance.kv.caches.paged import (DEFAULT_PAGE_BLOCK_SIZE, PagedLatentCache, from_contiguous,
                                         to_flashmla_layout)
from mla_conformance.kv.caches.quantized import FP8IndexerLatentCache, QuantizedLatentCache
from mla_conformance.kv.caches.slots import IndexerLatentCache, LatentSlotCache, SlotCache

__all__ = ["SlotCache", "LatentSlotCache", "IndexerLatentCache", "FP8IndexerLatentCache", "QuantizedLatentCache", "PagedLatentCache", "DEFAULT_PAGE_BLOCK_SIZE",
           "from_contiguous", "to_flashmla_layout", "poison", "written_masks", "written_bytes"]
