"""`sglang.srt.constrained`: the constraint helpers frontend programs import."""
