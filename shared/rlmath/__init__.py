"""RL math as pure functions over arrays: the advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++), MARFT's
action- and token-level GAE, advantage normalisation and objectives (``marft_loss``, in torch), and the parsing
and numeric comparison of math answers that rewards are made of. No I/O, no bus; imports the kernel at most.
"""
