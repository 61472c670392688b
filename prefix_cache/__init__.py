"""Chained, tenant-salted block hashing and the Redis prefix index (later issues)."""
