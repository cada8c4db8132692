"""A serving process's Python heap, kept out of the steps' way.

A full collection (generation 2) of Python's cycle collector walks every object the interpreter
tracks, and after start-up a worker tracks a great many: torch's, Triton's and the model's
modules, the compiled kernels, the captured graphs. The imports alone leave about 190,000, which
one full collection takes 70–90 ms to walk on a two-core machine. While a worker collects it
launches nothing, so its device idles, and a TP peer waits for it inside the next sum: such
collections, triggered by allocations every few hundred steps, stop a tp=2 run for 100–150 ms a
few times unless the heap is frozen (BENCHMARKS.md, "Stalls between tp=2 steps").

``freeze_start_up_heap`` collects once and moves every object that survives into the
interpreter's permanent generation (``gc.freeze``): later collections walk only what the
serving loop made since. The processes pipeserve owns freeze once they are ready to serve
(each worker after it loaded, the engine server after its engine started, the HTTP frontend
once the engine is ready; vLLM's API server does the same); a library user's
process (``LLM(...)``) is left as it is, since frozen objects are never collected by the
cycle collector again, and a worker that returns into one (an SPMD rank under an outer
torchrun) thaws the heap first (``thaw_heap``).

``CollectionPauses`` counts the collections of each generation and times them, for the
benchmarks' stage timelines.
"""

from __future__ import annotations

import gc
import time


def freeze_start_up_heap() -> int:
    """Collect, then freeze every surviving object; returns how many are frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Undo ``freeze_start_up_heap``: the frozen objects are the collector's again (a cycle among
    them, say a dropped model's, can then be collected)."""
    gc.unfreeze()


class CollectionPauses:
    """The cycle collector's collections in this process from construction (or the last
    ``restart``) until ``close``, per generation: how many, their summed and their longest
    duration."""

    def __init__(self) -> None:
        self.restart()
        self._began: float | None = None
        gc.callbacks.append(self._on_collection)

    def restart(self) -> None:
        """Forget the collections so far (a worker's start-up, its own freeze included), and note
        how many objects the collector walks now."""
        self._by_generation = {g: [0, 0.0, 0.0] for g in range(3)}  # count, total s, longest s
        self._tracked_at_start = len(gc.get_objects())

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            took = time.perf_counter() - self._began
            self._began = None
            entry = self._by_generation[info["generation"]]
            entry[0] += 1
            entry[1] += took
            entry[2] = max(entry[2], took)

    def summary(self) -> dict:
        """``frozen``: objects in the permanent generation; ``tracked_at_start`` and ``tracked``:
        those the collector walked at the (re)start and walks now (more now, by a count that grows
        with the steps served, is objects kept, or cycles left, per step); per generation ``n``,
        ``total_ms`` and ``max_ms``."""
        out: dict = {"frozen": gc.get_freeze_count(), "tracked_at_start": self._tracked_at_start,
                     "tracked": len(gc.get_objects())}
        for g, (n, total, longest) in self._by_generation.items():
            out[f"gen{g}"] = {"n": n, "total_ms": round(total * 1e3, 3), "max_ms": round(longest * 1e3, 3)}
        return out

    def close(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
