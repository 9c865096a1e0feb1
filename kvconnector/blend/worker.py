"""Worker half of blend: runs each step's blends and document saves.

A blend whose documents are all in memory runs on the main thread in ``start_load_kv``,
before the forward pass of the step that first schedules the request (vLLM was told the
range is a synchronous load). One that needs the disk or Redis parks the request in vLLM's
``WAITING_FOR_REMOTE_KVS``: the copy thread fetches the pieces into their slots, and the
blend itself runs on the main thread at the end of a later step (``run_ready``, from
``get_finished``), never alongside a forward pass; only then is the request reported
received. Document saves run on the copy thread after the forward that computed them.

A document that cannot be read (missing, corrupt, wrong header) is recomputed with the
rest of the range and forgotten by the scheduler. Any other failure reports the whole range
as load errors, so vLLM recomputes it.

``BlendWorker`` is a plug-in of the worker half: it is handed the half's copy thread and
ledger (counters, load errors, report, received requests) and, once vLLM registers its KV
tensors, the tensors and the half's store (pool slots and the tiers behind them), rather
than keeping copies of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvconnector import compat
from kvconnector.background import CopyThread
from kvconnector.blend.families import BlendUnsupported, adapt
from kvconnector.blend.pages import TokenPages, probe_cpu_packing
from kvconnector.blend.plan import BlendJob, DocLoad, DocSave
from kvconnector.blend.recompute import LoadedPiece, PagedAttention, Sources, run_blend
from kvconnector.blend.segments import PieceHeader, PieceHeaderError, piece_capacity, piece_view
from kvconnector.config import ConnectorConfig
from kvconnector.layout import LayerLayout
from kvconnector.ledger import Ledger
from kvconnector.store import ChunkCorrupt
from kvconnector.worker_store import WorkerStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec

    from kvconnector.metadata import StepPlan

logger = logging.getLogger("kvconnector.blend.worker")


class BlendWorker:
    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig, spec: AttentionSpec,
                 num_cache_layers: int, copies: CopyThread, ledger: Ledger) -> None:
        """Checks at start-up that this engine and model can be blended."""
        self.config = config.blending
        self.spec = spec
        self.copies = copies
        self.ledger = ledger
        try:
            reason = compat.blend_unsupported_reason(vllm_config)
            if reason is not None:
                raise BlendUnsupported(reason)
            self.model = adapt(compat.loaded_model(vllm_config), vllm_config.model_config.dtype)
        except BlendUnsupported as e:
            raise BlendUnsupported.refusing(e) from None
        g = self.model.geometry
        if (g.num_kv_heads, g.head_size) != (spec.num_kv_heads, spec.head_size):
            raise BlendUnsupported(
                f"blend cannot run: the model's attention ({g.num_kv_heads} KV heads of "
                f"{g.head_size}) differs from its KV cache ({spec.num_kv_heads} of "
                f"{spec.head_size})")
        if num_cache_layers != g.num_layers:
            raise BlendUnsupported(f"blend cannot run: {num_cache_layers} KV cache layers "
                                   f"for {g.num_layers} decoder layers")
        if self.config.check_layer >= g.num_layers:
            raise BlendUnsupported(f"blend_check_layer={self.config.check_layer} but the "
                                   f"model has {g.num_layers} layers (0..{g.num_layers - 1})")
        self._vllm_config = vllm_config
        self.block_size = spec.block_size
        self.chunk_size = config.chunk_size
        self.cap = piece_capacity(self.chunk_size)
        self.pages: TokenPages | None = None
        self.store: WorkerStore | None = None
        self._on_cuda = False
        self._paged: PagedAttention | None = None
        self._lock = threading.Lock()
        self._ready: list[BlendJob] = []  # async blends whose pieces have arrived
        self._fetching: set[str] = set()
        logger.info("kvconnector blend: %s, %d layers, strategy %s", self.model.family,
                    g.num_layers, self.config.strategy)

    def attach(self, layers: Sequence[torch.Tensor], layout: LayerLayout,
               store: WorkerStore) -> None:
        """After ``register_kv_caches``: token-granular access to the KV tensors, and the
        half's store for the pieces."""
        spec = self.spec
        packing = None
        if layout.family == "cpu-pages":
            packing = probe_cpu_packing(compat.cpu_kv_writer(self._vllm_config, spec),
                                        layout.dtype, layout.kernel_block_size,
                                        spec.num_kv_heads, spec.head_size)
            # vLLM's own kernel: about 3x faster than torch's attention on CPU here, and
            # the very arithmetic of vLLM's prefill.
            self._paged = compat.cpu_paged_attention(self._vllm_config, spec)
        self.pages = TokenPages(layers, layout, self.block_size, spec.num_kv_heads,
                                spec.head_size, packing)
        self._piece(store.pool.slot(0))  # the slot geometry fits a piece (raises if not)
        self.store = store
        self._on_cuda = bool(layers) and layers[0].is_cuda

    def _piece(self, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.model.geometry
        return piece_view(slot, g.num_layers, g.num_kv_heads, g.head_size, self.chunk_size)

    # ---- blends ----
    def start(self, plan: StepPlan) -> None:
        for job in plan.blends:
            if job.prefix_unready:
                self._recomputed(job, blend_prefix_unready=1)
                continue
            if not job.load_async:
                self.copies.wait_for_slots(job.slots)
                self._run(job)
                continue
            with self._lock:
                self._fetching.add(job.req_id)
            self.ledger.start_fetch(lambda j=job: self.copies.submit(
                lambda: self._fetch(j), [j.req_id], j.slots))

    def _fetch(self, job: BlendJob) -> None:
        """Copy thread: pieces from disk or Redis into their slots; the blend waits for the
        main thread."""
        try:
            assert self.store is not None
            self.store.fetch([(p.slot, p.chunk_hash, p.source, 0)
                              for d in job.docs for p in d.pieces if p.source != "memory"])
        except Exception:  # a failed fetch leaves slots unsealed: those documents recompute
            logger.exception("kvconnector: fetching blend pieces for %s failed", job.req_id)
        finally:
            with self._lock:
                self._fetching.discard(job.req_id)
                self._ready.append(job)
            self.ledger.fetch_over()

    def run_ready(self) -> None:
        """Main thread, after a forward pass: blend the parked requests whose pieces have
        arrived, then report them received."""
        with self._lock:
            ready, self._ready = self._ready, []
        for job in ready:
            try:
                self._run(job)
            finally:
                self.ledger.received(job.req_id)

    def _run(self, job: BlendJob) -> None:
        assert self.pages is not None
        start = time.perf_counter()
        try:
            sources = self._sources(job)
            with torch.inference_mode():
                result = run_blend(self.model, self.pages, job, sources, self.block_size,
                                   self._paged)
        except Exception:  # the range is recomputed by vLLM, never served wrong
            logger.exception("kvconnector: blending request %s failed; its blocks will be "
                             "recomputed", job.req_id)
            self._recomputed(job, load_errors=1, blend_failures=1)
            return
        seconds = time.perf_counter() - start
        self.ledger.observe(blend_seconds=seconds)
        self.ledger.count(blend_requests=1, blend_tokens=result.tokens,
                          blend_loaded_tokens=result.loaded,
                          blend_recomputed_tokens=result.recomputed, blend_seconds=seconds)
        logger.debug("kvconnector blend %s: %d tokens, %d loaded from %d documents, %d "
                     "recomputed, %.1f ms", job.req_id, result.tokens, result.loaded,
                     len(job.docs), result.recomputed, seconds * 1e3)

    def _recomputed(self, job: BlendJob, **counts: float) -> None:
        """The blended range left unfilled: vLLM recomputes it."""
        bs = self.block_size
        self.ledger.load_failed(job.req_id, 0, job.block_ids[job.start // bs:job.end // bs])
        self.ledger.count(**counts)

    def _sources(self, job: BlendJob) -> Sources:
        pieces: list[LoadedPiece] = []
        doc_starts: list[int] = []
        for doc in job.docs:
            try:
                got = self._read_doc(job, doc)
            except (ChunkCorrupt, PieceHeaderError) as e:
                logger.warning("kvconnector: blend document of %s not usable (%s); it is "
                               "recomputed", job.req_id, e)
                self.ledger.bad_chunks(p.chunk_hash for p in doc.pieces)
                self.ledger.count(blend_doc_errors=1)
                continue
            pieces.extend(got)
            doc_starts.append(doc.start - job.start)
        g = self.model.geometry
        return Sources(job.end - job.start, job.start, pieces, doc_starts, self.model.rotator,
                       (g.num_kv_heads, g.head_size), self.model.device, self.model.dtype)

    def _read_doc(self, job: BlendJob, doc: DocLoad) -> list[LoadedPiece]:
        assert self.store is not None
        out = []
        for i, p in enumerate(doc.pieces):
            data, header = self._piece(self.store.read(p.slot, p.chunk_hash))
            h = PieceHeader.unpack(header.numpy().tobytes())
            want = min(self.cap, doc.length - i * self.cap)
            if h.tokens != want or h.doc_hash != doc.doc_hash:
                raise PieceHeaderError(f"piece {i} holds {h.tokens} tokens of another "
                                       f"document (expected {want})")
            out.append(LoadedPiece(doc.start + i * self.cap - job.start, data[:, :, :want],
                                   h.position))
        return out

    # ---- document saves ----
    def save_docs(self, plan: StepPlan) -> None:
        """Queue this step's document saves behind the forward pass (copy thread)."""
        done = None
        if self._on_cuda:
            done = torch.cuda.Event()
            done.record()  # the forward that computed the documents, on this stream
        saves = list(plan.doc_saves)
        self.copies.submit(lambda: self._save(saves, done), {s.req_id for s in saves},
                           [slot for s in saves for _, _, slot in s.pieces])

    def _save(self, saves: list[DocSave], computed: torch.cuda.Event | None) -> None:
        if computed is not None:
            computed.synchronize()
        for s in saves:
            try:
                self._save_doc(s)
            except Exception:
                logger.exception("kvconnector: saving a blend document of %s failed", s.req_id)
                self.ledger.bad_chunks(h for _, h, _ in s.pieces)
                self.ledger.count(save_errors=1)

    def _save_doc(self, s: DocSave) -> None:
        assert self.pages is not None and self.store is not None
        store, bs = self.store, self.block_size
        start = time.perf_counter()
        ids = self.pages.kernel_ids(s.block_ids)
        off = s.start - s.start // bs * bs
        views = [(i, h, slot, *self._piece(store.begin_write(slot))) for i, h, slot in s.pieces]
        for layer in range(self.model.geometry.num_layers):
            kv = self.pages.read(layer, ids)[:, off:off + s.length]
            for i, _, _, data, _ in views:
                n = min(self.cap, s.length - i * self.cap)
                data[layer, :, :n].copy_(kv[:, i * self.cap:i * self.cap + n])
        for i, h, slot, _, header in views:
            n = min(self.cap, s.length - i * self.cap)
            raw = PieceHeader(n, s.start + i * self.cap, s.doc_hash).pack()
            header.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            store.seal(slot, h)
        self.ledger.count(blend_saved_docs=1, blend_saved_pieces=len(views),
                          save_seconds=time.perf_counter() - start)

    def outstanding(self) -> dict[str, int]:
        with self._lock:
            return {"blend_ready": len(self._ready), "blend_fetching": len(self._fetching)}
