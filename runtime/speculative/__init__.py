"""Speculative decoding: draft tokens proposed cheaply, then scored by the target in one VERIFY step.

What proposes (`ngram.py` prompt lookup and `grammar_drafts.py` forced tokens on the scheduler's side;
`draft_model.py` and `eagle.py` on the runner's, on the device), how a step of draft trees is laid
out as plain data (`tree.py`, `verify_step.py`), and how drafts are accepted so that outputs stay the
target's own (`acceptance.py`: the longest greedy match, or rejection sampling). The scheduler's part
that decides who speculates and commits what was accepted is scheduler/speculation.py.
"""
