"""LoRA adapters on one base model, many in one batch: PEFT folders read and checked (adapter.py), the
scheduler's registry of loaded adapters and their device slots (registry.py), the runner's device pool
(slots.py), a rank's part of each adapter on a model split over ranks (shard.py), and the segmented LoRA
matmul beside the fused base projections (matmul.py)."""
