"""The decode worker: Reserve / Decode / Abort over one engine whose KV pool lives in shared memory."""
