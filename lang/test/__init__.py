"""SGLang's `sglang.test` paths that its benchmark scripts import (`sglang.test.test_utils`)."""
