"""The edgeserve CLI: pull, up, serve, bench."""
