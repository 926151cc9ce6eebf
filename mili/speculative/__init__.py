"""Speculative decoding: draft proposers (``ngram``) and the verification rule (``verify``).

A step verifies a sequence's k drafted tokens in the same forward pass as everything else: the sequence
computes its last token and the k drafts (k + 1 positions), the sampler draws one token per position as if
the drafts before it were accepted, and the drafts are accepted while they equal those draws
(``verify.accept``). The first draw that differs, or the draw after the last draft, is the step's own
token: every step emits 1 to k + 1 tokens. Greedy output is exactly the plain one; sampled output follows
the same distribution (the sampler accepts a draft d with probability p(d) and otherwise draws from p
without d, runtime/sampler.py), so drafts change speed, never what is generated.
"""
