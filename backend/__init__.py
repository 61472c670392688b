"""Model runtime, paged KV cache, scheduler, sampling and worker servers."""
