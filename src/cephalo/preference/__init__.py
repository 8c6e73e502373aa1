"""Preference training (DPO): pairs of completions, their data and their objective.

The data side renders TRL's preference formats into pairs of token rows with their loss masks
(prepared once, like chat data); the objective side turns each pair's summed completion
log-probabilities, the policy's and the reference's, into the DPO loss and TRL's metrics.
"""
