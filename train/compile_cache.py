"""jax's persistent compilation cache, on by default for training runs.

A second start of the same configuration (same model, shapes, flags, jax version and
device) loads the compiled step from disk instead of compiling it again. Where it lives:

    --compile-cache DIR     that directory
    --compile-cache off     no persistent cache
    (default)               $DM_JAX_COMPILE_CACHE, else $XDG_CACHE_HOME/dm_jax/jax,
                            else ~/.cache/dm_jax/jax

Programs that compile in under `MIN_COMPILE_SECONDS` are not written (small helpers would
only fill the directory). `CacheEvents` counts jax's own cache hit and miss events, so a
run can say whether its step came from the cache.
"""

from __future__ import annotations

import os
import threading

import jax
import jax.monitoring
from jax.experimental.compilation_cache import compilation_cache as jax_cache

OFF = "off"
MIN_COMPILE_SECONDS = 1.0
_HIT = "/jax/compilation_cache/cache_hits"
_MISS = "/jax/compilation_cache/cache_misses"


def default_dir() -> str:
    """$DM_JAX_COMPILE_CACHE, else the user cache directory's dm_jax/jax."""
    if os.environ.get("DM_JAX_COMPILE_CACHE"):
        return os.environ["DM_JAX_COMPILE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dm_jax", "jax")


def enable(where: str | None) -> str | None:
    """Points jax's persistent compilation cache at `where` (None: `default_dir()`; "off":
    no cache). Returns the directory in use, or None when off. A directory that cannot be
    created raises ValueError naming --compile-cache."""
    jax_cache.reset_cache()  # jax opens its cache once per process; this call may move it
    if where == OFF:
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    path = os.path.abspath(os.path.expanduser(where or default_dir()))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"--compile-cache {path!r}: cannot create it ({e.strerror or e}); "
            f"give another directory or '{OFF}'"
        ) from e
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class CacheEvents:
    """Counts persistent-cache hits and misses reported by jax while it is entered.

    with CacheEvents() as events:
        step(...)
    events.hits, events.misses
    """

    def __init__(self):
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def _listen(self, event: str, **kwargs) -> None:
        with self._lock:
            if event == _HIT:
                self.hits += 1
            elif event == _MISS:
                self.misses += 1

    def __enter__(self) -> "CacheEvents":
        jax.monitoring.register_event_listener(self._listen)
        return self

    def __exit__(self, *exc) -> bool:
        jax.monitoring.unregister_event_listener(self._listen)
        return False

    def describe(self) -> str:
        """'loaded from the persistent cache', 'compiled (not in the cache)', ..."""
        if self.hits and not self.misses:
            return "loaded from the persistent cache"
        if self.misses and not self.hits:
            return "compiled (not in the persistent cache yet)"
        if self.hits:
            return f"{self.hits} program(s) from the cache, {self.misses} compiled"
        return "compiled (persistent cache off or program below the size threshold)"
