"""CacheBlend: reuse the KV of documents at any position in a prompt (docs/blend.md).

    config.py      the ``blend*`` keys and their per-request overrides
    segments.py    prompt -> documents; document and piece keys; the piece header
    plan.py        what the scheduler half tells the workers (blends, document saves)
    scheduler.py   scheduler half: which documents are stored, the blended range, saves
    rope.py        moving stored keys to new positions (RoPE re-rotation)
    pages.py       token-granular K/V access to vLLM's paged KV tensors (CPU and GPU)
    families.py    the model families blend can run, over vLLM's own modules
    recompute.py   the selective recompute itself
    strategies/    which loaded tokens it recomputes: one file per strategy, a registry
    worker.py      worker half: runs blends and document saves
"""
