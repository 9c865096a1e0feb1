"""GPU paged KV <-> pinned host chunks, through a reusable GPU staging buffer (CUDA only).

Save: the Triton kernel gathers a batch of chunks into staging at device bandwidth, then ONE
large ``copy_(non_blocking=True)`` moves them to pinned host memory. Load is the reverse: one
H2D copy into staging, then scatter. Many small per-block copies would be latency bound, and
kernels storing straight into host memory over PCIe reach a fraction of the DMA engines'
bandwidth; the staging hop costs a device-memory pass, which is ~50x cheaper than PCIe.

All work runs on a side stream. It first waits on an event recorded on the caller's
(compute) stream, so it sees every KV write queued before the call; ``save``/``load`` return
an event that completes when the data is in place. Before reading the host tensor, call
``event.synchronize()``; before attention reads loaded blocks, make the compute stream
``wait_event`` it. The caller must not reuse those KV blocks or the host tensor before then.
Nothing here touches CUDA at import time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvconnector.layout import LayerLayout


class HostTransfer:
    """Moves batches of chunks between paged KV layers on one GPU and pinned host tensors."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: LayerLayout,
                 kernel_blocks_per_chunk: int, max_chunks: int = 4) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("HostTransfer needs CUDA; on CPU use kvconnector.kernels")
        if not layers or not all(t.is_cuda and t.device == layers[0].device for t in layers):
            raise ValueError("HostTransfer needs every KV layer on the same CUDA device")
        if kernel_blocks_per_chunk < 1 or max_chunks < 1:
            raise ValueError("kernel_blocks_per_chunk and max_chunks must be >= 1")
        from kvconnector.kernels import triton_copy  # Triton only once CUDA is in use

        self._copy = triton_copy
        self.layers = list(layers)
        self.layout = layout
        self.device = layers[0].device
        self.kernel_blocks_per_chunk = kernel_blocks_per_chunk
        self.chunk_shape = (len(layers), *layout.chunk_shape(kernel_blocks_per_chunk))
        self.stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(self.stream):  # owned by the stream that uses it
            self.staging = torch.empty((max_chunks, *self.chunk_shape), dtype=layout.dtype,
                                       device=self.device)

    @property
    def max_chunks(self) -> int:
        return self.staging.shape[0]

    def alloc_host(self, num_chunks: int) -> torch.Tensor:
        """A pinned host tensor for ``num_chunks`` chunks."""
        return torch.empty((num_chunks, *self.chunk_shape), dtype=self.layout.dtype,
                           pin_memory=True)

    def save(self, block_ids: torch.Tensor, host: torch.Tensor,
             after: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        """Gather chunks ``block_ids`` ([C, blocks_per_chunk], -1 = zeros) into ``host``.

        ``after`` is the stream whose queued work must come first (default: the current
        stream). Pass ``block_ids`` on the CPU; CUDA ids cost a device sync for validation.
        """
        return self._run(block_ids, host, after, save=True)

    def load(self, host: torch.Tensor, block_ids: torch.Tensor,
             after: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        """Scatter the chunks in pinned ``host`` into blocks ``block_ids`` (-1 = skip)."""
        return self._run(block_ids, host, after, save=False)

    def _run(self, block_ids: torch.Tensor, host: torch.Tensor,
             after: torch.cuda.Stream | None, save: bool) -> torch.cuda.Event:
        if block_ids.dim() != 2 or block_ids.shape[1] != self.kernel_blocks_per_chunk:
            raise ValueError(f"block_ids must be [num_chunks, {self.kernel_blocks_per_chunk}], "
                             f"got shape {tuple(block_ids.shape)}")
        want = (block_ids.shape[0], *self.chunk_shape)
        if tuple(host.shape) != want or host.dtype != self.layout.dtype:
            raise ValueError(f"host tensor is {host.dtype} {tuple(host.shape)}, expected "
                             f"{self.layout.dtype} {want}")
        if host.device.type != "cpu" or not host.is_pinned() or not host.is_contiguous():
            raise ValueError("host tensor must be a contiguous pinned CPU tensor "
                             "(see alloc_host); pageable memory would make the copy synchronous")
        if not block_ids.is_cuda:
            block_ids = block_ids.pin_memory()  # so the kernel's id upload stays async
        ready = torch.cuda.Event()
        ready.record(after if after is not None else torch.cuda.current_stream(self.device))
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            # Staging is only touched on this stream, so batches reuse it in order.
            for lo in range(0, block_ids.shape[0], self.max_chunks):
                ids = block_ids[lo:lo + self.max_chunks]
                stage, dst = self.staging[:ids.shape[0]], host[lo:lo + ids.shape[0]]
                if save:
                    self._copy.gather(self.layers, self.layout, ids, stage)
                    dst.copy_(stage, non_blocking=True)
                else:
                    stage.copy_(dst, non_blocking=True)
                    self._copy.scatter(stage, self.layout, ids, self.layers)
            done.record(self.stream)
        return done
