"""vLLM's --mm-processor-cache-gb: the gateway's processed images, kept by what names their bytes."""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import Counter

from services.gateway.given_embeddings import ProcessedImage

# vLLM's vllm:mm_cache_queries and vllm:mm_cache_hits.
CACHE_QUERIES = Counter("baton_gateway_mm_cache_queries_total", "Images looked up in the processed-image cache")
CACHE_HITS = Counter("baton_gateway_mm_cache_hits_total", "Images the processed-image cache held")


class ProcessedImageCache:
    """vLLM's --mm-processor-cache-gb: images as the model's processor made them, by a hash of their encoded
    bytes (of a data: URL's text, or of the uuid a request named one by), the least recently used left out past
    `max_bytes` of pixels. A conversation
    sends its images again with every turn: each is decoded, resized and hashed once (a photo's tens of
    milliseconds of every turn's time to its first token), its bytes hashed again (a millisecond a megabyte).
    Safe across threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._images: OrderedDict[bytes, ProcessedImage] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    def processed(self, data: bytes, make: Callable[[], ProcessedImage]) -> ProcessedImage:
        """The image `data` names, from the cache or made by `make` (and kept, where it fits)."""
        key = hashlib.blake2b(data, digest_size=16).digest()
        image = self._looked_up(key)
        if image is not None:
            return image
        image = make()  # outside the lock: two requests may make the same image at once, and both keep it
        size = image.num_bytes
        with self._lock:
            if size <= self.max_bytes and key not in self._images:
                self._images[key] = image
                self._num_bytes += size
                while self._num_bytes > self.max_bytes:
                    _, dropped = self._images.popitem(last=False)
                    self._num_bytes -= dropped.num_bytes
        return image

    def cached(self, data: bytes) -> ProcessedImage | None:
        """The image `data` names, where the cache holds it."""
        return self._looked_up(hashlib.blake2b(data, digest_size=16).digest())

    def _looked_up(self, key: bytes) -> ProcessedImage | None:
        CACHE_QUERIES.inc()
        with self._lock:
            image = self._images.get(key)
            if image is not None:
                self._images.move_to_end(key)
                CACHE_HITS.inc()
        return image
