"""The worker process: run loop, handler pool, lease keeper, NOTIFY listener, metrics."""
