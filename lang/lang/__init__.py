"""SGLang's module paths (`sglang.lang.*`), so a program that imports them runs after its import root alone
changes from `sglang` to `plait`. Each module here only names plait's own objects; nothing is implemented
twice."""
