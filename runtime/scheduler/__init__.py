"""The scheduler wing: what runs each step (admission, decode batches, retraction, results), over the
KV manager and a step runner it is handed. `python -m plait.runtime.scheduler ARGS.pkl` is the scheduler
process (started by the Engine)."""
