"""``hybridspec distill``: training a feature-level draft head (the ``eagle`` proposer's) for a
target on this machine, from data the target makes itself (``data``, ``sources``, ``train``)."""
