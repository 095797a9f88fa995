"""SGLang's `sglang.srt.*` paths that frontend programs import (`sglang.srt.utils`,
`sglang.srt.constrained.outlines_backend`), naming plait's own functions."""
