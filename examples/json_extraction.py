"""Constrained decoding: JSON that follows a schema, a named regex, an EBNF grammar.

    .venv/bin/python examples/json_extraction.py

The runtime masks every token the grammar does not allow, so even a 135M model's output parses
(a constraint fixes the form of the answer, not its truth). `gen(json_schema=Model)` takes a Pydantic
class (or a dict / JSON string); `state.parsed(name)` returns the output as an instance of it.
`gen(regex=...)` takes a pattern or a name from `plait.grammars.regexes` ("integer", "float",
"boolean", "iso_date", "email", "ipv4", "string"); `gen(ebnf=...)` a grammar whose rule `root` is the
whole output (`plait.grammars.library.load_ebnf("json")` is a shipped one).
"""

import plait as sgl
from pydantic import BaseModel


class Contact(BaseModel):
    name: str
    city: str
    age: int


PASSAGE = "Maria Lopez, 34, moved from Lisbon to Berlin on 2024-03-15 to work as a nurse."


@sgl.function
def extract(s, passage):
    s += sgl.system("You extract facts from text.")
    s += sgl.user("Text: " + passage + "\nGive her name, the city she lives in now and her age as JSON.")
    s += sgl.assistant(sgl.gen("contact", max_tokens=48, json_schema=Contact))
    s += sgl.user("When did she move?")
    s += sgl.assistant("She moved on " + sgl.gen("moved_on", max_tokens=12, regex="iso_date"))
    s += sgl.user("Does she still live in Lisbon?")
    s += sgl.assistant(sgl.gen("in_lisbon", max_tokens=4, ebnf='root ::= "yes" | "no"'))


def main() -> None:
    runtime = sgl.Runtime()
    sgl.set_default_backend(runtime)
    state = extract.run(passage=PASSAGE, temperature=0)
    contact = state.parsed("contact")  # a Contact instance, validated by Pydantic
    print(f"contact:   {contact!r}")
    print(f"moved on:  {state['moved_on']}")
    print(f"in Lisbon: {state['in_lisbon']}")
    runtime.shutdown()


if __name__ == "__main__":
    main()
