"""What a write session tells its caller: the progress bar while it runs and the
:class:`ConvertReport` at the end."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from fastdata.common.units import format_size


@dataclass
class ConvertReport:
    """Summary of one conversion."""

    dst: str
    backend: str
    images: int = 0
    rejected: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    elapsed: float = 0.0
    shards: int = 0
    resumed_shards: int = 0
    already_complete: bool = False
    #: the content options used, in the units they were given (e.g. "shard size 2 GB (2,000,000,000 bytes)")
    options: str = ""
    rejected_items: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    #: what ``images`` counts, in the summary ("samples" for fastdata.write)
    unit: str = "images"
    #: lines about what was stored: formats, dtypes and channels, the default read mode recorded
    notes: list = field(default_factory=list)
    #: after an append (``append=True``): ``(samples, shards)`` the store holds now; the other
    #: counts are the append's own
    store_total: tuple[int, int] | None = None

    @property
    def images_per_s(self) -> float:
        return self.images / self.elapsed if self.elapsed > 0 else 0.0

    def summary(self) -> str:
        """A few human-readable lines."""
        if self.already_complete:
            return f"{self.dst}: already a complete store ({self.images} {self.unit}); nothing to do"
        verb, new = ("appended", "new ") if self.store_total is not None else ("wrote", "")
        lines = [
            f"{verb} {self.images} {self.unit} to {self.dst} ({self.backend}, {self.shards} {new}shard(s)"
            + (f", {self.resumed_shards} kept from the interrupted run" if self.resumed_shards else "") + ")"
            + (f"; the store now holds {self.store_total[0]} {self.unit} in {self.store_total[1]} shard(s)"
               if self.store_total is not None else ""),
            f"rejected {self.rejected} input(s)" + (f" (listed in {os.path.join(self.dst, 'rejected.tsv')})"
                                                    if self.rejected else ""),
            f"input {format_size(self.input_bytes)}, output {format_size(self.output_bytes)}, "
            f"{self.elapsed:.1f} s, {self.images_per_s:.0f} {self.unit}/s",
        ] + ([f"options: {self.options}"] if self.options else []) + list(self.notes)
        for path, reason in self.rejected_items[:5]:
            lines.append(f"  rejected {path}: {reason}")
        if self.rejected > 5:
            lines.append(f"  ... and {self.rejected - 5} more")
        return "\n".join(lines)


class ProgressBar:
    """tqdm with images/s and MB/s; silent when disabled or not on a terminal.

    The bar is created at the first update, after the worker pool started: tqdm
    runs a monitor thread, and a pool forked from a threaded process is unsafe
    (the pipeline then falls back to the slower forkserver).
    """

    def __init__(self, total: int, enabled: bool | None, desc: str = "convert"):
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.enabled = enabled
        self.total = total
        self.desc = desc
        self.bar = None
        self.bytes = 0
        self.rejected = 0
        self.t0 = time.perf_counter()

    def update_counts(self, images: int, rejected: int, nbytes: int) -> None:
        self.bytes += nbytes
        self.rejected += rejected
        if self.enabled and self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="img", desc=self.desc, dynamic_ncols=True, smoothing=0.1)
        if self.bar is not None:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{self.bytes / dt / 1e6:.1f} MB/s, {self.rejected} rejected", refresh=False)
            self.bar.update(images + rejected)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
