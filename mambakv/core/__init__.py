"""The core of mambakv, with no torch: errors, blocks and the free queue, hashing, requests,
specs, the block pool and its KV events. Every module here imports only the ones listed before
it in ``docs/architecture.md``."""
