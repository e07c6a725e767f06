"""Hostile input and long runs against a real governor (docs/reliability.md).

- `fuzz`: seeded raw bytes, mutated frames and dropped connections (`make fuzz SECONDS=60 SEED=1`).
- `soak`: valid, hostile and slow clients at once for a while (`make soak SECONDS=600`).
"""
