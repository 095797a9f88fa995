"""Speculative decoding: draft tokens proposed cheaply, then scored by the target in one VERIFY step.

What proposes (`proposer.py`: `ngram.py` prompt lookup and `grammar_drafts.py` forced tokens on the
scheduler's side; `drafter.py`'s `Drafter`s, `draft_model.py` and `eagle.py`, on the runner's, on the
device), whether drafts pay (`policy.py`: the cost model, the guard, pauses), how a step of draft trees
is laid out as plain data (`tree.py`, `verify_step.py`), and how drafts are accepted so that outputs
stay the target's own (`acceptance.py`: the longest greedy match, or rejection sampling). The
scheduler's part that builds the VERIFY batch and commits what was accepted is scheduler/speculation.py.
"""
