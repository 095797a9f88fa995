"""plait.grammars: built-in grammars and named regexes, shipped as package data.

- `plait.grammars.regexes`: `REGEXES` (integer, float, boolean, iso_date, email, ipv4, string)
  and `regex(name)`, e.g. `gen(regex=regex("email"))`.
- `plait.grammars.library`: `load_ebnf("json")` returns the shipped JSON EBNF grammar
  (`json.ebnf`), e.g. `gen(ebnf=load_ebnf("json"))`; `available_grammars()` lists them.
"""
