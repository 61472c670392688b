"""The one definition of block hashing (chained, tenant-salted), shared by gateway and workers,
and the Redis index of which worker holds which blocks (built from the workers' KV events)."""
