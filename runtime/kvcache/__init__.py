"""The KV-cache wing: paged KV memory (token slots, the request-to-token table, the K/V pool) and the
prefix caches over it (the radix tree, and a cache that shares nothing)."""
