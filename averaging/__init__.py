"""Averaging: bounded groups that re-form on churn, the all-reduce policy, compression, robust aggregation.

Will own group formation, fault-tolerant rounds, 8-bit transfers and robust aggregation (issue 4).
Until then `swarm.trainer` uses hivemind's DecentralizedAverager directly, with every timeout set.
Nothing is exported yet.
"""
