"""RL math as pure functions over arrays: the advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++), every loss
(``losses``, in torch: the registered policy losses, MARFT's among them, the regularisers and the critic's value
loss), MARFT's action- and token-level GAE and advantage normalisation, and the parsing and numeric comparison of
math answers that rewards are made of. No I/O, no bus; imports the kernel at most.
"""
