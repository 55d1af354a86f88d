"""The labs that run on a local runtime (engine.runtime): batched decode (batching), continuous batching against
static batching with a paged KV cache (scheduler), and speculative decoding (speculative); each has its CLI
(`python -m engine bench-batch | schedule | speculate`) and its typed events (spec_events, schedule_events)."""
